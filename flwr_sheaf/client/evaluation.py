"""The two evaluation handlers every graph method shares (paper Eq. 22); they never save the model."""

from __future__ import annotations

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from ..protocol import (
    ARRAYS,
    COMM_ACCURACY,
    COMM_SRC,
    CONFIG,
    DEVICE,
    DEVICE_INDEX,
    EVAL_ARRAYS,
    EVAL_TRANSPORTED,
    EVALUATE,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_ACCURACY,
    NON_EDGE_DIRECT_ACCURACY,
    NON_EDGE_REPLY,
    NON_EDGE_SRC,
    NUM_TEST,
    PATH_MAP,
    PILOT_READING,
    PRIVATE_ACCURACY,
    SECOND_READING,
    STALK_DIM,
    TORCH_THREADS,
    VAL_COMM_ACCURACY,
    VAL_NON_EDGE_ACCURACY,
    VAL_NON_EDGE_DIRECT_ACCURACY,
    VAL_PRIVATE_ACCURACY,
    WHITENING_FIT,
    WHITENING_FITS,
    EdgeConfig,
    NonEdgeConfig,
    ProtocolError,
    array_record,
    comm_action,
    device_index,
    message_type,
    pack_arrays,
    required,
    unpack_routed,
)
from ..sheaf import check_pilots, procrustes
from ..sheaf.whitening import low_variance_fraction
from .common import (
    accuracy,
    build,
    cached_pilots,
    eval_latents,
    eval_logits,
    from_numpy,
    task_device,
    to_numpy,
    transport,
    whitened_pilots,
)
from .method import ClientMethod
from .task import LocalTask, StalkModel, TaskFactory

__all__ = ["evaluate_handler", "evaluate_comm_handler"]


def evaluate_handler(
    msg: Message, context: Context, factory: TaskFactory, method: ClientMethod
) -> Message:
    """``evaluate.<action>``: private accuracies, and the arrays the server routes to neighbours
    (whitening fitted on the pilots, or with ``whitening-fit = "train"`` on the training latents).

    Returns:
        the reply: ``arrays`` (:data:`~flwr_sheaf.protocol.EVAL_ARRAYS`: whitened pilots ``(K, d_i)``,
        latents ``(M, d_i)`` float32, labels ``(M,)`` int64; the method's, the second reading's)
        and ``metrics``.

    Raises:
        ProtocolError: a config key missing (named) or an unknown whitening fit.
    """
    cfg, action = msg.content[CONFIG], method.action
    mt = message_type(EVALUATE, action)
    task, model, (a, lvf) = _restore(factory, context, action, cfg, mt)
    with torch.no_grad():
        raw_test, raw_val = eval_latents(model, task.x_test), eval_latents(model, task.x_val)
        zt, zv = model.whitening(raw_test), model.whitening(raw_val)
    arrays = dict(zip(EVAL_ARRAYS, map(to_numpy, (a, zt, task.y_test, zv, task.y_val))))
    arrays.update(method.evaluation_arrays(msg, context, task))
    metrics = _private_metrics(msg, task, model, lvf, method)
    if _pilot_reading(cfg, mt):  # after every other use of the model: it refits the whitening
        fit = str(cfg[WHITENING_FIT])
        a = _second_whitening(task, model, context, action, fit)
        with torch.no_grad():
            second = (a, model.whitening(raw_test), model.whitening(raw_val))
        arrays.update(zip(SECOND_READING[fit][0], map(to_numpy, second)))
    packed = pack_arrays(method.evaluation_reply(msg, context, task, arrays))  # the final arrays
    return Message(RecordDict({ARRAYS: packed, METRICS: metrics}), reply_to=msg)


def evaluate_comm_handler(
    msg: Message, context: Context, factory: TaskFactory, method: ClientMethod
) -> Message:
    """``evaluate.<action>_comm``: communication accuracy per incoming edge (Eq. 22): neighbour j's
    whitened latents moved into this stalk by the Procrustes map of both nodes' pilots (Eq. 18),
    classified by this node's head; also from each non-edge source.

    Returns:
        the reply's ``metrics``: :data:`~flwr_sheaf.protocol.COMM_SRC`, test / validation accuracy
        per edge in that order, the method's per-edge metrics, non-edge and second-reading ones.

    Raises:
        ProtocolError: a config key or routed array missing; ValueError: a neighbour's pilots or
            latents of the wrong shape or with NaN/inf (its partition-id named).
    """
    cfg, action = msg.content[CONFIG], method.action
    mt = message_type(EVALUATE, comm_action(action))
    task, model, (own, _) = _restore(factory, context, action, cfg, mt)
    dev = task_device(task)
    model.eval()
    edges = EdgeConfig.from_config(cfg)
    # stringent privacy: j's map moved them into the edge stalk; read them as a tail (P2c/P2d)
    moved = bool(int(required(cfg, EVAL_TRANSPORTED, mt)))
    per_edge, extra = _edge_accuracies(msg, context, task, method, own, edges, moved)
    non_edges = _non_edge_accuracies(msg, model, own, dev)
    if _pilot_reading(cfg, mt):  # last: it refits the (unsaved) whitening the other way
        extra.update(_second_reading_accuracies(msg, context, action, task, edges, cfg))
    metrics = MetricRecord({**per_edge, **extra, **non_edges})
    return Message(RecordDict({METRICS: metrics}), reply_to=msg)


