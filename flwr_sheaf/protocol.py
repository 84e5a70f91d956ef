"""The flwr-sheaf message protocol: every message type, record name and key, with pack/unpack helpers.

Both sides import this module; ``strategy/`` never imports ``client/`` and vice versa
(``tests/test_layers.py`` walks the imports). Payloads are numpy arrays here (no torch), so the
server needs no model code.

Message types (``<category>.<action>``; the action is a handler's name, e.g. ``"sheaf"``):

===================================== ================================================================
message                                content (server -> node) / reply (node -> server)
===================================== ================================================================
``query.<action>``                    ``config``: :data:`TORCH_THREADS`, :data:`DEVICE` (graph methods) / ``info``
                                      (:class:`NodeInfo`)
``train.<action>``                    ``config``: the method's config sections + :data:`SERVER_ROUND`,
                                      :data:`SEED` (+ :class:`EdgeConfig` for Sheaf-FRL);
                                      ``pilots`` (:func:`pack_neighbour_pilots`, Sheaf-FRL) and/or
                                      :data:`TRANSPORTED` (per-edge transported pilots, Sheaf-FRL
                                      variants, docs/variants-privacy.md);
                                      ``pilot-selection`` (:func:`pack_pilot_selection`, Sheaf-FRL
                                      with a ``pilot-strategy`` other than ``all``);
                                      ``global-prototypes`` (:func:`pack_prototypes`, FedProto/FedSAF)
                                      / ``metrics`` (``num-examples``, losses); ``pilots`` (own
                                      whitened pilots ``(K, d_i)``, key :data:`OWN_PILOTS`) and/or
                                      :data:`TRANSPORTED`; ``upload``
                                      (local prototypes; FedMuscle: :data:`PILOT_REPS`);
                                      FedMuscle's train message may carry its targets
``evaluate.<action>``                 ``config``: :data:`SERVER_ROUND`, :data:`WHITENING_FIT`,
                                      :data:`TORCH_THREADS`, :data:`DEVICE`, :data:`EVAL_TRANSPORTED`,
                                      :data:`PILOT_READING` (+ method keys) / :data:`EVAL_REPLY`
                                      (:func:`pack_evaluation`; with :data:`PILOT_READING` = 1 also
                                      :data:`PILOT_READING_ARRAYS`)
``evaluate.<action>_comm``            ``arrays``: :func:`route_evaluation`; ``config``: as phase 1 plus
                                      the :class:`EdgeConfig` / :data:`COMM_REPLY` (per incoming edge;
                                      with :data:`PILOT_READING` = 1 also
                                      :data:`COMM_ACCURACY_PILOT_WHITENING` and its ``val-`` twin)
===================================== ================================================================

RFedAGS uses ``train.rfedags`` with ``arrays`` = the point (key :data:`POINT`) and replies with
``stream`` (key :data:`STREAM`). Its baselines use ``train.rfedavg`` / ``train.rfedsvrg`` /
``train.rfedproj``: the config carries :data:`PHASE`; the reply's ``stream`` record holds the end point
(:data:`ENDPOINT`; RFedProj also :data:`MEAN_GRADIENT`) or, in RFedSVRG's ``"gradient"`` phase, the
Riemannian gradient at the server point (:data:`STREAM`); RFedSVRG's local phase receives
:data:`FULL_GRADIENT` and RFedProj's its correction :data:`CORRECTION` beside :data:`POINT` (for
RFedProj the server's ambient point).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

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
    "PILOTS",
    "ARRAYS",
    "UPLOAD",
    "GLOBAL_PROTOTYPES",
    "STREAM_RECORD",
    "PILOT_REPS",
    "TARGET_OTHERS",
    "TARGET_ALL",
    "SERVER_ROUND",
    "SEED",
    "TORCH_THREADS",
    "DEVICE",
    "WHITENING_FIT",
    "WHITENING_FITS",
    "NUM_CLASSES",
    "FEATURE_DIM",
    "LOCAL_STEPS",
    "STEP_SIZE",
    "MINIBATCH_SIZE",
    "POINT",
    "STREAM",
    "OWN_PILOTS",
    "NUM_EXAMPLES",
    "PHASE",
    "PHASE_GRADIENT",
    "PHASE_LOCAL",
    "ENDPOINT",
    "FULL_GRADIENT",
    "CORRECTION",
    "MEAN_GRADIENT",
    "EVAL_ARRAYS",
    "STALK_DIM",
    "PRIVATE_ACCURACY",
    "VAL_PRIVATE_ACCURACY",
    "NUM_TEST",
    "LOW_VARIANCE_FRACTION",
    "COMM_SRC",
    "COMM_ACCURACY",
    "VAL_COMM_ACCURACY",
    "PILOT_READING",
    "PILOT_READING_ARRAYS",
    "COMM_ACCURACY_PILOT_WHITENING",
    "VAL_COMM_ACCURACY_PILOT_WHITENING",
    "NodeInfo",
    "EdgeConfig",
    "pack_arrays",
    "pack_neighbour_pilots",
    "unpack_neighbour_pilots",
    "route_evaluation",
    "unpack_routed",
    "pack_prototypes",
    "unpack_prototypes",
    "ProtocolError",
    "pack_evaluation",
    "reply_problem",
    "pilot_digest",
    "EVAL_REPLY",
    "COMM_REPLY",
    "TRAIN_REPLY",
    "TRANSPORTED",
    "EVAL_TRANSPORTED",
    "SVDS",
    "STRINGENT_EVAL_ARRAYS",
    "STRINGENT_EVAL_LABELS",
    "PILOT_SELECTION",
    "PILOT_INDICES",
    "PILOT_GROUPS",
    "PILOT_INDEX_DIGEST",
    "PILOT_DESCRIBE",
    "PILOT_PUBLIC",
    "PILOT_LABELS",
    "PILOT_FEATURES",
    "index_digest",
    "pack_pilot_selection",
    "unpack_pilot_selection",
    "array_record",
    "config_record",
    "metric_record",
    "as_array",
    "as_int",
    "as_float",
    "as_str",
]


class ProtocolError(ValueError):
    """A message does not follow the protocol (missing record or key, wrong shape or layout)."""


# ------------------------------------------------------------------------------ typed accessors
# Flower types ``content[key]`` (a RecordDict or ``context.state``) as ``ArrayRecord | MetricRecord |
# ConfigRecord`` and a config value as ``Array | int | float | str | bytes | list[...]``. These
# accessors check the type once, at the boundary, and raise ProtocolError naming the key; a missing
# key still raises the KeyError of ``content[key]``.
def array_record(content: Mapping[str, object], key: str) -> ArrayRecord:
    """``content[key]``, checked to be an ``ArrayRecord``."""
    rec = content[key]
    if not isinstance(rec, ArrayRecord):
        raise ProtocolError(f"record {key!r}: expected an ArrayRecord, got {type(rec).__name__}")
    return rec


def config_record(content: Mapping[str, object], key: str) -> ConfigRecord:
    """``content[key]``, checked to be a ``ConfigRecord``."""
    rec = content[key]
    if not isinstance(rec, ConfigRecord):
        raise ProtocolError(f"record {key!r}: expected a ConfigRecord, got {type(rec).__name__}")
    return rec


def metric_record(content: Mapping[str, object], key: str) -> MetricRecord:
    """``content[key]``, checked to be a ``MetricRecord``."""
    rec = content[key]
    if not isinstance(rec, MetricRecord):
        raise ProtocolError(f"record {key!r}: expected a MetricRecord, got {type(rec).__name__}")
    return rec


def as_array(value: object, key: str) -> np.ndarray:
    """``value.numpy()`` of an ``Array`` record entry ``key``."""
    if not isinstance(value, Array):
        raise ProtocolError(f"{key!r}: expected an Array, got {type(value).__name__}")
    return value.numpy()


def as_int(value: object, key: str) -> int:
    """``int(value)`` of a record entry ``key`` (an int or a float, as ``int()`` took it)."""
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProtocolError(f"{key!r}: expected a number, got {type(value).__name__}")
    return int(value)


def as_float(value: object, key: str) -> float:
    """``float(value)`` of a record entry ``key`` (an int or a float)."""
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProtocolError(f"{key!r}: expected a number, got {type(value).__name__}")
    return float(value)


def as_list(value: object, key: str) -> list[float]:
    """A list record entry ``key`` (a MetricRecord's ``list[int] | list[float]``; ints pass as floats)."""
    if not isinstance(value, list):
        raise ProtocolError(f"{key!r}: expected a list, got {type(value).__name__}")
    return value


def as_bytes(value: object, key: str) -> bytes:
    """A bytes record entry ``key``."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"{key!r}: expected bytes, got {type(value).__name__}")
    return value


def as_str(value: object, key: str) -> str:
    """A string record entry ``key``."""
    if not isinstance(value, str):
        raise ProtocolError(f"{key!r}: expected a string, got {type(value).__name__}")
    return value


# ------------------------------------------------------------------------------ message types
QUERY, TRAIN, EVALUATE = "query", "train", "evaluate"


def message_type(category: str, action: str) -> str:
    """``"<category>.<action>"``, e.g. ``message_type(TRAIN, "sheaf") == "train.sheaf"``."""
    return f"{category}.{action}"


def comm_action(action: str) -> str:
    """Action of the second evaluation phase (communication accuracy): ``"<action>_comm"``."""
    return f"{action}_comm"


def required(cfg: Mapping, key: str, msg_type: str):
    """``cfg[key]`` of a message config, or a :class:`ProtocolError` naming the key and the message
    type ``msg_type`` (:func:`message_type`): every value a handler needs comes in the message."""
    if key not in cfg:
        raise ProtocolError(f"{msg_type} message config lacks {key!r}")
    return cfg[key]


# ------------------------------------------------------------------------------ record names
CONFIG = "config"
INFO = "info"
METRICS = "metrics"
PILOTS = "pilots"
ARRAYS = "arrays"
UPLOAD = "upload"
GLOBAL_PROTOTYPES = "global-prototypes"
STREAM_RECORD = "stream"

#: Sheaf-FRL variants (docs/variants-privacy.md): per-edge *transported* pilots ``X A`` keyed ``str(j)``.
#: In a train reply: the node's pilots moved by its own map toward each neighbour j (``(K, d_e)``,
#: ``d_e = max(d_i, d_j)``; homogeneous standard: only toward heads, ``(K, d)``). In a train message:
#: what each neighbour j sent toward this node (same keys). Under ``privacy = stringent`` it replaces
#: the ``pilots`` record both ways: raw pilots never leave the node.
TRANSPORTED = "transported"

# ------------------------------------------------------------------------------ config keys (not run-config keys)
SERVER_ROUND = "server-round"
SEED = "seed"
TORCH_THREADS = "torch-threads"
#: the node's device spec (run-config key ``device``) in ``query`` and ``evaluate`` configs (``train``
#: carries it inside :class:`~flwr_sheaf.config.LocalTrainConfig`).
DEVICE = "device"
#: where a node fits its whitening for evaluation: ``"pilots"`` (Sheaf-FRL) or ``"train"`` (post hoc).
WHITENING_FIT = "whitening-fit"
WHITENING_FITS = ("pilots", "train")
#: evaluation config (both phases): 1 when neighbours' evaluation arrays are transported by the
#: sender's own map into the edge stalk (``privacy = stringent``), so the receiver fits its own map
#: (P2c/P2d) instead of the edge's (Eq. 18); 0 otherwise.
EVAL_TRANSPORTED = "eval-transported"
#: evaluation config (both phases): 1 when a post-hoc method (``whitening-fit = "train"``) also gives
#: the *strong* post-hoc reading, with the whitening fitted on the pilots (run-config key
#: ``posthoc-readings = both``; docs/baselines.md); 0 otherwise.
PILOT_READING = "pilot-reading"
NUM_CLASSES = "num-classes"
FEATURE_DIM = "feature-dim"
LOCAL_STEPS = "local-steps"
STEP_SIZE = "step-size"
MINIBATCH_SIZE = "minibatch-size"
#: RFedAGS baselines: which part of a round a ``train.<baseline>`` message asks for.
PHASE = "phase"
PHASE_GRADIENT, PHASE_LOCAL = "gradient", "local"

# ------------------------------------------------------------------------------ array and metric keys
POINT = "x"
STREAM = "zeta"
#: RFedAGS baselines: a local end point (RFedProj: ambient ``z^_K``), the server gradient ``g_t`` (RFedSVRG),
#: a client's correction ``c_i`` and mean local gradient ``zeta_i`` (RFedProj).
ENDPOINT = "x-end"
FULL_GRADIENT = "g"
CORRECTION = "c"
MEAN_GRADIENT = "zeta-mean"
OWN_PILOTS = "pilots"
#: FedMuscle: a node's pooled pilot representations ``(K, D)`` (in its ``upload``) and the targets
#: ``(K, D)`` it receives: the mean of the other agents' and of all agents' representations.
PILOT_REPS = "pilot-reps"
TARGET_OTHERS = "others"
TARGET_ALL = "all"
NUM_EXAMPLES = "num-examples"
#: arrays of a node's phase-1 evaluation reply (whitened latents, labels).
EVAL_ARRAYS = ("pilots", "test-latents", "test-labels", "val-latents", "val-labels")
#: the strong post-hoc reading's extra phase-1 arrays (config :data:`PILOT_READING`): pilots ``(K, d_i)``
#: and test / validation latents ``(M, d_i)`` whitened with statistics fitted on the pilots (the
#: labels are :data:`EVAL_ARRAYS`'). Routed to neighbours like :data:`EVAL_ARRAYS`.
PILOT_READING_ARRAYS = ("pw-pilots", "pw-test-latents", "pw-val-latents")
#: the strong post-hoc reading's per-incoming-edge phase-2 metrics (lists aligned with :data:`COMM_SRC`).
COMM_ACCURACY_PILOT_WHITENING = "communication-accuracy-pilot-whitening"
VAL_COMM_ACCURACY_PILOT_WHITENING = "val-communication-accuracy-pilot-whitening"
STALK_DIM = "d"
PRIVATE_ACCURACY = "private-accuracy"
VAL_PRIVATE_ACCURACY = "val-private-accuracy"
NUM_TEST = "num-test"
LOW_VARIANCE_FRACTION = "low-variance-fraction"
#: Sheaf-FRL train metric: SVDs the node computed for its maps this round (docs/variants-privacy.md).
SVDS = "svds"
#: a stringent phase-1 evaluation reply: ``"<j>/<name>"`` per neighbour j for these names (moved by
#: the node's map toward j, ``(., d_e)``), and the labels once, unkeyed.
STRINGENT_EVAL_ARRAYS = ("pilots", "test-latents", "val-latents")
STRINGENT_EVAL_LABELS = ("test-labels", "val-labels")
COMM_SRC = "src"
COMM_ACCURACY = "communication-accuracy"
VAL_COMM_ACCURACY = "val-communication-accuracy"


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
        pilot_digest: :func:`pilot_digest` of the node's pilot inputs (0 = not reported); the graph
            strategies refuse nodes whose digests differ (pilots must be the same samples in the same order).
    """

    partition_id: int
    num_partitions: int
    d: int
    classes: tuple[int, ...] = ()
    num_pilots: int = -1
    num_examples: int = 0
    pilot_digest: int = 0

    def to_record(self) -> MetricRecord:
        """``MetricRecord`` form of the reply."""
        return MetricRecord(
            {
                "partition-id": self.partition_id,
                "num-partitions": self.num_partitions,
                "d": self.d,
                "classes": [int(c) for c in self.classes],
                "num-pilots": self.num_pilots,
                NUM_EXAMPLES: self.num_examples,
                "pilot-digest": self.pilot_digest,
            }
        )

    @classmethod
    def from_record(cls, rec: Mapping) -> NodeInfo:
        """Inverse of :meth:`to_record`.

        Raises:
            ProtocolError: a missing key (named).
        """
        try:
            return cls(
                int(rec["partition-id"]),
                int(rec["num-partitions"]),
                int(rec["d"]),
                tuple(int(c) for c in rec["classes"]),
                int(rec["num-pilots"]),
                int(rec[NUM_EXAMPLES]),
                int(rec["pilot-digest"]) if "pilot-digest" in rec else 0,
            )
        except KeyError as exc:
            raise ProtocolError(f"discovery reply lacks key {exc.args[0]!r}") from None


def pilot_digest(pilots: np.ndarray) -> int:
    """A 63-bit fingerprint of a node's pilot inputs ``(K, ...)``: SHA-256 of the shape and the float32
    bytes in row order, first 8 bytes, shifted to a positive int64 (fits a ``MetricRecord``).

    Two nodes agree iff (up to hash collisions) they hold the same pilot samples in the same order.
    """
    import hashlib

    a = np.ascontiguousarray(np.asarray(pilots, dtype=np.float32))
    h = hashlib.sha256(repr(a.shape).encode() + a.tobytes()).digest()
    return int.from_bytes(h[:8], "big") >> 1 or 1


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
        out: dict[str, list[int] | list[float]] = {
            "neighbours": [int(j) for j in self.neighbours],
            "neighbour-dims": [int(d) for d in self.dims],
            "i-is-head": [int(h) for h in self.heads],
        }
        if self.weights is not None:
            out["edge-weights"] = [float(w) for w in self.weights]
        return out

    @classmethod
    def from_config(cls, cfg: Mapping) -> EdgeConfig:
        """Inverse of :meth:`to_config`.

        Raises:
            ProtocolError: missing lists, lists of different lengths, a negative or non-finite weight.
        """
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


# ------------------------------------------------------------------------------ pilots
def reply_problem(content: Mapping, required: Mapping[str, Iterable[str]]) -> str | None:
    """What a reply lacks, or None: ``required`` maps record names to the keys each must hold.

    The strategies call it on every reply (:meth:`flwr_sheaf.strategy.exchange.Exchange.split_replies`),
    so a malformed reply becomes that node's recorded failure instead of a server crash.
    """
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


def pack_evaluation(
    pilots: np.ndarray,
    test_latents: np.ndarray,
    test_labels: np.ndarray,
    val_latents: np.ndarray,
    val_labels: np.ndarray,
    extra: Mapping[str, np.ndarray] | None = None,
) -> ArrayRecord:
    """A node's phase-1 evaluation arrays (names of :data:`EVAL_ARRAYS`, plus a method's ``extra``).

    Args:
        pilots: whitened pilots ``(K, d_i)`` float32.
        test_latents: whitened test latents ``(M, d_i)`` float32.
        test_labels: their labels ``(M,)`` int64.
        val_latents: whitened validation latents ``(M', d_i)`` float32.
        val_labels: their labels ``(M',)`` int64.
        extra: a method's own arrays (e.g. ComFed's projection and raw latents), or None.
    """
    base = dict(zip(EVAL_ARRAYS, (pilots, test_latents, test_labels, val_latents, val_labels)))
    return pack_arrays({**base, **dict(extra or {})})


def pack_neighbour_pilots(pilots: Mapping[int, np.ndarray]) -> ArrayRecord:
    """Neighbours' whitened pilot matrices ``{j: (K, d_j)}`` float32 -> ``ArrayRecord`` keyed ``str(j)``."""
    return pack_arrays({str(int(j)): a for j, a in pilots.items()})


def unpack_neighbour_pilots(rec: ArrayRecord) -> dict[int, np.ndarray]:
    """Inverse of :func:`pack_neighbour_pilots`: ``{j: (K, d_j)}`` float32 arrays.

    Raises:
        ProtocolError: a key that is not a partition-id.
    """
    out = {}
    for key in rec.keys():
        if not key.isdigit():
            raise ProtocolError(f"pilot record key {key!r} is not a partition-id")
        out[int(key)] = np.asarray(rec[key].numpy(), dtype=np.float32)
    return out


# ------------------------------------------------------------------------------ evaluation routing
def route_evaluation(
    phase1: Mapping[int, ArrayRecord], neighbours: Sequence[int], names: Sequence[str] = EVAL_ARRAYS
) -> ArrayRecord:
    """Phase-2 payload of one receiver: each neighbour j's arrays ``names`` keyed ``"<j>/<name>"``.

    Raises:
        KeyError: a neighbour without phase-1 arrays (callers route only answering neighbours,
            whose replies passed :data:`EVAL_REPLY`).
    """
    return pack_arrays(
        {f"{j}/{name}": phase1[j][name].numpy() for j in neighbours for name in names}
    )


def unpack_routed(
    rec: ArrayRecord, j: int, names: Sequence[str] = EVAL_ARRAYS
) -> dict[str, np.ndarray]:
    """Neighbour j's arrays ``names`` from a :func:`route_evaluation` record.

    Raises:
        ProtocolError: an array missing for j (named).
    """
    out = {}
    for name in names:
        key = f"{j}/{name}"
        if key not in rec:
            raise ProtocolError(f"evaluation routing lacks {key!r}")
        out[name] = rec[key].numpy()
    return out


# ------------------------------------------------------------------------------ prototypes
def pack_prototypes(
    protos: Mapping[int, np.ndarray], counts: Mapping[int, int] | None = None, dim: int = 0
) -> ArrayRecord:
    """Prototypes ``{class: (D,)}`` -> arrays ``classes (n,)`` int64, ``prototypes (n, D)`` float32
    [, ``counts (n,)`` int64]; ``dim`` gives D for an empty dict.

    Raises:
        KeyError: ``counts`` without an entry for a class of ``protos``.
    """
    classes = sorted(int(c) for c in protos)
    if classes:
        mat = np.stack([np.asarray(protos[c], dtype=np.float32) for c in classes])
    else:
        mat = np.zeros((0, int(dim)), np.float32)
    out: dict[str, np.ndarray] = {"classes": np.asarray(classes, dtype=np.int64), "prototypes": mat}
    if counts is not None:
        out["counts"] = np.asarray([int(counts[c]) for c in classes], dtype=np.int64)
    return pack_arrays(out)


def unpack_prototypes(
    rec: ArrayRecord, where: str
) -> tuple[dict[int, np.ndarray], dict[int, int] | None]:
    """Inverse of :func:`pack_prototypes` (keys are Python ints: class ids never become numpy scalars).

    Only the layout (ranks, lengths, integral unique class ids) and the counts (integers >= 1: they
    weight the aggregate) are checked here; the other values (NaN, class range) are checked by
    :func:`flwr_sheaf.methods._shared.prototypes.aggregate_prototypes`.

    Raises:
        ProtocolError: malformed record; the message starts with ``where`` (e.g. ``"partition-id 3"``).
    """
    missing = {"classes", "prototypes"} - set(rec.keys())
    if missing:
        raise ProtocolError(f"{where}: prototype record lacks {sorted(missing)}")
    classes = rec["classes"].numpy()
    protos = rec["prototypes"].numpy()
    counts = rec["counts"].numpy() if "counts" in rec else None
    if classes.ndim != 1 or not np.issubdtype(classes.dtype, np.integer):
        raise ProtocolError(
            f"{where}: class ids must be a 1-D integer array, got {classes.dtype} {classes.shape}"
        )
    if protos.ndim != 2 or protos.shape[0] != classes.shape[0]:
        raise ProtocolError(
            f"{where}: prototypes have shape {protos.shape}, expected ({classes.shape[0]}, D)"
        )
    if counts is not None and counts.shape != classes.shape:
        raise ProtocolError(f"{where}: counts have shape {counts.shape}, expected {classes.shape}")
    if counts is not None and not np.issubdtype(counts.dtype, np.integer):
        raise ProtocolError(
            f"{where}: counts must be integers, got dtype {counts.dtype} ({counts.tolist()[:10]})"
        )
    if counts is not None and counts.size and counts.min() < 1:
        bad = {int(c): int(n) for c, n in zip(classes.tolist(), counts.tolist()) if n < 1}
        raise ProtocolError(
            f"{where}: counts must be >= 1 (a prototype averages at least one sample), got {bad}"
        )
    ids = [int(c) for c in classes.tolist()]
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"{where}: class ids {ids} repeat")
    out = {c: protos[i].copy() for i, c in enumerate(ids)}
    return out, ({c: int(counts[i]) for i, c in enumerate(ids)} if counts is not None else None)


