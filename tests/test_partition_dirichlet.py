"""Dirichlet label shift (run-config ``partitioner=dirichlet:<alpha>``; FedSAF's protocol, issue 12)."""

from __future__ import annotations

import numpy as np
import pytest

from flwr_sheaf.config import ConfigError, RunConfig
from flwr_sheaf.data.partition import make_dirichlet_split, parse_partitioner


def _labels():
    return np.repeat(np.arange(10), 200)  # 2,000 samples, 200 per class


def test_split_is_disjoint_covering_and_is_the_flwr_datasets_assignment():
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    lab = _labels()
    sp = make_dirichlet_split(lab, 5, 0.3, seed=4)
    parts = [sp.pilot_idx] + list(sp.train_idx) + list(sp.val_idx) + list(sp.test_idx)
    allidx = np.concatenate(parts)
    assert allidx.size == np.unique(allidx).size == lab.size  # disjoint and covering
    assert sp.pilot_idx.size == 200
    # the agents' pools are exactly DirichletPartitioner's partitions of the non-pilot rows
    rest = np.sort(np.setdiff1d(np.arange(lab.size), sp.pilot_idx))
    ref = DirichletPartitioner(
        num_partitions=5,
        partition_by="label",
        alpha=0.3,
        min_partition_size=10,
        self_balancing=False,
        shuffle=True,
        seed=4,
    )
    ref.dataset = Dataset.from_dict({"label": lab[rest].tolist(), "row": list(range(rest.size))})
    for i in range(5):
        np.testing.assert_array_equal(
            sp.pool_idx(i), np.sort(rest[np.asarray(ref.load_partition(i)["row"])])
        )
        counts = np.bincount(lab[sp.pool_idx(i)], minlength=10)
        assert sp.class_sets[i] == tuple(np.flatnonzero(counts))


def test_alpha_controls_the_label_skew():
    lab = _labels()

    def mean_max_share(alpha):
        c = make_dirichlet_split(lab, 5, alpha, seed=1).class_counts(lab).astype(float)
        return float(np.mean(c.max(axis=1) / c.sum(axis=1)))

    assert mean_max_share(0.05) > 0.35 > 0.2 > mean_max_share(100.0)  # IID share would be 0.1


def test_partitioner_key_is_parsed_and_refused_by_name():
    assert parse_partitioner("label-shift") is None
    assert parse_partitioner(" dirichlet:0.5 ") == 0.5
    for bad in ("dirichlet:0", "dirichlet:-1", "dirichlet:x", "iid"):
        with pytest.raises(ValueError, match="partitioner="):
            parse_partitioner(bad)
    assert (
        RunConfig.from_run_config({"partitioner": "dirichlet:0.1"}).scenario.partitioner
        == "dirichlet:0.1"
    )
    with pytest.raises(ConfigError, match="partitioner='dirichlet:0'"):
        RunConfig.from_run_config({"partitioner": "dirichlet:0"})
    with pytest.raises(ValueError, match="alpha"):
        make_dirichlet_split(_labels(), 3, 0.0, seed=0)
