"""Deprecated alias of :mod:`flwr_sheaf.methods.fedproto.client` (the method's unit; kept so old imports work)."""

import sys

from ..methods.fedproto import client as _unit

sys.modules[__name__] = _unit