# ------------------------------------------------------------------------------ pilot selection (paper App. B)
#: Record of a ``train.sheaf`` message holding this round's pilot selection (:func:`pack_pilot_selection`);
#: absent under ``pilot-strategy=all``.
PILOT_SELECTION = "pilot-selection"
PILOT_INDICES = "indices"
PILOT_GROUPS = "groups"
#: Config key of ``train.sheaf`` (the :func:`index_digest` of the selection sent) and metric of the reply
#: (the digest of the selection the node used); the strategy refuses a reply whose digest differs.
PILOT_INDEX_DIGEST = "pilot-index-digest"
#: Config key of ``train.sheaf``: ``"class"`` or ``"cluster"`` asks the node to add :data:`PILOT_PUBLIC`
#: to its reply (the pilots' labels / public features, sent once so the strategy can group the pilots).
PILOT_DESCRIBE = "pilot-describe"
#: Reply record: ``labels`` ``(M,)`` int64 and/or ``features`` ``(M, p)`` float32 of the shared pilots.
PILOT_PUBLIC = "pilot-public"
PILOT_LABELS = "labels"
PILOT_FEATURES = "features"


def index_digest(indices: np.ndarray, groups: np.ndarray | None = None) -> int:
    """A 63-bit fingerprint of a pilot selection: SHA-256 of the int64 indices in order and the group
    ids (or a marker for none), first 8 bytes, as a positive int (fits a ``ConfigRecord``/``MetricRecord``).

    Two selections have the same digest iff (up to hash collisions) they name the same pilots in the
    same order with the same grouping.
    """
    import hashlib

    h = hashlib.sha256(np.ascontiguousarray(np.asarray(indices, dtype=np.int64)).tobytes())
    h.update(
        b"|groups|"
        + (
            b"none"
            if groups is None
            else np.ascontiguousarray(np.asarray(groups, np.int64)).tobytes()
        )
    )
    return int.from_bytes(h.digest()[:8], "big") >> 1 or 1


