"""Deprecated alias of :mod:`flwr_sheaf.methods.rfedags.baselines_strategy` (the method's unit; kept so old imports work)."""

import sys

from ..methods.rfedags import baselines_strategy as _unit

sys.modules[__name__] = _unit
