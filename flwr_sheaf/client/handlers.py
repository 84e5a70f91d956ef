"""The four ClientApp handlers every graph method shares, parameterised by a :class:`ClientMethod`.

``register_method_handlers(app, factory, method)`` adds, under the method's action (so they sit
beside a host app's own ``@app.train()`` / ``@app.evaluate()``):

- ``query.<action>``: discovery reply (:class:`flwr_sheaf.protocol.NodeInfo`);
- ``train.<action>``: restore the model, build the method's loss plug-in from the message, run the
  one local-training loop (:func:`flwr_sheaf.client.loop.train_local`), save the model, then let
  the method add its upload (Sheaf-FRL: whitened pilots; FedProto: local prototypes);
- ``evaluate.<action>``: private accuracy on the test and validation splits, and the whitened
  pilots and validation/test latents for the server to route (whitening fitted on the pilots, or
  on the private training latents when the config says ``whitening-fit = "train"``: the paper's
  post-hoc protocol, docs/baselines.md);
- ``evaluate.<action>_comm``: communication accuracy per incoming edge (paper Eq. 22): neighbour
  j's whitened latents are moved into this stalk by the Procrustes map fitted on both nodes'
  final pilots (Eq. 18), coloured and classified by this node's head. Refitting on the final
  pilots makes lambda = 0 exactly post-hoc alignment.

All per-node state lives in ``context.state`` (Flower commits it only when a handler returns).
Every value a handler needs comes in the message; a missing key is an error, never a default.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..config import LocalTrainConfig
from ..devices import resolve_device
from ..protocol import (
    ARRAYS,
    COMM_ACCURACY,
    COMM_ACCURACY_PILOT_WHITENING,
    COMM_SRC,
    CONFIG,
    DEVICE,
    EVAL_ARRAYS,
    EVAL_TRANSPORTED,
    EVALUATE,
    INFO,
    LOW_VARIANCE_FRACTION,
    METRICS,
    NON_EDGE_ACCURACY,
    NON_EDGE_DIRECT_ACCURACY,
    NON_EDGE_SRC,
    NUM_EXAMPLES,
    NUM_TEST,
    PATH_MAP,
    PILOT_READING,
    PILOT_READING_ARRAYS,
    PRIVATE_ACCURACY,
    QUERY,
    SEED,
    SERVER_ROUND,
    STALK_DIM,
    TORCH_THREADS,
    TRAIN,
    VAL_COMM_ACCURACY,
    VAL_COMM_ACCURACY_PILOT_WHITENING,
    VAL_NON_EDGE_ACCURACY,
    VAL_NON_EDGE_DIRECT_ACCURACY,
    VAL_PRIVATE_ACCURACY,
    WHITENING_FIT,
    WHITENING_FITS,
    EdgeConfig,
    NodeInfo,
    NonEdgeConfig,
    ProtocolError,
    array_record,
    comm_action,
    message_type,
    pack_arrays,
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
    model_key,
    round_generator,
    shared_pilot_digest,
    task_device,
    to_numpy,
    transport,
    whitened_pilots,
)
from .loop import CrossEntropy, LossPlugin, train_local
from .reference import travel_by_reference
from .task import LocalTask, StalkModel, TaskFactory, save_module_state, set_torch_threads

__all__ = ["ClientMethod", "register_method_handlers", "required", "check_stalk_protocol_once"]


def required(cfg: Mapping, key: str, msg_type: str):
    """``cfg[key]``, or a :class:`~flwr_sheaf.protocol.ProtocolError` naming the key and the message type."""
    if key not in cfg:
        raise ProtocolError(f"{msg_type} message config lacks {key!r}")
    return cfg[key]


class ClientMethod:
    """What a method adds to the shared handlers (override what differs; defaults = non-cooperative).

    Hooks (each may raise ``ConfigError`` / ``ProtocolError`` / ``ValueError`` on a bad message; the
    node then replies with an error and keeps its state): :meth:`plugin`, :meth:`after_train`,
    :meth:`evaluation_metrics`. docs/methods.md, "Adding a method", lists the files a method touches.

    Args:
        action: the message action (``train.<action>`` etc.); also the ``context.state`` prefix.
    """

    def __init__(self, action: str) -> None:
        self.action = action

    def plugin(self, msg: Message, context: Context, task: LocalTask) -> LossPlugin:
        """The loss plug-in of one ``train`` message (default: cross-entropy)."""
        return CrossEntropy()

    def after_train(
        self, msg: Message, context: Context, task: LocalTask, plugin: LossPlugin
    ) -> tuple[dict, dict]:
        """Records and metrics added to the train reply after training (default: none); ``plugin`` is
        this round's trained loss plug-in (a method with its own parameters saves them here)."""
        return {}, {}

    def evaluation_metrics(self, msg: Message, task: LocalTask) -> dict[str, float]:
        """Extra metrics of the ``evaluate`` reply (model in eval mode with trained weights)."""
        return {}

    #: names of the extra phase-1 arrays the strategy routes to neighbours (see :meth:`evaluation_arrays`).
    routed_arrays: tuple[str, ...] = ()

    def evaluation_arrays(self, msg: Message, context: Context, task: LocalTask) -> dict:
        """Extra arrays of the ``evaluate`` reply (names in :attr:`routed_arrays`; default none)."""
        return {}

    def evaluation_reply(
        self, msg: Message, context: Context, task: LocalTask, arrays: dict
    ) -> dict:
        """The phase-1 arrays actually sent, from the default ``arrays`` (:data:`EVAL_ARRAYS`,
        :meth:`evaluation_arrays` and, with the strong post-hoc reading, :data:`PILOT_READING_ARRAYS`;
        numpy; the model's whitening is then the pilot-fitted one); default: unchanged (Sheaf-FRL's stringent privacy sends
        per-neighbour transported arrays instead, docs/variants.md)."""
        return arrays

    def edge_metrics(
        self, msg: Message, context: Context, task: LocalTask, j: int, arrays: dict
    ) -> dict[str, float]:
        """Extra per-incoming-edge metrics of ``evaluate_comm`` from neighbour j's routed ``arrays`` (default none)."""
        return {}