def _restore(
    factory: TaskFactory, context: Context, action: str, cfg, mt: str
) -> tuple[LocalTask, StalkModel, tuple[torch.Tensor, float]]:
    """The node's task with its trained weights (message's device and threads), and its
    :func:`_pilots_for_evaluation`."""
    threads = int(required(cfg, TORCH_THREADS, mt))
    task, model, _ = build(
        factory, context, action, threads, device_spec=str(required(cfg, DEVICE, mt))
    )
    fit = str(required(cfg, WHITENING_FIT, mt))
    return task, model, _pilots_for_evaluation(task, model, context, action, fit)


def _private_metrics(
    msg: Message, task: LocalTask, model: StalkModel, lvf: float, method: ClientMethod
) -> MetricRecord:
    """Phase 1's metrics: private accuracies, test size, ``lvf``, ``d``, device, the method's."""
    return MetricRecord(
        {
            PRIVATE_ACCURACY: accuracy(eval_logits(model, task.x_test), task.y_test),
            VAL_PRIVATE_ACCURACY: accuracy(eval_logits(model, task.x_val), task.y_val),
            NUM_TEST: int(task.y_test.numel()),
            LOW_VARIANCE_FRACTION: lvf,
            STALK_DIM: int(model.d),
            DEVICE_INDEX: device_index(task_device(task)),
            **method.evaluation_metrics(msg, task),
        }
    )


def _edge_accuracies(
    msg: Message,
    context: Context,
    task: LocalTask,
    method: ClientMethod,
    own: torch.Tensor,
    edges: EdgeConfig,
    moved: bool,
) -> tuple[dict[str, list], dict[str, list[float]]]:
    """``({COMM_SRC, COMM_ACCURACY, VAL_COMM_ACCURACY: lists}, the method's per-edge lists)`` of the
    incoming edges, with this node's whitened pilots ``own (K, d_i)``."""
    model, dev = task.model, task_device(task)
    out: dict[str, list] = {COMM_SRC: [], COMM_ACCURACY: [], VAL_COMM_ACCURACY: []}
    extra: dict[str, list[float]] = {}
    for j, dj, i_head in zip(edges.neighbours, edges.dims, edges.heads):
        arr = unpack_routed(
            array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + method.routed_arrays
        )
        if moved:
            dj, i_head = max(dj, int(model.d)), False
        test, val = _edge_accuracy(model, own, arr, j, dj, i_head, dev)
        out[COMM_SRC].append(j)
        out[COMM_ACCURACY].append(test)
        out[VAL_COMM_ACCURACY].append(val)
        for name, value in method.edge_metrics(msg, context, task, j, arr).items():
            extra.setdefault(name, []).append(float(value))
    return out, extra


def _edge_accuracy(
    model: StalkModel,
    own: torch.Tensor,
    arr: dict,
    j: int,
    dj: int,
    i_head: bool,
    dev: torch.device,
    prefix: str = "",
    path_map: torch.Tensor | None = None,
) -> list[float]:
    """Test and validation accuracy of j's whitened latents ``(M, dj)`` moved into this stalk by the
    Procrustes map (Eq. 18) between ``own`` and j's pilots ``(K, dj)``; ``prefix``: a second
    reading's arrays. With ``path_map`` ``(d_i, dj)`` (non-edge source): ``[test multi-hop, test
    direct, val multi-hop, val direct]``. Raises ValueError on bad arrays of j (j named)."""
    what = {"pw-": "pilot-whitened ", "tw-": "train-whitened "}.get(prefix, "")
    source = "neighbour" if path_map is None else "non-edge source"
    a_j = from_numpy(arr[f"{prefix}pilots"], dev, torch.float32)
    check_pilots(a_j, f"{what}pilots of {source} partition-id {j}", d=dj, k=own.shape[0])
    if path_map is not None and (
        tuple(path_map.shape) != (own.shape[1], dj) or not torch.isfinite(path_map).all()
    ):
        raise ValueError(
            f"composed map of non-edge source partition-id {j}: shape {tuple(path_map.shape)} "
            f"(expected ({own.shape[1]}, {dj})) or NaN/inf entries"
        )
    v = procrustes(own, a_j) if i_head else procrustes(a_j, own)
    res = []
    for split in ("test", "val"):
        z = from_numpy(arr[f"{prefix}{split}-latents"], dev, torch.float32)
        check_pilots(z, f"{what}{split} latents of {source} partition-id {j}", d=dj)
        y = from_numpy(arr[f"{split}-labels"], dev, torch.int64)
        with torch.no_grad():
            if path_map is not None:
                res.append(accuracy(model.classify_whitened(transport(z, path_map, True)), y))
            res.append(accuracy(model.classify_whitened(transport(z, v, i_head)), y))
    return res


