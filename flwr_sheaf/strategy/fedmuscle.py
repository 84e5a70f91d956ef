"""Deprecated alias of :mod:`flwr_sheaf.methods.fedmuscle.strategy` (the method's unit; kept so old imports work)."""

import sys

from ..methods.fedmuscle import strategy as _unit

sys.modules[__name__] = _unit