def check_stalk_protocol(task: LocalTask, partition_id: int, rows: int = 2) -> None:
    """Discovery's check of the node's model (issue "no silent failure", item 6): ``rows`` pilots through
    ``model.latent`` (eval mode, no gradient) must give ``(rows, model.d)``, and ``model.whitening`` must
    be ``d``-dimensional; else the node's discovery fails, naming the partition-id, ``model.d`` and the
    width ``latent()`` returned, before any training.

    Raises:
        ValueError: ``model.d`` not a positive int, ``latent()`` of the wrong shape, or a whitening of
            another dimension.
    """
    model = task.model
    d = getattr(model, "d", None)
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(
            f"partition-id {partition_id}: model.d = {d!r}; the stalk protocol needs a positive int "
            "(the latent size, docs: flwr_sheaf.client.task)"
        )
    was_training = model.training
    model.eval()
    with torch.no_grad():
        z = model.latent(task.x_pilot[:rows])
    model.train(was_training)
    if tuple(z.shape) != (min(rows, int(task.x_pilot.shape[0])), d):
        raise ValueError(
            f"partition-id {partition_id}: model.latent() returned shape {tuple(z.shape)} for "
            f"{min(rows, int(task.x_pilot.shape[0]))} pilots, but model.d = {d}: latent() must give "
            f"(batch, model.d); fix model.d or latent()"
        )
    wd = getattr(getattr(model, "whitening", None), "d", None)
    if wd != d:
        raise ValueError(
            f"partition-id {partition_id}: model.whitening has d = {wd!r}, model.d = {d}: the "
            f"whitening must be Whitening(model.d)"
        )


#: architectures that passed :func:`check_stalk_protocol` in this process (:func:`_architecture`).
_STALK_CHECKED: set[tuple] = set()