def _pilots_for_evaluation(
    task: LocalTask, model: StalkModel, context: Context, action: str, fit: str
) -> tuple[torch.Tensor, float]:
    """Whitened pilots ``(K, d_i)`` and the collapse diagnostic, whitening fitted as ``fit`` says."""
    if fit not in WHITENING_FITS:
        raise ProtocolError(f"{WHITENING_FIT}={fit!r}: must be one of {WHITENING_FITS}")
    cached = cached_pilots(context, action, task_device(task))
    if fit == "pilots" and cached is not None:
        return cached
    if fit == "pilots":
        z, a = whitened_pilots(model, task.x_pilot)
        return a, low_variance_fraction(z)
    z = eval_latents(model, task.x_pilot)
    model.whitening.fit(eval_latents(model, task.x_train))
    model.whitening.eval()
    with torch.no_grad():
        return model.whitening(z), low_variance_fraction(z)


def _pilot_reading(cfg, mt: str) -> bool:
    """Whether the config asks for the second reading (:data:`PILOT_READING`)."""
    return bool(int(required(cfg, PILOT_READING, mt)))


def _second_whitening(
    task: LocalTask, model: StalkModel, context: Context, action: str, fit: str
) -> torch.Tensor:
    """Refit ``model.whitening`` (unsaved) the other way than ``fit``; the pilots ``(K, d_i)``
    whitened so (notes/baselines.md)."""
    if fit == "train":
        return whitened_pilots(model, task.x_pilot)[1]
    return _pilots_for_evaluation(task, model, context, action, "train")[0]


def _second_reading_accuracies(
    msg: Message, context: Context, action: str, task: LocalTask, edges: EdgeConfig, cfg
) -> dict[str, list[float]]:
    """Test and validation accuracy lists per incoming edge under the second reading
    (:data:`SECOND_READING`: both ends' whitening fitted the other way)."""
    fit = str(cfg[WHITENING_FIT])
    names, (test_key, val_key) = SECOND_READING[fit]
    model, dev = task.model, task_device(task)
    own = _second_whitening(task, model, context, action, fit)
    model.eval()
    out: dict[str, list[float]] = {test_key: [], val_key: []}
    for j, dj, i_head in zip(edges.neighbours, edges.dims, edges.heads):
        arr = unpack_routed(array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + names)
        test, val = _edge_accuracy(model, own, arr, j, dj, i_head, dev, names[0][:3])
        out[test_key].append(test)
        out[val_key].append(val)
    return out


def _non_edge_accuracies(
    msg: Message, model: StalkModel, own: torch.Tensor, dev: torch.device
) -> dict[str, list]:
    """The :data:`~flwr_sheaf.protocol.NON_EDGE_REPLY` lists: accuracy from each non-edge source j
    by the server's composed map ``"<j>/path-map"`` ``(d_i, d_j)`` and by the direct map."""
    ne = NonEdgeConfig.from_config(msg.content[CONFIG])
    out: dict[str, list] = {k: [] for k in NON_EDGE_REPLY[METRICS]}
    order = (  # of _edge_accuracy's answer with a path map
        NON_EDGE_ACCURACY,
        NON_EDGE_DIRECT_ACCURACY,
        VAL_NON_EDGE_ACCURACY,
        VAL_NON_EDGE_DIRECT_ACCURACY,
    )
    for j, dj, i_head in zip(ne.sources, ne.dims, ne.heads):
        arr = unpack_routed(array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + (PATH_MAP,))
        t = from_numpy(arr[PATH_MAP], dev, torch.float32)
        for key, acc in zip(order, _edge_accuracy(model, own, arr, j, dj, i_head, dev, path_map=t)):
            out[key].append(acc)
        out[NON_EDGE_SRC].append(int(j))
    return out
