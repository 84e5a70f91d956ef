"""Node state that survives a SuperNode restart: the ``state-dir`` node-config key (docs/resume.md).

ClientApp mods: :func:`persist_state` writes ``context.state`` to
``<dir>/partition-<id>/round-<R>.state`` and reloads the newest admissible file (format and
retention: docs/resume.md); :func:`refuse_what_the_server_refuses` raises on a train reply the server
would refuse, so Flower rolls the state back (docs/guarantees.md).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from ..config import DEFAULTS, config_differences, node_partition_id, resume_identity
from ..integrity import SealedFileError, read_sealed, write_sealed
from ..protocol import (
    CONFIG,
    METRICS,
    NUM_EXAMPLES,
    RESUME_FRESH,
    RESUME_ROUND,
    RESUME_STATE_ROUNDS,
    SERVER_ROUND,
    as_int,
    config_record,
    train_reply_problem,
)

__all__ = [
    "STATE_DIR",
    "META_KEY",
    "StateFileError",
    "persist_state",
    "state_files",
    "read_state",
    "write_state",
    "serialize_state",
    "RefusedReplyError",
    "refuse_what_the_server_refuses",
]

log = logging.getLogger("flwr_sheaf")

#: Node-config key naming the node's state directory (unset or empty: nothing is persisted).
STATE_DIR = "state-dir"
#: Run-config key with the same meaning for nodes whose node config has no ``state-dir``.
RUN_STATE_DIR = "node-state-dir"
#: ``context.state`` entry the mod maintains: ``round`` and ``previous-round`` of the state it holds.
META_KEY = "flwr-sheaf.persisted"

MAGIC = b"flwr-sheaf node state v1\n"
FORMAT = 1
_NAME = re.compile(r"^round-(\d+)\.state$")


class StateFileError(SealedFileError):
    """A state file that must not be loaded (other node, run, run config; corrupted; pruned round)."""


def serialize_state(state: RecordDict) -> bytes:
    """Flower's protobuf bytes of a ``RecordDict`` (deterministic map order)."""
    return recorddict_to_proto(state).SerializeToString(deterministic=True)


def _resuming(run_config: Mapping[str, Any]) -> bool:
    return run_config.get("resume") is True or bool(run_config.get("resume-from"))


def _keep(run_config: Mapping[str, Any]) -> int:
    every = (
        run_config["checkpoint-every"]
        if "checkpoint-every" in run_config
        else DEFAULTS["checkpoint-every"]
    )
    return max(2, int(every) + 1) if isinstance(every, int) and not isinstance(every, bool) else 2


def node_dir(context: Context) -> Path | None:
    """``<root>/partition-<id>`` (root: node config ``state-dir``, else run config
    ``node-state-dir``; StateFileError if not a string), or None when nothing is persisted."""
    for where, cfg, key in (
        ("node config", context.node_config, STATE_DIR),
        ("run config", context.run_config, RUN_STATE_DIR),
    ):
        root = cfg[key] if key in cfg else None
        if root is None or root == "":
            continue
        if not isinstance(root, str):
            raise StateFileError(f"{where} {key}={root!r}: expected a directory path (string)")
        return Path(root).expanduser() / f"partition-{node_partition_id(context)}"
    return None


def state_files(directory: Path) -> dict[int, Path]:
    """``{server round: path}`` of the state files in ``directory`` (empty when it does not exist)."""
    if not directory.is_dir():
        return {}
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := _NAME.match(p.name))}
    return dict(sorted(found.items()))


def _read(path: Path, payload: bool) -> tuple[dict, bytes | None]:
    what = "flwr-sheaf node state file"
    return read_sealed(path, MAGIC, FORMAT, payload=payload, what=what, error=StateFileError)


def read_state(path: Path) -> tuple[dict, RecordDict]:
    """Metadata and ``RecordDict`` of one state file (checksum verified).

    Raises:
        StateFileError: a bad header, format or checksum.
    """
    meta, data = _read(path, payload=True)
    return meta, recorddict_from_proto(ProtoRecordDict.FromString(data))


