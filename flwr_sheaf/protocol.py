"""The flwr-sheaf core message protocol: message types, record names and keys every method shares,
pack/unpack helpers and the reply checks (numpy only; a method's own keys live in its unit or
:mod:`flwr_sheaf.methods._shared.protocol`).

Message types are ``<category>.<action>``: ``query`` (reply :class:`NodeInfo`), ``train`` (reply
:data:`TRAIN_REPLY`), ``evaluate`` (:data:`EVAL_REPLY`) and ``evaluate.<action>_comm`` (arrays of
:func:`route_evaluation`, reply :data:`COMM_REPLY`); the round flow is in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from .data.partition import pilot_digest

__all__ = [
    "QUERY",
    "TRAIN",
    "EVALUATE",
    "message_type",
    "comm_action",
    "required",
    "CONFIG",
    "INFO",
    "METRICS",
    "ARRAYS",
    "SERVER_ROUND",
    "SEED",
    "TORCH_THREADS",
    "DEVICE",
    "WHITENING_FIT",
    "WHITENING_FITS",
    "NUM_EXAMPLES",
    "EVAL_ARRAYS",
    "STALK_DIM",
    "PRIVATE_ACCURACY",
    "VAL_PRIVATE_ACCURACY",
    "NUM_TEST",
    "LOW_VARIANCE_FRACTION",
    "DEVICE_INDEX",
    "device_index",
    "device_name",
    "COMM_SRC",
    "COMM_ACCURACY",
    "VAL_COMM_ACCURACY",
    "PILOT_READING",
    "SECOND_READING",
    "NodeInfo",
    "EdgeConfig",
    "pack_arrays",
    "route_evaluation",
    "unpack_routed",
    "OutsideScenarioError",
    "ProtocolError",
    "reply_problem",
    "pilot_digest",
    "EVAL_REPLY",
    "COMM_REPLY",
    "TRAIN_REPLY",
    "EVAL_TRANSPORTED",
    "STRINGENT_EVAL_ARRAYS",
    "STRINGENT_EVAL_LABELS",
    "array_record",
    "config_record",
    "metric_record",
    "as_int",
    "as_float",
    "PATH_MAP",
    "NON_EDGE_SRC",
    "NON_EDGE_ACCURACY",
    "VAL_NON_EDGE_ACCURACY",
    "NON_EDGE_DIRECT_ACCURACY",
    "VAL_NON_EDGE_DIRECT_ACCURACY",
    "NON_EDGE_REPLY",
    "NonEdgeConfig",
    "route_non_edges",
    "train_reply_problem",
]


R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)


class ProtocolError(ValueError):
    """A message does not follow the protocol (missing record or key, wrong shape or layout)."""


class OutsideScenarioError(ValueError):
    """A task factory's answer for a partition-id outside the scenario (a spare SuperNode): the
    query handler replies a :class:`NodeInfo` with ``d = 0`` instead of failing."""


# ------------------------------------------------------------------------------ typed accessors
# Flower types records and config values as unions: these check the type once, at the boundary
# (ProtocolError naming the key; a missing key still raises KeyError).
def _record(content: Mapping[str, object], key: str, cls: type[R]) -> R:
    rec = content[key]
    if not isinstance(rec, cls):
        raise ProtocolError(f"record {key!r}: expected {cls.__name__}, got {type(rec).__name__}")
    return rec


def array_record(content: Mapping[str, object], key: str) -> ArrayRecord:
    """``content[key]``, checked to be an ``ArrayRecord``."""
    return _record(content, key, ArrayRecord)


def config_record(content: Mapping[str, object], key: str) -> ConfigRecord:
    """``content[key]``, checked to be a ``ConfigRecord``."""
    return _record(content, key, ConfigRecord)


def metric_record(content: Mapping[str, object], key: str) -> MetricRecord:
    """``content[key]``, checked to be a ``MetricRecord``."""
    return _record(content, key, MetricRecord)


def _entry(value: object, key: str, cls: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, cls):
        raise ProtocolError(f"{key!r}: expected {what}, got {type(value).__name__}")
    return value


_NUMBER = (int, float, np.integer, np.floating)


def as_int(value: object, key: str) -> int:
    """``int(value)`` of a record entry ``key`` (an int or a float, as ``int()`` took it)."""
    return int(_entry(value, key, _NUMBER, "a number"))


def as_float(value: object, key: str) -> float:
    """``float(value)`` of a record entry ``key`` (an int or a float)."""
    return float(_entry(value, key, _NUMBER, "a number"))


def as_list(value: object, key: str) -> list[float]:
    """A list record entry ``key`` (a MetricRecord's ``list[int] | list[float]``; ints pass as floats)."""
    return _entry(value, key, list, "a list")


def as_bytes(value: object, key: str) -> bytes:
    """A bytes record entry ``key``."""
    return _entry(value, key, bytes, "bytes")


# ------------------------------------------------------------------------------ message types
QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"


def message_type(category: str, action: str) -> str:
    """``"<category>.<action>"``, e.g. ``message_type(TRAIN, "sheaf") == "train.sheaf"``."""
    return f"{category}.{action}"


def comm_action(action: str) -> str:
    """Action of the second evaluation phase (communication accuracy): ``"<action>_comm"``."""
    return f"{action}_comm"


def required(cfg: Mapping, key: str, msg_type: str):
    """``cfg[key]`` of a message config, or a :class:`ProtocolError` naming it and ``msg_type``."""
    if key not in cfg:
        raise ProtocolError(f"{msg_type} message config lacks {key!r}")
    return cfg[key]


# ------------------------------------------------------------------------------ record names
CONFIG = "config"
INFO = "info"
METRICS = "metrics"
ARRAYS = "arrays"

# ------------------------------------------------------------------------------ config keys (not run-config keys)
SERVER_ROUND = "server-round"
SEED = "seed"
TORCH_THREADS = "torch-threads"
#: the node's device spec (run-config ``device``) in ``query`` and ``evaluate`` configs.
DEVICE = "device"
#: where a node fits its whitening for evaluation: ``"pilots"`` (Sheaf-FRL) or ``"train"`` (post hoc).
WHITENING_FIT = "whitening-fit"
WHITENING_FITS = ("pilots", "train")
#: evaluation config: 1 when the sender's own map moved its arrays into the edge stalk (``privacy =
#: stringent``), so the receiver fits its own map (P2c/P2d) instead of the edge's (Eq. 18).
EVAL_TRANSPORTED = "eval-transported"
#: evaluation config: 1 when the node also gives the second reading (:data:`SECOND_READING`,
#: ``posthoc-readings = both``; notes/baselines.md).
PILOT_READING = "pilot-reading"

# ------------------------------------------------------------------------------ array and metric keys
NUM_EXAMPLES = "num-examples"
#: arrays of a node's phase-1 evaluation reply (whitened latents, labels).
EVAL_ARRAYS = ("pilots", "test-latents", "test-labels", "val-latents", "val-labels")
#: the second reading by the node's own ``whitening-fit``: ``{fit: (phase-1 arrays, phase-2 test /
#: validation metrics)}``: pilots ``(K, d_i)``, latents ``(M, d_i)`` whitened the other way (routed
#: as :data:`EVAL_ARRAYS`), metrics per incoming edge. ``"train"`` (post hoc): whitening fitted on
#: the pilots (``pw-``); ``"pilots"`` (Sheaf-FRL): the paper's, on the training latents (``tw-``).
SECOND_READING = {
    fit: (
        tuple(f"{p}-{n}" for n in ("pilots", "test-latents", "val-latents")),
        (f"communication-accuracy-{w}-whitening", f"val-communication-accuracy-{w}-whitening"),
    )
    for fit, p, w in (("train", "pw", "pilot"), ("pilots", "tw", "train"))
}
STALK_DIM = "d"
PRIVATE_ACCURACY = "private-accuracy"
VAL_PRIVATE_ACCURACY = "val-private-accuracy"
NUM_TEST = "num-test"
LOW_VARIANCE_FRACTION = "low-variance-fraction"
#: the device of the node's evaluation (optional phase-1 metric): -1 CPU, N ``cuda:N``
#: (:func:`device_index`); ``results.json``'s ``nodes[...]["device"]``.
DEVICE_INDEX = "device-index"
#: a stringent phase-1 evaluation reply: ``"<j>/<name>"`` per neighbour j for these names (moved by
#: the node's map toward j, ``(., d_e)``), and the labels once, unkeyed.
STRINGENT_EVAL_ARRAYS = ("pilots", "test-latents", "val-latents")
STRINGENT_EVAL_LABELS = ("test-labels", "val-labels")
COMM_SRC = "src"
COMM_ACCURACY = "communication-accuracy"
VAL_COMM_ACCURACY = "val-communication-accuracy"


def device_index(device: object) -> int:
    """:data:`DEVICE_INDEX` of a ``torch.device`` or its text: -1 ``cpu``, N ``cuda:N`` (``cuda``:
    the current device), else -2."""
    text = str(device)
    if text == "cpu":
        return -1
    if text == "cuda":
        import torch  # only a node that computes on CUDA gets here

        return int(torch.cuda.current_device())
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    return -2


def device_name(index: int) -> str:
    """Text of a :data:`DEVICE_INDEX`: ``"cpu"`` (-1), ``"cuda:N"`` (N >= 0), else ``"other"``."""
    if index == -1:
        return "cpu"
    return f"cuda:{index}" if index >= 0 else "other"


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """``ArrayRecord`` from named numpy arrays of any shapes and dtypes (e.g. ``(K, d_j)`` pilots)."""
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


# ------------------------------------------------------------------------------ discovery
@dataclass(frozen=True)
class NodeInfo:
    """What a node reports in its ``query.<action>`` reply (record ``info``; docs/own-app.md).

    Attributes:
        partition_id: the node's partition-id (``node_config["partition-id"]``).
        num_partitions: ``node_config["num-partitions"]`` (0 if the node has none).
        d: stalk (latent) dimension d_i (for RFedAGS: the point's size).
        classes: target class set C_i (may be empty).
        num_pilots: pilots K the node holds (-1 if not a pilot method).
        num_examples: private training samples.
        pilot_digest: :func:`pilot_digest` of the node's pilot inputs (0 = not reported).
    """

    partition_id: int
    num_partitions: int
    d: int
    classes: tuple[int, ...] = ()
    num_pilots: int = -1
    num_examples: int = 0
    pilot_digest: int = 0

    def to_record(self) -> MetricRecord:
        """``MetricRecord`` form of the reply: each field under its name with ``-`` for ``_``."""
        out = {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}
        return MetricRecord({**out, "classes": [int(c) for c in self.classes]})

    @classmethod
    def from_record(cls, rec: Mapping) -> NodeInfo:
        """Inverse of :meth:`to_record` (``pilot-digest`` may be absent: 0); a missing key raises
        :class:`ProtocolError`."""
        try:
            values = {
                f.name: rec[f.name.replace("_", "-")]
                for f in fields(cls)
                if f.name != "pilot_digest" or "pilot-digest" in rec
            }
        except KeyError as exc:
            raise ProtocolError(f"discovery reply lacks key {exc.args[0]!r}") from None
        classes = tuple(int(c) for c in values.pop("classes"))
        return cls(classes=classes, **{k: int(v) for k, v in values.items()})


# ------------------------------------------------------------------------------ edges
@dataclass(frozen=True)
class EdgeConfig:
    """A node's incident edges as sent in its ``config`` (lists aligned by index; paper Sec. 3 orientation, Eq. 11).

    Attributes:
        neighbours: neighbour partition-ids j (sorted).
        dims: their stalk dimensions d_j.
        heads: ``True`` where this node is the head of edge (i, j) (larger d; tie: larger
            partition-id; :func:`flwr_sheaf.sheaf.network.orient_edge`).
        weights: optional edge-term multipliers ``w_ij >= 0`` (``drop-reweighted``); None = all 1.
    """

    neighbours: tuple[int, ...]
    dims: tuple[int, ...]
    heads: tuple[bool, ...]
    weights: tuple[float, ...] | None = None

    KEYS = ("neighbours", "neighbour-dims", "i-is-head", "edge-weights")

    def __post_init__(self) -> None:
        n = len(self.neighbours)
        if (
            len(self.dims) != n
            or len(self.heads) != n
            or (self.weights is not None and len(self.weights) != n)
        ):
            raise ProtocolError(
                f"malformed edge config: {n} neighbours, {len(self.dims)} dims, {len(self.heads)} "
                f"roles, {None if self.weights is None else len(self.weights)} weights"
            )
        for j, w in zip(self.neighbours, self.weights or ()):
            if not (np.isfinite(w) and w >= 0.0):
                raise ProtocolError(
                    f"edge weight of neighbour partition-id {j} must be finite and >= 0, got {w}"
                )

    def to_config(self) -> dict:
        """Config-record entries (lists of int/float)."""
        lists = (self.neighbours, self.dims, self.heads)
        out: dict[str, list[int] | list[float]] = {
            k: [int(x) for x in v] for k, v in zip(self.KEYS, lists)
        }
        if self.weights is not None:
            out["edge-weights"] = [float(w) for w in self.weights]
        return out

    @classmethod
    def from_config(cls, cfg: Mapping) -> EdgeConfig:
        """Inverse of :meth:`to_config` (:class:`ProtocolError`: bad lists or weights)."""
        missing = [k for k in cls.KEYS[:3] if k not in cfg]
        if missing:
            raise ProtocolError(f"edge config lacks {missing}")
        w = cfg["edge-weights"] if "edge-weights" in cfg else None
        return cls(
            tuple(int(j) for j in cfg["neighbours"]),
            tuple(int(d) for d in cfg["neighbour-dims"]),
            tuple(bool(int(h)) for h in cfg["i-is-head"]),
            None if w is None else tuple(float(x) for x in w),
        )

    def keep(self, present: Iterable[int]) -> EdgeConfig:
        """The edges to neighbours in ``present`` only."""
        idx = [i for i, j in enumerate(self.neighbours) if j in set(present)]
        pick = lambda xs: tuple(xs[i] for i in idx)  # noqa: E731
        return EdgeConfig(
            pick(self.neighbours),
            pick(self.dims),
            pick(self.heads),
            None if self.weights is None else pick(self.weights),
        )


# ------------------------------------------------------------------------------ reply checks
def reply_problem(content: Mapping, required: Mapping[str, Iterable[str]]) -> str | None:
    """What a reply lacks, or None: ``required`` maps record names to the keys each must hold."""
    for name, keys in required.items():
        if name not in content:
            return f"reply lacks record {name!r}"
        missing = [k for k in keys if k not in content[name]]
        if missing:
            return f"record {name!r} of the reply lacks {missing}"
    return None


#: What a train reply of a graph method must hold.
TRAIN_REPLY = {METRICS: (NUM_EXAMPLES,)}
#: What a phase-1 evaluation reply must hold.
EVAL_REPLY = {
    ARRAYS: EVAL_ARRAYS,
    METRICS: (STALK_DIM, PRIVATE_ACCURACY, VAL_PRIVATE_ACCURACY, LOW_VARIANCE_FRACTION),
}
#: What a phase-2 (communication accuracy) reply must hold.
COMM_REPLY = {METRICS: (COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY)}


# ------------------------------------------------------------------------------ evaluation routing
def route_evaluation(
    phase1: Mapping[int, ArrayRecord], neighbours: Sequence[int], names: Sequence[str] = EVAL_ARRAYS
) -> ArrayRecord:
    """Phase-2 payload of one receiver: each neighbour j's arrays ``names`` keyed ``"<j>/<name>"``
    (``KeyError``: a neighbour without phase-1 arrays)."""
    return pack_arrays(
        {f"{j}/{name}": phase1[j][name].numpy() for j in neighbours for name in names}
    )


def unpack_routed(
    rec: ArrayRecord, j: int, names: Sequence[str] = EVAL_ARRAYS
) -> dict[str, np.ndarray]:
    """Neighbour j's arrays ``names`` from a :func:`route_evaluation` record (:class:`ProtocolError`
    naming a missing one)."""
    out = {}
    for name in names:
        key = f"{j}/{name}"
        if key not in rec:
            raise ProtocolError(f"evaluation routing lacks {key!r}")
        out[name] = rec[key].numpy()
    return out


# ------------------------------------------------------------------------------ non-edge transport (multi-hop)
#: routed array ``"<j>/path-map"`` of a non-edge source j: the map ``(d_i, d_j)`` (float64) composed
#: along a shortest path.
PATH_MAP = "path-map"
#: per non-edge source metrics of a phase-2 reply: accuracy after multi-hop transport and after
#: direct Procrustes, test and validation.
NON_EDGE_SRC = "non-edge-src"
NON_EDGE_ACCURACY = "non-edge-communication-accuracy"
VAL_NON_EDGE_ACCURACY = "val-non-edge-communication-accuracy"
NON_EDGE_DIRECT_ACCURACY = "non-edge-direct-communication-accuracy"
VAL_NON_EDGE_DIRECT_ACCURACY = "val-non-edge-direct-communication-accuracy"
#: what a phase-2 reply must hold when non-edge sources were routed to it.
NON_EDGE_REPLY = {
    METRICS: (
        NON_EDGE_SRC,
        NON_EDGE_ACCURACY,
        VAL_NON_EDGE_ACCURACY,
        NON_EDGE_DIRECT_ACCURACY,
        VAL_NON_EDGE_DIRECT_ACCURACY,
    )
}


@dataclass(frozen=True)
class NonEdgeConfig:
    """A receiver's non-edge sources in its ``evaluate.<action>_comm`` config (lists aligned by
    index; multi-hop transport: notes/variants-diagnostics.md).

    Attributes:
        sources: source partition-ids j (not neighbours of the receiver).
        dims: their stalk dimensions d_j.
        heads: ``True`` where the receiver is the head of the direct pair (as :class:`EdgeConfig`).
        hops: path lengths (>= 2).
    """

    sources: tuple[int, ...] = ()
    dims: tuple[int, ...] = ()
    heads: tuple[bool, ...] = ()
    hops: tuple[int, ...] = ()

    KEYS = ("non-edge-sources", "non-edge-dims", "non-edge-i-is-head", "non-edge-hops")

    def __post_init__(self) -> None:
        n = len(self.sources)
        if len(self.dims) != n or len(self.heads) != n or len(self.hops) != n:
            raise ProtocolError(
                f"malformed non-edge config: {n} sources, {len(self.dims)} dims, {len(self.heads)} "
                f"roles, {len(self.hops)} hop counts"
            )

    def to_config(self) -> dict:
        """Config-record entries (empty when there are no sources: the keys are then left out)."""
        lists = (self.sources, self.dims, self.heads, self.hops)
        return {k: [int(x) for x in v] for k, v in zip(self.KEYS, lists)} if self.sources else {}

    @classmethod
    def from_config(cls, cfg: Mapping) -> NonEdgeConfig:
        """Inverse of :meth:`to_config` (no keys = no sources; :class:`ProtocolError`: some keys
        missing, or unequal lists)."""
        present = [k for k in cls.KEYS if k in cfg]
        if not present:
            return cls()
        if len(present) != len(cls.KEYS):
            raise ProtocolError(
                f"non-edge config has {present} but lacks {[k for k in cls.KEYS if k not in cfg]}"
            )
        s, d, h, n = (tuple(int(x) for x in cfg[k]) for k in cls.KEYS)
        return cls(s, d, tuple(bool(x) for x in h), n)


def route_non_edges(
    phase1: Mapping[int, ArrayRecord], maps: Mapping[int, np.ndarray]
) -> dict[str, np.ndarray]:
    """Phase-2 arrays ``{"<j>/<name>": array}`` of a receiver's non-edge sources: j's
    :data:`EVAL_ARRAYS` and ``maps[j]`` ``(d_receiver, d_j)`` as :data:`PATH_MAP` (``KeyError``:
    a source without phase-1 arrays)."""
    out = {}
    for j, t in maps.items():
        out.update({f"{j}/{name}": phase1[j][name].numpy() for name in EVAL_ARRAYS})
        out[f"{j}/{PATH_MAP}"] = np.ascontiguousarray(t, dtype=np.float64)
    return out


# ------------------------------------------------------------------------------ train-reply values
def weight_problem(name: str, value: object) -> str | None:
    """Why a reply's weight (e.g. ``num-examples``) is unusable, or None if a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} = {value!r} is not a number"
    if not (np.isfinite(value) and value > 0):
        return f"{name} = {value!r} must be a finite number > 0"
    return None


def train_reply_problem(content: Mapping, arrays: bool = False) -> str | None:
    """Why the server and the node refuse a train reply, or None (docs/guarantees.md).

    Refused: ``num-examples`` not a finite number > 0, a NaN or infinite scalar metric, an infinite
    entry of a list metric (NaN there means "not measured"); with ``arrays`` a NaN/inf float array.
    """
    m = content[METRICS]
    why = weight_problem(NUM_EXAMPLES, m[NUM_EXAMPLES])
    if why is not None:
        return why
    for k, x in m.items():  # a scalar must be finite; NaN entries of a list mean "not measured"
        if isinstance(x, float) and np.isinf(x):
            return f"metric {k} = {x} is infinite"
        if isinstance(x, float) and np.isnan(x):
            return (
                f"metric {k} = nan is not a number (a diverged loss or a broken metric; a metric a "
                f"node does not measure is left out of its reply, not sent as NaN)"
            )
        if isinstance(x, list):
            bad = [i for i, v in enumerate(x) if isinstance(v, float) and np.isinf(v)]
            if bad:
                return f"metric {k} (a list of {len(x)}) entry {bad[0]} = {x[bad[0]]} is infinite"
    if arrays:
        for name, rec in content.items():
            if not isinstance(rec, ArrayRecord):
                continue
            for key in rec.keys():
                a = rec[key].numpy()
                if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
                    return f"array {name}/{key} of shape {a.shape} has {int((~np.isfinite(a)).sum())} NaN/inf entries"
    return None


#: Keys of a resumed run's ``query`` config (read by :func:`flwr_sheaf.client.state.persist_state`):
#: per partition-id the last round whose training the checkpoint accepted (0 = never), the
#: checkpointed round, and ``resume-fresh-nodes``.
RESUME_STATE_ROUNDS = "resume-state-rounds"
RESUME_ROUND = "resume-round"
RESUME_FRESH = "resume-fresh-nodes"
