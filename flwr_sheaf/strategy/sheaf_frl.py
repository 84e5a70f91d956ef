"""Deprecated alias of :mod:`flwr_sheaf.methods.sheaf_frl.strategy` (the method's unit; kept so old imports work)."""

import sys

from ..methods.sheaf_frl import strategy as _unit

sys.modules[__name__] = _unit