def write_state(directory: Path, state: RecordDict, meta: Mapping[str, Any]) -> Path:
    """Write ``state`` with ``meta`` atomically to ``directory/round-<meta['round']>.state``; its path.

    Raises:
        OSError: the directory cannot be created or written (the file and the fix named).
    """
    path = directory / f"round-{int(meta['round'])}.state"
    try:
        return write_sealed(path, MAGIC, meta, serialize_state(state), FORMAT)
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"cannot write the node state file {path}: {exc.strerror or exc}; free space there or set "
            f"the node config {STATE_DIR} (run config {RUN_STATE_DIR}) to a writable directory",
        ) from exc


def _check(meta: dict, path: Path, context: Context) -> None:
    pid, n = node_partition_id(context), int(context.node_config.get("num-partitions", 0))
    if (meta["partition-id"], meta["num-partitions"]) != (pid, n):
        raise StateFileError(
            f"{path} holds the state of partition-id {meta['partition-id']} (num-partitions {meta['num-partitions']}), "
            f"this node is partition-id {pid} (num-partitions {n}): give every SuperNode its own {STATE_DIR}"
        )
    diff = config_differences(meta["run-config"], resume_identity(context.run_config))
    if diff:
        text = ", ".join(f"{k}: {a!r} in the file, {b!r} now" for k, (a, b) in diff.items())
        raise StateFileError(
            f"{path} was written under a different run config ({text}); use another "
            f"{STATE_DIR} or remove this one to start afresh"
        )
    if meta["run-id"] != context.run_id and not _resuming(context.run_config):
        raise StateFileError(
            f"{path} holds round {meta['round']} of an earlier Flower run ({meta['run-id']}); set the run config "
            f"resume=true (or resume-from) to continue that run, or remove {path.parent} to start afresh"
        )


def _restore(context: Context, directory: Path, server_round: int, category: str) -> None:
    """Load the newest admissible state file into the empty ``context.state`` (or leave it empty)."""
    files = state_files(directory)
    if not files:
        if server_round > 1 and _resuming(context.run_config):
            log.warning(
                "partition-id %s: no state files in %s; starting round %d from initialisation (right only "
                "if this node never trained before)",
                context.node_config["partition-id"],
                directory,
                server_round,
            )
        return
    metas = {}
    for r, path in files.items():
        metas[r], _ = _read(path, payload=False)
        _check(metas[r], path, context)
    ok = [
        r
        for r, m in metas.items()
        if r < server_round
        or (r == server_round and category != "train" and m["run-id"] == context.run_id)
    ]
    if not ok:
        oldest = min(metas)
        if metas[oldest]["previous-round"] == 0:
            return  # the files left by a stopped run start after this round: the node had no state yet
        raise StateFileError(
            f"{directory} has state for rounds {sorted(files)} (the oldest continues round "
            f"{metas[oldest]['previous-round']}, which was pruned) but round {server_round} needs "
            f"the state before it; the server resumed from an older checkpoint than the node kept"
        )
    meta, state = read_state(files[max(ok)])
    _check(meta, files[max(ok)], context)
    for key, record in state.items():
        context.state[key] = record
    log.info(
        "partition-id %s: state of round %d reloaded from %s",
        context.node_config["partition-id"],
        meta["round"],
        files[max(ok)],
    )


def _save(context: Context, directory: Path, server_round: int) -> None:
    held = config_record(context.state, META_KEY) if META_KEY in context.state else None
    previous = 0 if held is None else as_int(held["round"], "round")
    if held is not None and previous > server_round:
        raise StateFileError(
            f"message of server round {server_round} after state of round {previous}"
        )
    if held is not None and previous == server_round:
        previous = as_int(held["previous-round"], "previous-round")
    context.state[META_KEY] = ConfigRecord({"round": server_round, "previous-round": previous})
    write_state(
        directory,
        context.state,
        {
            "partition-id": node_partition_id(context),
            "num-partitions": int(context.node_config.get("num-partitions", 0)),
            "run-id": int(context.run_id),
            "round": server_round,
            "previous-round": previous,
            "run-config": resume_identity(context.run_config),
        },
    )
    files = state_files(directory)
    older = [r for r in files if r <= server_round]
    # later rounds of a stopped run are superseded; keep the newest few
    for r, path in files.items():
        if r > server_round or r in older[: -_keep(context.run_config)]:
            path.unlink(missing_ok=True)


