"""Deprecated alias of :mod:`flwr_sheaf.methods.comfed.strategy` (the method's unit; kept so old imports work)."""

import sys

from ..methods.comfed import strategy as _unit

sys.modules[__name__] = _unit
