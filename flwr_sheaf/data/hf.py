"""flwr-datasets integration ("hf" extra): the paper's partition as a flwr-datasets ``Partitioner``
(a module of its own so that importing the package does not import flwr-datasets)."""

from __future__ import annotations

import numpy as np

from flwr_sheaf.data.partition import (
    ClassSets,
    FederatedSplit,
    _check_fraction,
    _check_seed,
    _check_shift,
    _normalise_class_sets,
    make_federated_split,
)
from flwr_sheaf.paper import NUM_CLASSES

try:  # optional: the flwr-datasets integration ("hf" extra)
    from flwr_datasets.partitioner import Partitioner as _PartitionerBase

    _HAVE_FLWR_DATASETS = True
except ImportError:  # pragma: no cover - exercised only without flwr-datasets
    _PartitionerBase = object
    _HAVE_FLWR_DATASETS = False

__all__ = ["LabelShiftPartitioner"]


class LabelShiftPartitioner(_PartitionerBase):
    """flwr-datasets ``Partitioner`` applying the paper's pilot hold-out and Eq. 23 split
    (:func:`make_federated_split` on the ``partition_by`` label column; ``N = len(class_sets)``).

    ``load_partition(i)`` returns agent ``i``'s pool (train + val + test, pilots excluded);
    :attr:`split` holds the 80/10/10 indices, :attr:`pilot_indices` the pilots. Example::

        fds = FederatedDataset(dataset="ylecun/mnist", partitioners={"train": LabelShiftPartitioner(
            PAPER_CLASS_SETS_15, shift=0.7)})
        agent0 = fds.load_partition(0)

    Raises:
        ImportError: flwr-datasets is not installed.
        ValueError: bad arguments (checked eagerly) or an unknown partition id.
    """

    def __init__(
        self,
        class_sets: ClassSets,
        shift: float,
        seed: int = 42,
        partition_by: str = "label",
        pilot_fraction: float = 0.1,
        num_pilots: int | None = None,
        num_classes: int = NUM_CLASSES,
    ) -> None:
        if not _HAVE_FLWR_DATASETS:
            raise ImportError(
                "LabelShiftPartitioner needs flwr-datasets: `pip install flwr-sheaf[hf]`"
            )
        super().__init__()
        self._shift = _check_shift(shift)  # checked in label_shift_proportions' order
        self._class_sets = _normalise_class_sets(class_sets, num_classes)
        self._seed = _check_seed(seed)
        self._partition_by = partition_by
        self._pilot_fraction = _check_fraction("pilot_fraction", pilot_fraction, allow_zero=False)
        self._num_pilots = num_pilots
        self._num_classes = num_classes
        self._split: FederatedSplit | None = None

    @property
    def num_partitions(self) -> int:
        """Number of agents ``N``."""
        return len(self._class_sets)

    @property
    def split(self) -> FederatedSplit:
        """The :class:`FederatedSplit` of the assigned dataset (computed once, lazily)."""
        if self._split is None:
            if self._partition_by not in self.dataset.column_names:
                raise ValueError(
                    f"label column {self._partition_by!r} not in dataset columns {self.dataset.column_names}"
                )
            labels = np.asarray(self.dataset[self._partition_by])
            self._split = make_federated_split(
                labels,
                self._class_sets,
                self._shift,
                self._seed,
                pilot_fraction=self._pilot_fraction,
                num_pilots=self._num_pilots,
                num_classes=self._num_classes,
            )
        return self._split

    @property
    def pilot_indices(self) -> np.ndarray:
        """int64 ``(K,)`` row indices of the shared pilots in the assigned dataset (permuted order)."""
        return self.split.pilot_idx

    def load_partition(self, partition_id: int):
        """Agent ``partition_id``'s pool as a ``datasets.Dataset`` (pilots excluded).

        Raises:
            ValueError: if ``partition_id`` is outside ``[0, N)`` (names it and ``N``).
        """
        return self.dataset.select(self.split.pool_idx(partition_id).tolist())
