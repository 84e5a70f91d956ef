"""The four ClientApp handlers every graph method shares, parameterised by a :class:`ClientMethod`.

Per-node state lives in ``context.state``; every value a handler needs comes in the message (a
missing key is an error, never a default).
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
    """Discovery's check of the node's model: ``rows`` pilots through ``model.latent`` must give
    ``(rows, model.d)`` and ``model.whitening`` must be ``d``-dimensional.

    Raises:
        ValueError: ``model.d`` not a positive int, or ``latent()`` / whitening of another shape.
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


_STALK_CHECKED: set[tuple] = set()  #: architectures that passed in this process


def _architecture(task: LocalTask) -> tuple:
    """What decides :func:`check_stalk_protocol`: the model's class, ``repr``, public attributes,
    state shapes and dtypes, ``d``s and the pilots' shape, dtype and device (not weights' values)."""
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
    """:func:`check_stalk_protocol` (its Raises), once per process per architecture (:func:`_architecture`)."""
    key = _architecture(task)
    if key not in _STALK_CHECKED:
        check_stalk_protocol(task, partition_id)
        _STALK_CHECKED.add(key)


def register_method_handlers(
    app: ClientApp, factory: TaskFactory, method: ClientMethod
) -> ClientApp:
    """Register ``method``'s query, train, evaluate and evaluate_comm handlers on ``app`` under
    ``method.action``, each bound to ``factory``; returns ``app``, which then pickles as its import
    path (:func:`~flwr_sheaf.client.reference.travel_by_reference`). A handler that raises becomes
    the node's error reply and its state is not committed.
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
    """``query.<action>``: discovery's reply, the node's :class:`~flwr_sheaf.protocol.NodeInfo`
    (a spare SuperNode inside the federation: ``d = 0``, docs/participation.md, 1.5).

    Raises:
        ProtocolError: ``torch-threads`` or ``device`` missing; DeviceUnavailableError: a device
            this machine lacks; ValueError: :func:`_describe`'s; OutsideScenarioError: a
            partition-id outside the scenario and the federation.
    """
    cfg, mt = msg.content[CONFIG], message_type(QUERY, method.action)
    set_torch_threads(int(required(cfg, TORCH_THREADS, mt)))
    resolve_device(str(required(cfg, DEVICE, mt)))
    partition_id = node_partition_id(context)
    num_partitions = int(context.node_config.get("num-partitions", 0))
    try:
        desc = _describe(factory, context, partition_id)
    except OutsideScenarioError:  # a spare SuperNode: described as one, never trained
        if partition_id >= num_partitions:  # outside the federation too: a wrong partition-id
            raise
        info = NodeInfo(partition_id, num_partitions, 0)
    else:
        info = NodeInfo(
            partition_id,
            num_partitions,
            desc.d,
            desc.classes,
            desc.num_pilots,
            desc.num_train,
            desc.pilot_digest,
        )
    return Message(RecordDict({INFO: info.to_record()}), reply_to=msg)


def describe_task(task: LocalTask, architecture: Hashable = None) -> TaskDescription:
    """The :class:`~flwr_sheaf.client.task.TaskDescription` of a built ``task`` (``architecture``:
    the field to fill in, a hook's key)."""
    return TaskDescription(
        int(task.model.d),
        tuple(int(c) for c in task.classes),
        int(task.x_pilot.shape[0]),
        int(task.x_train.shape[0]),
        shared_pilot_digest(task.x_pilot),
        architecture,
    )


def _describe(factory: TaskFactory, context: Context, partition_id: int) -> TaskDescription:
    """The node's description from its built task (stalk-checked); a description hook must say the
    same, else ValueError (fields named)."""
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
    """``train.<action>``: one round of local training (:func:`~flwr_sheaf.client.loop.train_local`)
    with the round's generator from (seed, partition-id, round), then the method's upload
    (:meth:`ClientMethod.after_train`); replies with its records and ``metrics``.

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
