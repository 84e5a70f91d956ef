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
    "LabelShiftPartitioner",
    "SOURCE_FORMS",
    "clear_source_cache",
    "label_shift_proportions",
    "load_agent_data",
    "load_source",
    "make_federated_split",
]


def __getattr__(name: str):
    """``LabelShiftPartitioner`` is imported on first use (flwr-datasets is slow to import)."""
    if name == "LabelShiftPartitioner":
        from flwr_sheaf.data.hf import LabelShiftPartitioner

        return LabelShiftPartitioner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
