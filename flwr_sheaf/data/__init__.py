"""Data: image sources, the paper's label-shift partition (Eq. 23) and shared pilots."""

from flwr_sheaf.data.partition import (
    AgentData,
    FederatedSplit,
    label_shift_proportions,
    load_agent_data,
    make_federated_split,
)
from flwr_sheaf.data.sources import SOURCE_FORMS, clear_source_cache, load_source

__all__ = [
    "AgentData",
    "FederatedSplit",
    "SOURCE_FORMS",
    "clear_source_cache",
    "label_shift_proportions",
    "load_agent_data",
    "load_source",
    "make_federated_split",
]
