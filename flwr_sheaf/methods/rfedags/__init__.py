"""RFedAGS and its baselines (RFedAvg, RFedSVRG, RFedProj): Riemannian federated optimisation."""

ACTION = "rfedags"

from .client import register_rfedags_baseline_handlers, register_rfedags_handlers  # noqa: E402,F401
from .strategy import RFedAGS  # noqa: E402,F401
from .baselines_strategy import RFedBaseline  # noqa: E402,F401
