"""The four ClientApp handlers every graph method shares, parameterised by a :class:`ClientMethod`
(:func:`register_method_handlers`). All per-node state lives in ``context.state`` (Flower commits it
only when a handler returns); every value a handler needs comes in the message (a missing key is an
error, never a default).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..config import LocalTrainConfig, node_partition_id
from ..devices import resolve_device
from ..protocol import (
    CONFIG,
    DEVICE,
    INFO,
    METRICS,
    NUM_EXAMPLES,
    QUERY,
    SEED,
    SERVER_ROUND,
    TORCH_THREADS,
    TRAIN,
    NodeInfo,
    OutsideScenarioError,
    comm_action,
    message_type,
    required,
)
from .common import build, model_key, round_generator, shared_pilot_digest
from .evaluation import evaluate_comm_handler, evaluate_handler
from .loop import train_local
from .method import ClientMethod
from .reference import travel_by_reference
from .task import (
    LocalTask,
    TaskDescription,
    TaskFactory,
    describer_of,
    save_module_state,
    set_torch_threads,
)

__all__ = [
    "ClientMethod",
    "register_method_handlers",
    "query_handler",
    "train_handler",
    "check_stalk_protocol_once",
    "describe_task",
]


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


def register_method_handlers(
    app: ClientApp, factory: TaskFactory, method: ClientMethod
) -> ClientApp:
    """Register the handlers of ``method`` on ``app`` under ``method.action`` (beside a host app's own
    handlers): :func:`query_handler`, :func:`train_handler`,
    :func:`~flwr_sheaf.client.evaluation.evaluate_handler` and
    :func:`~flwr_sheaf.client.evaluation.evaluate_comm_handler`, each bound to ``factory`` (builds the
    node's :class:`~flwr_sheaf.client.task.LocalTask` per message); returns ``app``, which then
    pickles as its import path (:func:`~flwr_sheaf.client.reference.travel_by_reference`: Flower's
    Ray engine pickles the ClientApp with every message).

    A handler raises (Flower makes it the node's error reply and does not commit its state) on a key
    missing from a message config (key and message type named), malformed edges or routed arrays,
    neighbour arrays of the wrong shape or with NaN/inf (``ValueError`` naming the partition-id), a
    non-finite loss (``FloatingPointError`` with the round) and an empty training set.
    """
    travel_by_reference(app)
    action = method.action
    for register, handler in (
        (app.query(action), query_handler),
        (app.train(action), train_handler),
        (app.evaluate(action), evaluate_handler),
        (app.evaluate(comm_action(action)), evaluate_comm_handler),
    ):
        register(functools.partial(handler, factory=factory, method=method))
    return app


def query_handler(
    msg: Message, context: Context, factory: TaskFactory, method: ClientMethod
) -> Message:
    """``query.<action>``: discovery's reply, the node's :class:`~flwr_sheaf.protocol.NodeInfo`.

    Sets the message's thread count, resolves its device (a device this machine lacks fails
    discovery, before training) and checks the node's model (:func:`check_stalk_protocol_once`). A
    factory with a description hook (:func:`~flwr_sheaf.client.task.with_describer`)
    answers from it when it agrees with the node's built task (:func:`_describe`).
    A node whose task factory (or its hook) raises :class:`~flwr_sheaf.protocol.OutsideScenarioError`
    (partition-id >= N) while its partition-id is inside the federation (< ``num-partitions``: a
    spare SuperNode) replies a NodeInfo with ``d = 0`` naming its partition-id, so that discovery
    keeps it idle and tells it from a broken agent (docs/participation.md, 1.5); outside the
    federation too (a SuperNode started with a wrong partition-id) the error is its reply.

    Raises:
        ProtocolError: :data:`~flwr_sheaf.protocol.TORCH_THREADS` or
            :data:`~flwr_sheaf.protocol.DEVICE` missing from the config;
        DeviceUnavailableError: a device this machine lacks; ValueError: the stalk check failed, or
            a description hook disagreed with the built task;
        OutsideScenarioError: a partition-id outside the scenario and the federation.
    """
    cfg, mt = msg.content[CONFIG], message_type(QUERY, method.action)
    set_torch_threads(int(required(cfg, TORCH_THREADS, mt)))
    resolve_device(str(required(cfg, DEVICE, mt)))
    partition_id = node_partition_id(context)
    try:
        desc = _describe(factory, context, partition_id)
    except OutsideScenarioError:  # a spare SuperNode: described as one, never trained
        num_partitions = int(context.node_config.get("num-partitions", 0))
        if partition_id >= num_partitions:  # outside the federation too: a wrong partition-id
            raise
        spare = NodeInfo(partition_id, num_partitions, 0)
        return Message(RecordDict({INFO: spare.to_record()}), reply_to=msg)
    info = NodeInfo(
        partition_id,
        int(context.node_config.get("num-partitions", 0)),
        desc.d,
        desc.classes,
        desc.num_pilots,
        desc.num_train,
        desc.pilot_digest,
    )
    return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)


def describe_task(task: LocalTask, architecture: Hashable = None) -> TaskDescription:
    """The :class:`~flwr_sheaf.client.task.TaskDescription` of a built ``task`` (what discovery reports).

    Args:
        task: the node's task (model with the stalk protocol, CPU tensors).
        architecture: the ``architecture`` field to fill in (a hook's key, to compare with it).
    """
    return TaskDescription(
        int(task.model.d),
        tuple(int(c) for c in task.classes),
        int(task.x_pilot.shape[0]),
        int(task.x_train.shape[0]),
        shared_pilot_digest(task.x_pilot),
        architecture,
    )


def _describe(factory: TaskFactory, context: Context, partition_id: int) -> TaskDescription:
    """The node's description, from its built task (stalk-checked once per architecture in this
    process, :func:`check_stalk_protocol_once`). A description hook attached to the factory
    (:func:`~flwr_sheaf.client.task.describer_of`) must say the same for every node: the graph is
    built from its ``d`` and class set.

    Raises:
        ValueError: the stalk check failed, or the hook's description differs from the built task's
            (the hook, both descriptions, the fields that differ and the partition-id named).
    """
    describe = describer_of(factory)
    task = factory(context)
    check_stalk_protocol_once(task, partition_id)
    if describe is None:
        return describe_task(task)
    desc = describe(context)
    built = describe_task(task, getattr(desc, "architecture", None))
    if built != desc:
        wrong = [f for f in vars(built) if getattr(desc, f, None) != getattr(built, f)]
        raise ValueError(
            f"partition-id {partition_id}: the task factory's description hook "
            f"{getattr(describe, '__qualname__', describe)!r} says {desc}, its built task {built} "
            f"(they differ in {', '.join(wrong)}); fix the hook "
            f"(flwr_sheaf.client.task.with_describer) so that both agree"
        )
    return built  # equal to the hook's, in Python ints (a hook's numpy ints: no Flower record)


def train_handler(
    msg: Message, context: Context, factory: TaskFactory, method: ClientMethod
) -> Message:
    """``train.<action>``: one round of local training with the method's loss plug-in: restore the
    model and its SGD state, draw the round's generator from (seed, partition-id, server round), train
    (:func:`~flwr_sheaf.client.loop.train_local`), let the method add its upload
    (:meth:`ClientMethod.after_train`) and save the model; replies with the method's records and
    ``metrics`` (``num-examples``, the loop's losses, the method's metrics).

    Raises:
        ConfigError / ProtocolError: a config key missing (named); FloatingPointError: a non-finite
            loss (with the round); ValueError: an empty training set.
    """
    cfg, action = msg.content[CONFIG], method.action
    mt = message_type(TRAIN, action)
    train = LocalTrainConfig.from_record(cfg)
    rnd, seed = int(required(cfg, SERVER_ROUND, mt)), int(required(cfg, SEED, mt))
    task, model, opt = build(factory, context, action, train.torch_threads, train)
    assert opt is not None  # build() with a train config makes the optimizer
    gen = round_generator(seed, node_partition_id(context), rnd)
    plugin = method.plugin(msg, context, task)
    metrics = train_local(task, opt, train, plugin, gen, rnd)
    records, more = method.after_train(msg, context, task, plugin)  # may refit the whitening
    save_module_state(context, model_key(action), model, opt)
    metrics = {NUM_EXAMPLES: int(task.x_train.shape[0]), **metrics, **more}
    return Message(RecordDict({**records, METRICS: MetricRecord(metrics)}), reply_to=msg)
