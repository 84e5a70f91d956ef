"""Deprecated alias of :mod:`flwr_sheaf.methods.noncooperative.client` (the method's unit; kept so old imports work)."""

import sys

from ..methods.noncooperative import client as _unit

sys.modules[__name__] = _unit