def pack_pilot_selection(indices: np.ndarray, groups: np.ndarray | None = None) -> ArrayRecord:
    """Record :data:`PILOT_SELECTION`: ``indices (m,)`` int64 [and ``groups (m,)`` int64]."""
    out = {PILOT_INDICES: np.asarray(indices, dtype=np.int64)}
    if groups is not None:
        out[PILOT_GROUPS] = np.asarray(groups, dtype=np.int64)
    return pack_arrays(out)


def unpack_pilot_selection(
    rec: ArrayRecord, expected_digest: int, num_pilots: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """Inverse of :func:`pack_pilot_selection`, checked against the digest the config carries.

    Args:
        rec: the :data:`PILOT_SELECTION` record.
        expected_digest: the config's :data:`PILOT_INDEX_DIGEST`.
        num_pilots: M, the pilots this node holds.

    Returns:
        ``(indices (m,), groups (m,) or None)`` int64.

    Raises:
        ProtocolError: missing indices, not 1-D int, out of ``[0, M)``, repeated, groups of another
            length, or a digest that differs from ``expected_digest`` (the indices or their order
            were changed: both keys named).
    """
    if PILOT_INDICES not in rec:
        raise ProtocolError(f"record {PILOT_SELECTION!r} lacks {PILOT_INDICES!r}")
    idx = rec[PILOT_INDICES].numpy()
    grp = rec[PILOT_GROUPS].numpy() if PILOT_GROUPS in rec else None
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_INDICES} must be a 1-D integer array, got {idx.dtype} {idx.shape}"
        )
    if idx.size and (idx.min() < 0 or idx.max() >= num_pilots):
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_INDICES} outside [0, {num_pilots}): [{idx.min()}, {idx.max()}]"
        )
    if np.unique(idx).size != idx.size:
        raise ProtocolError(f"{PILOT_SELECTION}/{PILOT_INDICES} repeat a pilot")
    if grp is not None and grp.shape != idx.shape:
        raise ProtocolError(
            f"{PILOT_SELECTION}/{PILOT_GROUPS} has shape {grp.shape}, expected {idx.shape}"
        )
    got = index_digest(idx, grp)
    if got != int(expected_digest):
        raise ProtocolError(
            f"pilot index mismatch: {PILOT_SELECTION}/{PILOT_INDICES} has digest {got} but config "
            f"{PILOT_INDEX_DIGEST!r} = {int(expected_digest)} (other pilots, another order or other "
            f"groups than the neighbours' matrices were reduced with)"
        )
    return idx.astype(np.int64), None if grp is None else grp.astype(np.int64)