def _check_resumed(
    context: Context, directory: Path, state_rounds: list[int], restored: int, fresh: bool
) -> None:
    """At a resumed run's discovery, a node that trained up to ``state_rounds[partition-id]`` must
    find its state of a round in ``[that round, restored]``, else StateFileError (``fresh``: a warning)."""
    pid = node_partition_id(context)
    need = state_rounds[pid] if pid < len(state_rounds) else 0
    if need <= 0:
        return
    files = state_files(directory)
    usable = [r for r in files if need <= r <= restored]
    if usable:
        meta, _ = _read(files[max(usable)], payload=False)
        _check(meta, files[max(usable)], context)
        return
    what = "no state files" if not files else f"state files of rounds {sorted(files)} only"
    text = (
        f"resume: partition-id {pid} trained up to round {need} (server checkpoint, resumed after round {restored}) "
        f"but {directory} has {what}; point node-state-dir (or the node config {STATE_DIR}) at the stopped run's "
        f"node state, or set resume-fresh-nodes=true to restart partition-id {pid} from initialisation"
    )
    if not fresh:
        raise StateFileError(text)
    log.warning(
        "%s: restarting it from initialisation (resume-fresh-nodes=true)", text.split("; point")[0]
    )


def persist_state(
    msg: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """Flower ClientApp mod: reload and write ``context.state`` (module docstring).

    Raises:
        StateFileError: a state file that must not be loaded, or a resuming run's ``query`` on a
            node without a state directory (Flower makes it the node's error reply).
        OSError: the state directory cannot be written.
    """
    directory = node_dir(context)
    content = msg.content
    category = msg.metadata.message_type.split(".", 1)[0]
    if directory is None and category == "query" and _resuming(context.run_config):
        raise StateFileError(
            f"the run config resumes a stopped run, but this SuperNode keeps no state (neither the "
            f"node config {STATE_DIR} nor the run config {RUN_STATE_DIR} is set): its models would "
            f"restart from initialisation"
        )
    if category == "query" and CONFIG in content and RESUME_STATE_ROUNDS in content[CONFIG]:
        cfg: MutableMapping[str, Any] = content[CONFIG]
        if directory is not None:
            rounds, restored = [int(r) for r in cfg[RESUME_STATE_ROUNDS]], int(cfg[RESUME_ROUND])
            _check_resumed(context, directory, rounds, restored, bool(cfg[RESUME_FRESH]))
        # the resume keys are the mod's, not the handler's
        for key in (RESUME_STATE_ROUNDS, RESUME_ROUND, RESUME_FRESH):
            cfg.pop(key, None)
    if directory is None or CONFIG not in content or SERVER_ROUND not in content[CONFIG]:
        return call_next(msg, context)
    server_round = as_int(config_record(content, CONFIG)[SERVER_ROUND], SERVER_ROUND)
    if len(context.state) == 0:
        _restore(context, directory, server_round, category)
    before = None if category == "train" else serialize_state(context.state)
    reply = call_next(msg, context)
    if not reply.has_error() and (before is None or serialize_state(context.state) != before):
        _save(context, directory, server_round)
    return reply


class RefusedReplyError(RuntimeError):
    """A train reply the server would refuse (its problem named); raised so the node's state is rolled back."""


def refuse_what_the_server_refuses(
    msg: Message, context: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """Flower ClientApp mod: raise instead of returning a train reply the server would refuse
    (other replies, error replies and those without ``metrics/num-examples`` pass unchanged).

    Raises:
        RefusedReplyError: the reply's problem, the partition-id and the server round named.
    """
    reply = call_next(msg, context)
    if (
        not msg.metadata.message_type.startswith("train.")
        or reply.has_error()
        or METRICS not in reply.content
        or NUM_EXAMPLES not in reply.content[METRICS]
    ):
        return reply
    problem = train_reply_problem(reply.content, arrays=True)
    if problem is not None:
        raise RefusedReplyError(
            f"partition-id {context.node_config.get('partition-id')}, "
            f"{msg.metadata.message_type} of round {msg.metadata.group_id}: {problem}; the server "
            f"would refuse this reply, so this node keeps its state from before the round"
        )
    return reply