def _architecture(task: LocalTask) -> tuple:
    """What decides the outcome of :func:`check_stalk_protocol`: the model's class, its modules and
    hyper-parameters (``repr``), its public instance attributes (``repr``: a method patched on the
    instance, whose repr names its address, makes its own key), every parameter's and buffer's name,
    shape and dtype, ``model.d``, the whitening's ``d``, and the pilots' shape, dtype and device (not
    the weights' values)."""
    model = task.model
    return (
        type(model),
        repr(model),
        tuple(sorted((k, repr(v)) for k, v in vars(model).items() if not k.startswith("_"))),
        tuple((k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()),
        repr(getattr(model, "d", None)),
        repr(getattr(getattr(model, "whitening", None), "d", None)),
        tuple(task.x_pilot.shape),
        task.x_pilot.dtype,
        task.x_pilot.device,
    )


def check_stalk_protocol_once(task: LocalTask, partition_id: int) -> None:
    """:func:`check_stalk_protocol`, run once per process for each architecture (:func:`_architecture`):
    the nodes of a zoo share a handful of architectures, so discovery checks each once, not per node.

    Raises:
        ValueError: as :func:`check_stalk_protocol` (a failing architecture is checked again each time).
    """
    key = _architecture(task)
    if key not in _STALK_CHECKED:
        check_stalk_protocol(task, partition_id)
        _STALK_CHECKED.add(key)


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


def register_method_handlers(
    app: ClientApp, factory: TaskFactory, method: ClientMethod
) -> ClientApp:
    """Register ``query``/``train``/``evaluate``/``evaluate_comm`` handlers of ``method`` on ``app``.

    Args:
        app: the ClientApp to extend (its other handlers are untouched).
        factory: builds the node's :class:`~flwr_sheaf.client.task.LocalTask` (called per message).
        method: the method's hooks; ``method.action`` names the messages.

    Returns:
        ``app`` (for chaining).

    The handlers raise (Flower turns it into that node's error reply and does not commit its state)
    on: a key missing from a message config (``ConfigError`` / ``ProtocolError``, key and message
    type named), malformed edges or routed arrays, neighbour pilots or latents of the wrong shape or
    with NaN/inf (``ValueError`` naming the neighbour's partition-id), a non-finite loss
    (``FloatingPointError`` with the round) and an empty training set.

    ``app`` then pickles as its import path (:func:`~flwr_sheaf.client.reference.travel_by_reference`:
    Flower's Ray engine pickles the ClientApp with every message).
    """
    travel_by_reference(app)
    action = method.action

    @app.query(action)
    def _query(msg: Message, context: Context) -> Message:
        cfg, mt = msg.content[CONFIG], message_type(QUERY, action)
        set_torch_threads(int(required(cfg, TORCH_THREADS, mt)))
        resolve_device(
            str(required(cfg, DEVICE, mt))
        )  # a device this machine lacks fails discovery, before training
        task = factory(context)
        check_stalk_protocol_once(task, int(context.node_config["partition-id"]))
        info = NodeInfo(
            int(context.node_config["partition-id"]),
            int(context.node_config.get("num-partitions", 0)),
            int(task.model.d),
            tuple(int(c) for c in task.classes),
            int(task.x_pilot.shape[0]),
            int(task.x_train.shape[0]),
            shared_pilot_digest(task.x_pilot),
        )
        return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)

    @app.train(action)
    def _train(msg: Message, context: Context) -> Message:
        cfg = msg.content[CONFIG]
        mt = message_type(TRAIN, action)
        train = LocalTrainConfig.from_record(cfg)
        rnd, seed = int(required(cfg, SERVER_ROUND, mt)), int(required(cfg, SEED, mt))
        task, model, opt = build(factory, context, action, train.torch_threads, train)
        assert opt is not None  # build() with a train config makes the optimizer
        gen = round_generator(seed, int(context.node_config["partition-id"]), rnd)
        plugin = method.plugin(msg, context, task)
        metrics = train_local(task, opt, train, plugin, gen, rnd)
        records, more = method.after_train(
            msg, context, task, plugin
        )  # may refit the whitening: save after it
        save_module_state(context, model_key(action), model, opt)
        metrics = {NUM_EXAMPLES: int(task.x_train.shape[0]), **metrics, **more}
        return Message(RecordDict({**records, METRICS: MetricRecord(metrics)}), reply_to=msg)

    @app.evaluate(action)
    def _evaluate(msg: Message, context: Context) -> Message:
        cfg = msg.content[CONFIG]
        mt = message_type(EVALUATE, action)
        task, model, _ = build(
            factory,
            context,
            action,
            int(required(cfg, TORCH_THREADS, mt)),
            device_spec=str(required(cfg, DEVICE, mt)),
        )
        a, lvf = _pilots_for_evaluation(
            task, model, context, action, str(required(cfg, WHITENING_FIT, mt))
        )
        with torch.no_grad():
            raw_test, raw_val = eval_latents(model, task.x_test), eval_latents(model, task.x_val)
            zt, zv = model.whitening(raw_test), model.whitening(raw_val)
        arrays = dict(
            zip(
                EVAL_ARRAYS,
                (
                    to_numpy(a),
                    to_numpy(zt),
                    to_numpy(task.y_test),
                    to_numpy(zv),
                    to_numpy(task.y_val),
                ),
            )
        )
        arrays.update(method.evaluation_arrays(msg, context, task))
        metrics = MetricRecord(
            {
                PRIVATE_ACCURACY: accuracy(eval_logits(model, task.x_test), task.y_test),
                VAL_PRIVATE_ACCURACY: accuracy(eval_logits(model, task.x_val), task.y_val),
                NUM_TEST: int(task.y_test.numel()),
                LOW_VARIANCE_FRACTION: lvf,
                STALK_DIM: int(model.d),
                **method.evaluation_metrics(msg, task),
            }
        )
        if _pilot_reading(
            cfg, mt
        ):  # after every other use of the model: it refits the (unsaved) whitening
            arrays.update(
                zip(
                    PILOT_READING_ARRAYS,
                    map(to_numpy, _pilot_whitened_arrays(model, task, raw_test, raw_val)),
                )
            )
        packed = pack_arrays(
            method.evaluation_reply(msg, context, task, arrays)
        )  # sees the final arrays
        return Message(RecordDict({ARRAYS: packed, METRICS: metrics}), reply_to=msg)

    @app.evaluate(comm_action(action))
    def _evaluate_comm(msg: Message, context: Context) -> Message:
        cfg = msg.content[CONFIG]
        mt = message_type(EVALUATE, comm_action(action))
        task, model, _ = build(
            factory,
            context,
            action,
            int(required(cfg, TORCH_THREADS, mt)),
            device_spec=str(required(cfg, DEVICE, mt)),
        )
        dev = task_device(task)
        own, _ = _pilots_for_evaluation(
            task, model, context, action, str(required(cfg, WHITENING_FIT, mt))
        )
        model.eval()
        extra: dict[str, list[float]]
        src, acc_test, acc_val, extra = [], [], [], {}
        edges = EdgeConfig.from_config(cfg)
        # transported arrays (stringent privacy): j's own map moved them into the edge stalk (width
        # d_e); this node fits its own map onto them (P2c/P2d) and reads them as a tail would
        moved = bool(int(required(cfg, EVAL_TRANSPORTED, mt)))
        for j, dj, i_head in zip(edges.neighbours, edges.dims, edges.heads):
            arr = unpack_routed(
                array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + method.routed_arrays
            )
            a_j = from_numpy(arr[EVAL_ARRAYS[0]], dev, torch.float32)
            if moved:
                dj, i_head = max(dj, int(model.d)), False
            check_pilots(a_j, f"pilots of neighbour partition-id {j}", d=dj, k=own.shape[0])
            v = procrustes(own, a_j) if i_head else procrustes(a_j, own)
            res = []
            for split in ("test", "val"):
                z = from_numpy(arr[f"{split}-latents"], dev, torch.float32)
                check_pilots(z, f"{split} latents of neighbour partition-id {j}", d=dj)
                with torch.no_grad():
                    res.append(
                        accuracy(
                            model.classify_whitened(transport(z, v, i_head)),
                            from_numpy(arr[f"{split}-labels"], dev, torch.int64),
                        )
                    )
            src.append(j)
            acc_test.append(res[0])
            acc_val.append(res[1])
            for name, value in method.edge_metrics(msg, context, task, j, arr).items():
                extra.setdefault(name, []).append(float(value))
        non_edges = _non_edge_accuracies(msg, model, own, dev)
        if _pilot_reading(cfg, mt):  # last: it refits the (unsaved) whitening on the pilots
            extra.update(_pilot_whitened_accuracies(msg, model, task, edges, dev))
        metrics = MetricRecord(
            {
                COMM_SRC: src,
                COMM_ACCURACY: acc_test,
                VAL_COMM_ACCURACY: acc_val,
                **extra,
                **non_edges,
            }
        )
        return Message(RecordDict({METRICS: metrics}), reply_to=msg)

    return app