# ------------------------------------------------------------------------------ non-edge transport (multi-hop)
#: routed array of a non-edge source j in ``evaluate.<action>_comm``: the composed map ``(d_i, d_j)``
#: (float64) along a shortest path, key ``"<j>/path-map"`` beside j's :data:`EVAL_ARRAYS`.
PATH_MAP = "path-map"
#: per non-edge source metrics of a phase-2 reply (lists aligned with :data:`NON_EDGE_SRC`): accuracy
#: after multi-hop transport and after direct Procrustes between the two nodes' pilots, test and validation.
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

__all__ += [
    "PATH_MAP",
    "NON_EDGE_SRC",
    "NON_EDGE_ACCURACY",
    "VAL_NON_EDGE_ACCURACY",
    "NON_EDGE_DIRECT_ACCURACY",
    "VAL_NON_EDGE_DIRECT_ACCURACY",
    "NON_EDGE_REPLY",
    "NonEdgeConfig",
    "route_non_edges",
]


@dataclass(frozen=True)
class NonEdgeConfig:
    """A receiver's non-edge sources in its ``evaluate.<action>_comm`` config (lists aligned by index).

    Multi-hop transport (docs/variants-diagnostics.md): the server composes the restriction maps along a
    shortest path from source j to receiver i and routes j's arrays with the composed map
    (:data:`PATH_MAP`); the receiver also fits a direct Procrustes map between the two pilot
    matrices (the reference a direct pilot exchange reaches).

    Attributes:
        sources: source partition-ids j (not neighbours of the receiver).
        dims: their stalk dimensions d_j.
        heads: ``True`` where the receiver is the head of the direct pair (larger d; tie: larger
            partition-id; :func:`flwr_sheaf.sheaf.network.orient_edge`), for the direct Procrustes map.
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
        if not self.sources:
            return {}
        return dict(
            zip(
                self.KEYS,
                (
                    [int(j) for j in self.sources],
                    [int(d) for d in self.dims],
                    [int(h) for h in self.heads],
                    [int(h) for h in self.hops],
                ),
            )
        )

    @classmethod
    def from_config(cls, cfg: Mapping) -> NonEdgeConfig:
        """Inverse of :meth:`to_config` (no keys = no non-edge sources).

        Raises:
            ProtocolError: some but not all of :attr:`KEYS`, or lists of different lengths.
        """
        present = [k for k in cls.KEYS if k in cfg]
        if not present:
            return cls()
        if len(present) != len(cls.KEYS):
            raise ProtocolError(
                f"non-edge config has {present} but lacks {[k for k in cls.KEYS if k not in cfg]}"
            )
        s, d, h, n = (cfg[k] for k in cls.KEYS)
        return cls(
            tuple(int(j) for j in s),
            tuple(int(x) for x in d),
            tuple(bool(int(x)) for x in h),
            tuple(int(x) for x in n),
        )


def route_non_edges(
    phase1: Mapping[int, ArrayRecord], maps: Mapping[int, np.ndarray]
) -> dict[str, np.ndarray]:
    """Phase-2 arrays of one receiver's non-edge sources: j's :data:`EVAL_ARRAYS` and the composed map.

    Args:
        phase1: phase-1 arrays per partition-id.
        maps: ``{source j: composed map (d_receiver, d_j)}``.

    Returns:
        ``{"<j>/<name>": array}`` to add to the receiver's routed ``arrays`` record (read back with
        :func:`unpack_routed` and names ``EVAL_ARRAYS + (PATH_MAP,)``).

    Raises:
        KeyError: a source without phase-1 arrays.
    """
    out = {}
    for j, t in maps.items():
        out.update({f"{j}/{name}": phase1[j][name].numpy() for name in EVAL_ARRAYS})
        out[f"{j}/{PATH_MAP}"] = np.ascontiguousarray(t, dtype=np.float64)
    return out


# ------------------------------------------------------------------------------ train-reply values
__all__ += ["train_reply_problem"]


def weight_problem(name: str, value: object) -> str | None:
    """Why a reply's weight (e.g. ``num-examples``) is unusable, or None when it is a finite number > 0.

    Strategies call it on every reply value that weights or counts in an aggregate, and record a
    non-None answer as that node's failure (:meth:`flwr_sheaf.strategy.graph.GraphStrategy.record_failure`) instead of aborting
    the ServerApp or averaging with a zero, negative or NaN weight.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} = {value!r} is not a number"
    if not (np.isfinite(value) and value > 0):
        return f"{name} = {value!r} must be a finite number > 0"
    return None


