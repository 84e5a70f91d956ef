"""Deprecated alias of :mod:`flwr_sheaf.methods.fedsaf.client` (the method's unit; kept so old imports work)."""

import sys

from ..methods.fedsaf import client as _unit

sys.modules[__name__] = _unit