def _pilot_reading(cfg, mt: str) -> bool:
    """Whether the evaluation config asks for the strong post-hoc reading (key :data:`PILOT_READING`)."""
    return bool(int(required(cfg, PILOT_READING, mt)))


def _pilot_whitened_arrays(
    model: StalkModel, task: LocalTask, raw_test: torch.Tensor, raw_val: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The strong post-hoc reading's phase-1 arrays (docs/baselines.md): pilots ``(K, d_i)`` and the
    test / validation latents ``raw_test``, ``raw_val`` ``(M, d_i)`` (eval-mode, already computed for
    the paper's reading), all whitened with statistics fitted on the node's eval-mode pilot latents
    (side effect: ``model.whitening`` is refitted; evaluation never saves the model)."""
    _, a = whitened_pilots(model, task.x_pilot)
    with torch.no_grad():
        return a, model.whitening(raw_test), model.whitening(raw_val)


def _pilot_whitened_accuracies(
    msg: Message, model: StalkModel, task: LocalTask, edges: EdgeConfig, dev: torch.device
) -> dict[str, list[float]]:
    """Communication accuracy per incoming edge under the strong post-hoc reading (docs/baselines.md).

    Both ends' whitening is fitted on their own pilots (not on private training latents); neighbour
    j's pilot-whitened test / validation latents (:data:`PILOT_READING_ARRAYS`) are moved into this
    stalk by the Procrustes map fitted on both nodes' pilot-whitened pilots (paper Eq. 18) and
    classified by this node's head, coloured with its pilot-fitted statistics. This is exactly the
    reading Sheaf-FRL's lambda = 0 run gets.

    Returns:
        ``{COMM_ACCURACY_PILOT_WHITENING: [...], VAL_COMM_ACCURACY_PILOT_WHITENING: [...]}`` in
        ``edges.neighbours`` order.

    Raises:
        ProtocolError: a routed array missing; ValueError: j's arrays of the wrong shape or with NaN/inf (j named).
    """
    _, own = whitened_pilots(model, task.x_pilot)  # refits the (unsaved) whitening on the pilots
    model.eval()
    out: dict[str, list[float]] = {
        COMM_ACCURACY_PILOT_WHITENING: [],
        VAL_COMM_ACCURACY_PILOT_WHITENING: [],
    }
    for j, dj, i_head in zip(edges.neighbours, edges.dims, edges.heads):
        arr = unpack_routed(
            array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + PILOT_READING_ARRAYS
        )
        a_j = from_numpy(arr["pw-pilots"], dev, torch.float32)
        check_pilots(
            a_j, f"pilot-whitened pilots of neighbour partition-id {j}", d=dj, k=own.shape[0]
        )
        v = procrustes(own, a_j) if i_head else procrustes(a_j, own)
        for split, key in (
            ("test", COMM_ACCURACY_PILOT_WHITENING),
            ("val", VAL_COMM_ACCURACY_PILOT_WHITENING),
        ):
            z = from_numpy(arr[f"pw-{split}-latents"], dev, torch.float32)
            check_pilots(z, f"pilot-whitened {split} latents of neighbour partition-id {j}", d=dj)
            with torch.no_grad():
                out[key].append(
                    accuracy(
                        model.classify_whitened(transport(z, v, i_head)),
                        from_numpy(arr[f"{split}-labels"], dev, torch.int64),
                    )
                )
    return out


def _non_edge_accuracies(
    msg: Message, model: StalkModel, own: torch.Tensor, dev: torch.device
) -> dict[str, list]:
    """Communication accuracy from each non-edge source j of the phase-2 message (docs/variants.md).

    For source j (arrays ``"<j>/pilots"``, ``"<j>/<split>-latents"``, ``"<j>/<split>-labels"`` and
    the server's composed map ``"<j>/path-map"`` of shape ``(d_i, d_j)``): j's whitened latents are
    moved by the composed map (``Z T^T``, multi-hop) and, for reference, by the direct Procrustes map
    between this node's pilots ``own (K, d_i)`` and j's pilots (Eq. 18, orientation from the
    config), then classified by this node's head.

    Returns:
        ``{NON_EDGE_SRC: [j...], NON_EDGE_ACCURACY: [...], VAL_NON_EDGE_ACCURACY: [...],
        NON_EDGE_DIRECT_ACCURACY: [...], VAL_NON_EDGE_DIRECT_ACCURACY: [...]}`` (empty lists without
        non-edge sources).

    Raises:
        ProtocolError: a malformed non-edge config or a routed array missing.
        ValueError: pilots, latents or composed map of j of the wrong shape or with NaN/inf (j named).
    """
    ne = NonEdgeConfig.from_config(msg.content[CONFIG])
    out: dict[str, list] = {
        k: []
        for k in (
            NON_EDGE_SRC,
            NON_EDGE_ACCURACY,
            VAL_NON_EDGE_ACCURACY,
            NON_EDGE_DIRECT_ACCURACY,
            VAL_NON_EDGE_DIRECT_ACCURACY,
        )
    }
    d_i = own.shape[1]
    for j, dj, i_head in zip(ne.sources, ne.dims, ne.heads):
        arr = unpack_routed(array_record(msg.content, ARRAYS), j, EVAL_ARRAYS + (PATH_MAP,))
        a_j = from_numpy(arr[EVAL_ARRAYS[0]], dev, torch.float32)
        check_pilots(a_j, f"pilots of non-edge source partition-id {j}", d=dj, k=own.shape[0])
        t = from_numpy(arr[PATH_MAP], dev, torch.float32)
        if tuple(t.shape) != (d_i, dj) or not torch.isfinite(t).all():
            raise ValueError(
                f"composed map of non-edge source partition-id {j}: shape {tuple(t.shape)} (expected "
                f"({d_i}, {dj})) or NaN/inf entries"
            )
        v = procrustes(own, a_j) if i_head else procrustes(a_j, own)
        for split, multi_key, direct_key in (
            ("test", NON_EDGE_ACCURACY, NON_EDGE_DIRECT_ACCURACY),
            ("val", VAL_NON_EDGE_ACCURACY, VAL_NON_EDGE_DIRECT_ACCURACY),
        ):
            z = from_numpy(arr[f"{split}-latents"], dev, torch.float32)
            check_pilots(z, f"{split} latents of non-edge source partition-id {j}", d=dj)
            y = from_numpy(arr[f"{split}-labels"], dev, torch.int64)
            with torch.no_grad():
                out[multi_key].append(accuracy(model.classify_whitened(transport(z, t, True)), y))
                out[direct_key].append(
                    accuracy(model.classify_whitened(transport(z, v, i_head)), y)
                )
        out[NON_EDGE_SRC].append(int(j))
    return out