def train_reply_problem(content: Mapping, arrays: bool = False) -> str | None:
    """Why a train reply's values are refused, or None (the one check of both sides).

    The server (:meth:`flwr_sheaf.strategy.graph.GraphStrategy.aggregate_train`) refuses a reply whose
    ``num-examples`` is not a finite number > 0, that has a NaN or infinite scalar metric, or a list
    metric (e.g. per-edge values) with an infinite entry (a NaN entry of a list means "not measured"
    for that edge); the node (:func:`flwr_sheaf.client.checks.refuse_what_the_server_refuses`) applies the
    same check, with ``arrays=True`` also to every array (NaN/inf entries), and raises before its state
    is committed: what the server refuses, the node never commits (docs/reliability-failures.md).

    Args:
        content: the reply's ``RecordDict`` (its ``metrics`` record must hold ``num-examples``).
        arrays: also check every float array of every ``ArrayRecord`` for NaN/inf entries.
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


#: Keys of a resumed run's discovery (``query``) config, sent by the ServerApp and read (and removed)
#: by :func:`flwr_sheaf.client.state.persist_state`: per partition-id the last round the server's
#: checkpoint accepted its training (0 = never), the checkpointed round, and the run-config
#: ``resume-fresh-nodes``.
RESUME_STATE_ROUNDS = "resume-state-rounds"
RESUME_ROUND = "resume-round"
RESUME_FRESH = "resume-fresh-nodes"
