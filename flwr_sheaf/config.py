"""Every run-config key of flwr-sheaf: its one definition (:data:`KEYS`), default, check and meaning.

``pyproject.toml`` and docs/run-config.md are tested against :data:`KEYS`. Keys parse into frozen
dataclass sections (:func:`key_field`): :class:`RunConfig`, :class:`ScenarioConfig`,
:class:`FederationConfig`, :class:`LocalTrainConfig` and each built-in method's
(:func:`register_keys`, :func:`register_section`; docs/design.md); a researcher's method declares
its own keys (:func:`section`, :data:`METHOD_KEYS`). Constructing a section validates every field.
"""

from __future__ import annotations

import contextlib
import difflib
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar, Self, SupportsInt, TypeVar, cast

from flwr.app import ConfigRecord

from .data.partition import PARTITIONER_FORMS, check_agents_fit, parse_partitioner
from .data.sources import SOURCE_FORMS
from .devices import DEVICE_FORMS, check_device_spec
from .models.zoo import zoo_size, zoo_specs
from .participation import check_participation_spec, parse_participation
from .topology import build_graph, check_graph_scale, check_graph_spec

__all__ = [
    "Key",
    "TRACKERS",
    "check_trackers",
    "parse_trackers",
    "KEYS",
    "DEFAULTS",
    "ConfigError",
    "Section",
    "ScenarioConfig",
    "FederationConfig",
    "LocalTrainConfig",
    "RunConfig",
    "register_keys",
    "declare_default_method",
    "register_section",
    "parse_dim_or_auto",
    "parse_spec",
    "check_common_dim",
    "PAPER_PRESET",
    "PAPER_PRESET_TWO_AGENT",
    "apply_preset",
    "METHOD_TRAIN_DEFAULTS",
    "register_train_defaults",
    "apply_method_train_defaults",
    "method_train_changes",
    "RESUME_MUTABLE_KEYS",
    "EVALUATE_NODES",
    "config_differences",
    "resume_identity",
    "parse_int",
    "parse_float",
    "parse_bool",
    "parse_str",
    "node_partition_id",
]


class ConfigError(ValueError):
    """A run-config or message-config value is unknown, missing, of the wrong type or out of range."""


def node_partition_id(context: Any) -> int:
    """The node's ``partition-id`` as ``int`` (``context.node_config``: an int or a digit string).

    Raises:
        ConfigError: missing, not an integer (a bool, ``1.5``, ``'abc'``), negative or not below
            ``num-partitions``: the key, the value, the node id and the fix named.
    """
    cfg = context.node_config
    node = f"node {getattr(context, 'node_id', '?')}"
    fix = (
        'start the SuperNode with --node-config "partition-id=<i> num-partitions=<N>" '
        "where i is an integer in 0..N-1"
    )
    if "partition-id" not in cfg:
        raise ConfigError(f"{node}: its node config has no partition-id; {fix}")
    raw = cfg["partition-id"]
    text = raw.strip() if isinstance(raw, str) else raw
    if not (
        (isinstance(text, int) and not isinstance(text, bool))
        or (isinstance(text, str) and text.isdigit() and text.isascii())
    ):
        raise ConfigError(f"{node}: node config partition-id={raw!r} is not an integer; {fix}")
    pid = int(text)
    raw_n = cfg.get("num-partitions")
    n = raw_n if isinstance(raw_n, int) and not isinstance(raw_n, bool) and raw_n > 0 else None
    if pid < 0 or (n is not None and pid >= n):
        where = f"outside 0..{n - 1} (num-partitions={n})" if n is not None else "negative"
        raise ConfigError(f"{node}: node config partition-id={pid} is {where}; {fix}")
    return pid


# ---------------------------------------------------------------------------------------- checks
#: The largest integer a run-config value may be (a Flower record's int64).
INT64_MAX = 2**63 - 1
#: The largest ``seed``: a model's weights are drawn from torch's 64-bit seed ``seed * 1000 + partition-id``.
SEED_MAX = 2**53


def parse_int(lo: int | None = None, hi: int = INT64_MAX) -> Callable[[str, Any], int]:
    """A :class:`Key` parser ``parse(key, value) -> int``: an integer or an integral float in
    ``[lo, hi]`` (else :class:`ConfigError` naming key and value).
    """

    def parse(key: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ConfigError(f"{key}={v!r}: expected an integer")
        if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
            raise ConfigError(
                f"{key}={v!r}: expected an integer (a fractional value would be truncated)"
            )
        out = int(cast(SupportsInt, v))
        if lo is not None and out < lo:
            raise ConfigError(f"{key}={v!r}: must be >= {lo}")
        if out > hi:
            raise ConfigError(
                f"{key}={v!r}: must be <= {hi} (Flower messages and torch seeds are 64-bit integers)"
            )
        return out

    parse.declared = {"type": int, "lo": lo, "hi": hi}  # type: ignore[attr-defined]
    return parse


def parse_float(
    lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str, Any], float]:
    """A :class:`Key` parser ``parse(key, value) -> float``: a finite real (not a bool) within
    ``lo``/``hi`` (inclusive unless ``lo_open``/``hi_open``); :class:`ConfigError` names the bound.
    """

    def parse(key: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ConfigError(f"{key}={v!r}: expected a number")
        out = float(v)
        if not math.isfinite(out):
            raise ConfigError(f"{key}={v!r}: must be finite")
        if lo is not None and (out < lo or (lo_open and out == lo)):
            raise ConfigError(f"{key}={v!r}: must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and (out > hi or (hi_open and out == hi)):
            raise ConfigError(f"{key}={v!r}: must be {'<' if hi_open else '<='} {hi}")
        return out

    parse.declared = {"type": float, "lo": lo, "hi": hi}  # type: ignore[attr-defined]
    return parse


def parse_bool(key: str, v: Any) -> bool:
    """``v`` checked to be a bool, not ``"true"`` or ``1`` (a :class:`Key` parser)."""
    if not isinstance(v, bool):
        raise ConfigError(f"{key}={v!r}: expected true or false")
    return v


parse_bool.declared = {"type": bool}  # type: ignore[attr-defined]


def did_you_mean(value: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the valid choice closest to a mistyped ``value`` (difflib), or ``""``."""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_str(
    choices: tuple[str, ...] | None = None, nonempty: bool = False
) -> Callable[[str, Any], str]:
    """A :class:`Key` parser ``parse(key, value) -> str``: a string, returned stripped, one of
    ``choices`` when given, not blank when ``nonempty``; :class:`ConfigError` names key and value.
    """
    one_of = f"one of {list(choices)}" if choices is not None else ""

    def parse(key: str, v: Any) -> str:
        if not isinstance(v, str):
            raise ConfigError(f"{key}={v!r}: expected a string{'; ' + one_of if one_of else ''}")
        text = v.strip()
        if choices is not None and text not in choices:
            raise ConfigError(f"{key}={v!r}: must be {one_of}{did_you_mean(text, choices)}")
        if nonempty and not text:
            raise ConfigError(f"{key}={v!r}: must not be empty")
        return text

    parse.declared = {"type": str, "choices": choices, "nonempty": nonempty}  # type: ignore[attr-defined]
    return parse


def spec_suggestion(value: str, forms: Iterable[str], check: Callable[[str], object]) -> str:
    """``" (did you mean 'uniform:50'?)"`` for a mistyped spec (``"unifrom:50"``) of the ``forms``
    (``"uniform:K"``), parameter kept, offered only if ``check`` accepts it; else ``""``."""
    heads: dict[str, str] = {}  # name -> separator before its parameter ("" = none)
    for form in forms:
        m = re.match(r"([a-z]+(?:-[a-z]+)*)([-:]?)", str(form))
        if m:
            heads.setdefault(m.group(1), m.group(2))
    m = re.match(r"\s*([A-Za-z]+(?:[-_][A-Za-z]+)*)(.*)", str(value))
    if not m:
        return ""
    head, rest = m.group(1).lower().replace("_", "-"), m.group(2).strip().lstrip("-_: ")
    for close in difflib.get_close_matches(head, list(heads), n=3, cutoff=0.6):
        candidate = close + heads[close] + rest if rest and heads[close] else close
        if candidate == value:
            continue
        try:
            check(candidate)
        except (ValueError, TypeError):
            continue
        return f" (did you mean {candidate!r}?)"
    return ""


def parse_spec(
    check: Callable[[str], object], forms: Callable[[], Iterable[str]] | None = None
) -> Callable[[str, Any], str]:
    """A :class:`Key` parser of a non-empty string spec that ``check(text)`` accepts, returned
    stripped; its :class:`ConfigError` gives ``check``'s message and the closest of ``forms()``.
    """

    def parse(key: str, v: Any) -> str:
        text = parse_str(nonempty=True)(key, v)
        try:
            check(text)
        except ValueError as exc:
            hint = spec_suggestion(text, forms(), check) if forms is not None else ""
            raise ConfigError(f"{key}={v!r}: {exc}{hint}") from None
        return text.strip()  # what the check accepted: 'cpu ' is recorded and compared as 'cpu'

    return parse


def _num_pilots(key: str, v: Any) -> int:
    k = parse_int(0)(key, v)
    if k == 1:
        raise ConfigError(
            f"{key}={v!r}: must be 0 (all) or >= 2 (whitening and Procrustes need two pilot rows)"
        )
    return k


def _participation(key: str, v: Any) -> str:
    # Flower parses ``--run-config "participation=0.3"`` as a float: keep the spec a string.
    text = "" if v is None else v
    if isinstance(v, numbers.Real) and not isinstance(v, bool):
        text = repr(float(v))
    if not isinstance(text, str):
        raise ConfigError(f"{key}={v!r}: expected a string spec")
    try:
        check_participation_spec(text)
    except ValueError as exc:
        forms = ("uniform:<a>-<b>", "uniform:<seed>", "uniform")
        hint = spec_suggestion(text, forms, check_participation_spec)  # 'Uniform:0.1-0.5'
        raise ConfigError(f"{key}={v!r}: {exc}{hint}") from None
    return text.strip()


def parse_dim_or_auto(key: str, v: Any) -> str | int:
    """A :class:`Key` parser of a common dimension: ``"auto"``, ``"none"`` or an int >= 1 (else
    :class:`ConfigError`)."""
    if isinstance(v, str):
        v = v.strip()
        if v in ("auto", "none"):
            return v
        try:
            v = int(v)
        except ValueError:
            raise ConfigError(
                f"{key}={v!r}: expected 'auto', 'none' or a positive integer"
            ) from None
    return parse_int(1)(key, v)


def check_common_dim(key: str, dim: str | int, dims: list[int], zoo: str) -> None:
    """Refuse ``<key> = none`` (no adapter) on a zoo whose stalk dimensions ``dims`` differ
    (:class:`ConfigError` naming the key, the zoo, its dimensions and the fix)."""
    if dim == "none" and len(dims) > 1:
        raise ConfigError(
            f"{key}='none' needs equal stalk dimensions, but zoo={zoo!r} "
            f"has d in {dims}; use {key}='auto' (= {dims[0]}) or an integer"
        )


TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}
"""``{tracker name: (module it imports, pip extra installing it)}`` (:mod:`flwr_sheaf.tracking`)."""


def parse_trackers(spec: str | Iterable[str], key: str = "tracking") -> tuple[str, ...]:
    """Tracker names of a ``tracking`` value (``"tensorboard,wandb"`` or an iterable of names), in
    order, duplicates dropped (empty: tracking off).

    Raises:
        ConfigError: a name that is not a tracker (``key``, value and the valid names given).
    """
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    names: list[str] = []
    for part in parts:
        name = str(part).strip().lower()
        if not name:
            continue
        if name not in TRACKERS:
            raise ConfigError(
                f"{key}={spec!r}: unknown tracker {name!r}{did_you_mean(name, TRACKERS)}; valid "
                f"trackers: {sorted(TRACKERS)} (comma-separated, e.g. 'tensorboard,wandb'; empty = off)"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


EVALUATE_NODES = ("auto", "trained", "panel", "drawn")
"""Values of run-config ``evaluate-nodes`` (who is evaluated; notes/participation.md, 1.4.1)."""


def check_trackers(spec: str | Iterable[str], key: str = "tracking") -> tuple[str, ...]:
    """:func:`parse_trackers`, then check that each tracker's package is installed (without importing it).

    Raises:
        ConfigError: an unknown tracker, or a tracker whose package is missing (the pip extra to
            install named).
    """
    import importlib.util

    names = parse_trackers(spec, key)
    for name in names:
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"{key}={spec!r}: the {name} tracker needs the {module!r} package, which is not "
                f"installed: pip install -e '.[{extra}]'"
            )
    return names


def _tracking(key: str, v: Any) -> str:
    """The ``tracking`` key: its trackers (:func:`check_trackers`, so a missing package is named
    when the run config is parsed, before any message), comma-joined (``""``: off)."""
    return ",".join(check_trackers(parse_str()(key, v), key))


def _dataset(key: str, v: Any) -> str:
    text = parse_str(nonempty=True)(key, v).strip()
    if (
        text in ("mnist-bundled", "fashion-mnist")
        or (text[:4] == "idx:" and text[4:].strip())
        or (text[:3] == "hf:" and text[3:].strip())
    ):
        return text
    raise ConfigError(f"{key}={v!r}: unknown dataset spec; valid forms: {', '.join(SOURCE_FORMS)}")


@dataclass(frozen=True)
class Key:
    """One run-config key.

    Attributes:
        name: the run-config spelling (``"local-epochs"``).
        default: its default (the value ``pyproject.toml`` lists).
        parse: ``parse(name, value) -> value``: coerces and validates (:class:`ConfigError`).
        doc: one line for the run-config table (docs/run-config.md).
    """

    name: str
    default: Any
    parse: Callable[[str, Any], Any]
    doc: str

    def __call__(self, value: Any) -> Any:
        """Validated value of this key."""
        return self.parse(self.name, value)


_KEY_LIST = [
    Key(
        "method",
        "",  # declared by the default method's own unit (declare_default_method)
        parse_str(nonempty=True),
        "the method to run: a name in `flwr_sheaf.methods.METHODS` (docs/methods.md)",
    ),
    Key(
        "method-module",
        "",
        parse_str(),
        "comma-separated modules imported before `method` is looked up (a researcher's own "
        "method, docs/own-method.md); empty = the built-in methods only",
    ),
    Key("num-server-rounds", 10, parse_int(1), "server rounds"),
    Key(
        "round-timeout",
        3600.0,
        parse_float(0.0, lo_open=True),
        "seconds each round trip (train, evaluation phases) waits for replies; late nodes count as failed",
    ),
    Key("discovery-timeout", 300.0, parse_float(0.0, lo_open=True), "seconds to await SuperNodes"),
    Key(
        "discovery",
        "all",
        parse_str(("all", "sampled")),
        "`all` = query every SuperNode before round 1; `sampled` = derive agents' descriptions "
        "from the CNN-zoo scenario, query a SuperNode when first sampled (cross-device scale; on "
        "Ray which partition-ids train differs between runs; notes/participation.md)",
    ),
    Key(
        "results-dir",
        "results/default",
        parse_str(nonempty=True),
        "where `results.json` and `accuracy.png` go (relative to the ServerApp's directory)",
    ),
    Key(
        "preset",
        "",
        parse_str(("", "paper")),
        "`paper` = the paper's App. G hyper-parameters for every key left at its default (notes/presets.md); empty = none",
    ),
    Key(
        "train-defaults",
        "method",
        parse_str(("method", "shared")),
        "`method` = a method's own optimizer settings for training keys left at their default "
        "(notes/baselines.md, s0); `shared` = the package's defaults for every method",
    ),
    Key(
        "checkpoint-every",
        1,
        parse_int(0),
        "write `checkpoint.pkl` to `results-dir` every this many rounds and after the last one (0 = never; docs/resume.md)",
    ),
    Key("resume", False, parse_bool, "continue `results-dir`'s checkpointed run (docs/resume.md)"),
    Key(
        "resume-from",
        "",
        parse_str(),
        "continue the run checkpointed in this directory (or `checkpoint.pkl` file) instead; non-empty implies `resume`",
    ),
    Key(
        "node-state-dir",
        "",
        parse_str(),
        "root of the nodes' state directories (`<dir>/partition-<id>`) when a SuperNode has no `state-dir` node config "
        "(simulation; docs/resume.md)",
    ),
    Key(
        "overwrite",
        False,
        parse_bool,
        "allow a fresh run, or a `resume-from` elsewhere, into a `results-dir` holding another "
        "run's files (moved into `<results-dir>/previous-<UTC time>/`, never deleted; refused "
        "otherwise and on resuming this results-dir; docs/guarantees.md)",
    ),
    Key(
        "keep-previous",
        0,
        parse_int(0),
        "how many `<results-dir>/previous-<UTC time>/` folders (`overwrite`) to keep: the oldest "
        "beyond this many are removed, each logged; 0 = never delete (docs/guarantees.md)",
    ),
    Key(
        "max-failed-fraction",
        0.5,
        parse_float(0.0, 1.0),
        "the run ends failed (after writing `results.json`) when more than this share of train "
        "replies failed, or (below 1) a round trained nobody; 1 = never fail (docs/guarantees.md)",
    ),
    Key(
        "resume-fresh-nodes",
        False,
        parse_bool,
        "resume even when a node that trained before has no state (it restarts from scratch, "
        "recorded in `results.json`; refused otherwise, docs/guarantees.md)",
    ),
    Key(
        "tracking",
        "",
        _tracking,
        "per-round metrics to `tensorboard`, `wandb` or `tensorboard,wandb` (extras of those "
        "names; empty = off; docs/tracking.md)",
    ),
    Key("tracking-dir", "", parse_str(), "trackers' directory (empty = `<results-dir>/tracking`)"),
    Key("wandb-project", "flwr-sheaf", parse_str(nonempty=True), "W&B project of a `wandb` run"),
    Key(
        "wandb-mode",
        "offline",
        parse_str(("offline", "online")),
        "`offline` (nothing is sent; upload later with `wandb sync`) or `online` (needs `wandb login`)",
    ),
    # scenario
    Key("seed", 0, parse_int(0, SEED_MAX), "seed of data split, init, batch order, participation"),
    Key(
        "zoo",
        "paper-15",
        parse_spec(zoo_size, lambda: ("paper-15", "two-agent:<d>", "tiny-<N>")),
        "`paper-15` (Tab. 2), `two-agent:<d>` (Fig. 3 family), `tiny-<N>` (cheap agents)",
    ),
    Key(
        "dataset",
        "mnist-bundled",
        _dataset,
        "`mnist-bundled` (offline), `fashion-mnist` (`bash scripts/get_data.sh fashion-mnist`), "
        "`idx:<dir>`, `hf:<name>` (online)",
    ),
    Key("shift", 0.7, parse_float(0.0, 1.0), "label-shift strength s in [0, 1] (Eq. 23)"),
    Key("num-pilots", 500, _num_pilots, "shared pilots K >= 2 (0 = all of the 10% hold-out)"),
    Key(
        "whitening-shrinkage",
        0.0,
        parse_float(0.0, 1.0),
        "diagonal shrinkage a of the whitening covariance",
    ),
    Key(
        "whitening-eps",
        1e-3,
        parse_float(0.0, lo_open=True),
        "relative eigenvalue floor of the whitening covariance",
    ),
    Key(
        "partitioner",
        "label-shift",
        parse_spec(parse_partitioner, lambda: PARTITIONER_FORMS),
        "`label-shift` (Eq. 23: the zoo's class sets, `shift`), `dirichlet:<alpha>` "
        "(flwr-datasets' DirichletPartitioner; `shift` ignored) or `cross-device` (Eq. 23, a "
        "few samples per agent, one validation and test sample at least; "
        "benchmarks/records/performance.md)",
    ),
    # federation
    Key(
        "graph",
        "class-overlap",
        parse_spec(check_graph_spec),
        "`class-overlap[:density]`, `class-overlap-knn:k`, `random-regular:k`, `ring`, `complete`, or an edge list `0-1,1-2`",
    ),
    Key(
        "fraction-train",
        1.0,
        parse_float(0.0, 1.0, lo_open=True),
        "fraction of nodes that train per round (seeded per round)",
    ),
    Key(
        "participation",
        "",
        _participation,
        "per-node Bernoulli probabilities instead of `fraction-train`: `0.3`, `uniform:0.1-0.5`, `uniform[:seed]`, a comma list",
    ),
    Key("evaluate-every", 1, parse_int(0), "evaluate every N rounds and the last (0 = never)"),
    Key(
        "fraction-evaluate",
        1.0,
        parse_float(0.0, 1.0, lo_open=True),
        "fraction of nodes evaluated per evaluated round (seeded; edges need both ends sampled)",
    ),
    Key(
        "evaluate-nodes",
        "auto",
        parse_str(EVALUATE_NODES),
        "who is evaluated: `trained` = this round's trainers; `panel` = a fixed draw of "
        "`fraction-evaluate` from `seed`; `drawn` = a fresh draw each round; `auto` = `trained` "
        'when the trainers are a sample, else `drawn` (notes/participation.md, "Who is evaluated")',
    ),
    Key(
        "non-edge-pairs",
        20,
        parse_int(0),
        "non-adjacent node pairs measured per evaluated round after multi-hop transport and direct "
        "Procrustes (0 = off; notes/variants-diagnostics.md)",
    ),
    Key(
        "posthoc-readings",
        "both",
        parse_str(("both", "paper")),
        "`both` = communication accuracy with the whitening fitted on private training latents "
        "(the paper's reading) and on the pilots (not under `privacy = stringent`); `paper` = "
        "each method's own reading only (Sheaf-FRL's: the pilots; notes/baselines.md)",
    ),
    Key(
        "diagnostics-eigenvalues",
        6,
        parse_int(0),
        "smallest sheaf-Laplacian eigenvalues per evaluated round, with the near-kernel "
        "dimension (0 = off; notes/variants-diagnostics.md)",
    ),
    # local training
    Key("local-epochs", 2, parse_int(1), "local epochs per round"),
    Key("lr", 0.05, parse_float(0.0, lo_open=True), "SGD learning rate, see `train-defaults`"),
    Key("momentum", 0.9, parse_float(0.0, 1.0, hi_open=True), "SGD momentum, see `train-defaults`"),
    Key("weight-decay", 5e-4, parse_float(0.0), "SGD weight decay, see `train-defaults`"),
    Key("batch-size", 32, parse_int(1), "private training batch size"),
    Key("clip-norm", 5.0, parse_float(0.0), "per-agent gradient-norm clipping (0 = off)"),
    Key("max-steps-per-epoch", 0, parse_int(0), "SGD steps cap per local epoch (0 = every batch)"),
    Key(
        "torch-threads",
        1,
        parse_int(0, 1024),  # 16384 aborted the process in libgomp, 100000 crashed it
        "torch threads per ClientApp (0 = torch's default; >1 was 30x slower on a loaded 2-core box)",
    ),
    Key(
        "device",
        "auto",
        parse_spec(check_device_spec, lambda: DEVICE_FORMS),
        "where each node computes: `auto` (CUDA when the node's machine has it, else CPU), `cpu`, `cuda`, `cuda:N` (docs/devices.md)",
    ),
    # shared by Sheaf-FRL and FedMuscle
    Key("pilot-batch-size", 64, parse_int(2), "pilot rows per gluing step"),
]

KEYS: dict[str, Key] = {k.name: k for k in _KEY_LIST}
"""Every run-config key, by name (the single definition of each default)."""
DEFAULTS: dict[str, Any] = {k.name: k.default for k in _KEY_LIST}
"""``{name: default}`` (what ``pyproject.toml`` lists)."""
del _KEY_LIST  # KEYS is the one key list (declare_default_method replaces an entry there)


def register_keys(*keys: Key) -> tuple[str, ...]:
    """Add a built-in method's keys to :data:`KEYS` / :data:`DEFAULTS`; returns their names.

    Raises:
        ValueError: a key that redefines another key, or a default its own parser refuses.
    """
    for k in keys:
        _check_new_key(k)
        k(k.default)
        KEYS[k.name] = k
        DEFAULTS[k.name] = k.default
    return tuple(k.name for k in keys)


def declare_default_method(name: str) -> None:
    """Make ``name`` the ``method`` key's default (called on import by that method's unit).

    Raises:
        ValueError: another unit already declared a different default, or the key refuses ``name``.
    """
    old = KEYS["method"].default
    if old and old != name:
        raise ValueError(f"the default method is already {old!r}; {name!r} cannot be declared too")
    key = replace(KEYS["method"], default=name)
    key(name)
    KEYS["method"] = key
    DEFAULTS["method"] = name


def _check_new_key(k: Key) -> None:
    """Refuse ``k`` when another key of that name (the app's or a method's) differs from it."""
    old = KEYS.get(k.name) or METHOD_KEYS.get(k.name)
    if old is not None and (old.default, old.doc) != (k.default, k.doc):
        raise ValueError(f"run-config key {k.name!r} is already defined")


def _default_method() -> str:
    """The declared default of ``method``; :class:`ConfigError` when no unit declared one."""
    if not DEFAULTS["method"]:
        raise ConfigError(
            "method: no default method is declared (import flwr_sheaf.methods, whose built-in "
            'units declare it) and the run config sets none: set method = "<name>"'
        )
    return str(DEFAULTS["method"])


def _attr(key: str, prefix: str) -> str:
    name = key.removeprefix(prefix).replace("-", "_")
    return "lam" if name == "lambda" else name


#: Run-config keys methods own (:func:`section`, :func:`method_keys`), by name; not in :data:`KEYS`.
METHOD_KEYS: dict[str, Key] = {}


def lookup_key(name: str) -> Key:
    """The :class:`Key` called ``name`` (the app's or a method's); ``KeyError`` if unknown."""
    return KEYS[name] if name in KEYS else METHOD_KEYS[name]


def key_field(name: str) -> Any:
    """Dataclass field bound to the run-config key ``name`` (its default; ``metadata["key"]``).

    Typed ``Any`` so a type checker sees ``lr: float = key_field("lr")`` as a field with a default.
    """
    return field(default=lookup_key(name).default, metadata={"key": name})


def method_keys(*keys: Key) -> tuple[str, ...]:
    """Declare a method's own run-config keys (:data:`METHOD_KEYS`); returns their names.

    Raises:
        ValueError: a key that redefines another key.
    """
    for k in keys:
        _check_new_key(k)
        METHOD_KEYS[k.name] = k
    return tuple(k.name for k in keys)


S = TypeVar("S", bound="Section")


def section(*keys: str | Key, prefix: str = "") -> Callable[[type[S]], type[S]]:
    """Class decorator: make a frozen dataclass whose fields are the run-config ``keys``.

    Field names are the keys without ``prefix``, ``-`` written ``_`` (``lambda`` -> ``lam``);
    :class:`Key` objects declare the method's own keys (:data:`METHOD_KEYS`; a redefinition raises
    ``ValueError``). Written-out fields (:func:`method_keys`, :func:`key_field`) type-check.
    """
    names = [method_keys(k)[0] if isinstance(k, Key) else k for k in keys]

    def wrap(cls: type[S]) -> type[S]:
        body = dict(cls.__dict__.get("__annotations__", {}))
        ann = {}
        for key in names:
            name = _attr(key, prefix)
            default = lookup_key(key).default
            ann[name] = "str | int" if key.endswith("-dim") else type(default).__name__
            setattr(cls, name, field(default=default, metadata={"key": key}))
        # fields from the keys first, then any declared in the class body
        cls.__annotations__ = {**{k: v for k, v in ann.items() if k not in body}, **body}
        return dataclass(frozen=True)(cls)

    return wrap


# ---------------------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class Section:
    """Base of the typed config sections: each field bound to one run-config key
    (``field.metadata["key"]``); construction raises :class:`ConfigError` on a bad value (named).
    """

    def __post_init__(self) -> None:
        for f in fields(self):
            key = f.metadata.get("key")
            if key is not None:
                object.__setattr__(self, f.name, lookup_key(key)(getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Cross-field validation (none by default)."""

    def check_dims(self, dims: list[int], zoo: str) -> None:
        """Check against the zoo's sorted distinct stalk dimensions ``dims`` (none by default)."""

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Run-config keys of this section, in field order."""
        return tuple(f.metadata["key"] for f in fields(cls) if "key" in f.metadata)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, strict: bool = False) -> Self:
        """Section from ``{run-config key: value}`` (other keys ignored; ``strict``: all required).

        Raises:
            ConfigError: a missing key (strict) or a bad value, named.
        """
        return cls(**cls._given(values, strict))

    @classmethod
    def _given(cls, values: Mapping[str, Any], strict: bool = False) -> dict[str, Any]:
        """``{field name: value}`` of this section's keys present in ``values`` (all, if ``strict``)."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            key = f.metadata.get("key")
            if key is None:
                continue
            if key in values:
                kwargs[f.name] = values[key]
            elif strict:
                raise ConfigError(f"{cls.__name__}: key {key!r} missing from the message config")
        return kwargs

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        """Section from a received ``ConfigRecord`` (every key required; :class:`ConfigError`)."""
        return cls.from_mapping(record, strict=True)

    def to_dict(self) -> dict[str, Any]:
        """``{run-config key: value}`` of this section."""
        return {
            f.metadata["key"]: getattr(self, f.name) for f in fields(self) if "key" in f.metadata
        }

    def to_record(self) -> ConfigRecord:
        """The ``ConfigRecord`` form (what travels in messages)."""
        return ConfigRecord(self.to_dict())


@dataclass(frozen=True)
class ScenarioConfig(Section):
    """Agents, data and partition (one field per key; docs/run-config.md)."""

    zoo: str = key_field("zoo")
    dataset: str = key_field("dataset")
    shift: float = key_field("shift")
    seed: int = key_field("seed")
    num_pilots: int = key_field("num-pilots")
    whitening_shrinkage: float = key_field("whitening-shrinkage")
    whitening_eps: float = key_field("whitening-eps")
    partitioner: str = key_field("partitioner")


@dataclass(frozen=True)
class FederationConfig(Section):
    """Graph, who trains when, and how often to evaluate (one field per key; docs/run-config.md)."""

    graph: str = key_field("graph")
    fraction_train: float = key_field("fraction-train")
    participation: str = key_field("participation")
    evaluate_every: int = key_field("evaluate-every")
    seed: int = key_field("seed")
    fraction_evaluate: float = key_field("fraction-evaluate")
    evaluate_nodes: str = key_field("evaluate-nodes")
    non_edge_pairs: int = key_field("non-edge-pairs")
    diagnostics_eigenvalues: int = key_field("diagnostics-eigenvalues")
    posthoc_readings: str = key_field("posthoc-readings")


@dataclass(frozen=True)
class LocalTrainConfig(Section):
    """Local SGD of every method (:func:`flwr_sheaf.client.loop.train_local`)."""

    local_epochs: int = key_field("local-epochs")
    lr: float = key_field("lr")
    momentum: float = key_field("momentum")
    weight_decay: float = key_field("weight-decay")
    batch_size: int = key_field("batch-size")
    clip_norm: float = key_field("clip-norm")
    max_steps_per_epoch: int = key_field("max-steps-per-epoch")
    torch_threads: int = key_field("torch-threads")
    device: str = key_field("device")


PAPER_PRESET: dict[str, Any] = {
    "lr": 0.01,
    "momentum": 0.9,
    "weight-decay": 5e-4,
    "batch-size": 64,
    "pilot-batch-size": 64,
    "clip-norm": 1.0,
    "local-epochs": 1,
    "num-server-rounds": 100,
    "num-pilots": 0,
}
"""The paper's App. G hyper-parameters (``preset=paper``), 15-agent zoo (notes/presets.md)."""
PAPER_PRESET_TWO_AGENT: dict[str, Any] = {**PAPER_PRESET, "clip-norm": 0.0, "num-server-rounds": 20}
"""``preset=paper`` on a ``two-agent:<d>`` zoo (the Fig. 3 sweep): no clipping, 20 epochs."""


def apply_preset(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``run_config`` with its ``preset`` applied to every key left at its default (absent
    or equal: ``flwr run`` fills every default in).

    Raises:
        ConfigError: an unknown preset or zoo (named).
    """
    out = dict(run_config)
    preset = KEYS["preset"](out.get("preset", DEFAULTS["preset"]))
    if not preset:
        return out
    zoo = KEYS["zoo"](out.get("zoo", DEFAULTS["zoo"]))
    return _fill_defaults(
        out, PAPER_PRESET_TWO_AGENT if zoo.startswith("two-agent") else PAPER_PRESET
    )


def _fill_defaults(out: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``out`` with ``values`` set on every key ``out`` leaves at its default (absent or equal)."""
    for key, value in values.items():
        if out.get(key, DEFAULTS[key]) == DEFAULTS[key]:
            out[key] = value
    return out


METHOD_TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {}
"""``{method: {training key: value}}``: methods' own training settings (``train-defaults``)."""


def register_train_defaults(method: str, values: Mapping[str, Any]) -> None:
    """Declare ``method``'s own training settings ``{key: value}`` (:data:`METHOD_TRAIN_DEFAULTS`).

    Raises:
        ConfigError: a key that is not a run-config key.
    """
    for key in values:
        if key not in KEYS:
            raise ConfigError(
                f"register_train_defaults({method!r}): {key!r} is not a run-config key"
            )
    METHOD_TRAIN_DEFAULTS[method] = dict(values)


def apply_method_train_defaults(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`apply_preset`'s rule for the method's :data:`METHOD_TRAIN_DEFAULTS` (none with
    ``train-defaults = shared`` or a ``preset``; notes/presets.md).

    Raises:
        ConfigError: a bad ``train-defaults`` or ``preset`` value (named).
    """
    out = dict(run_config)
    mode = KEYS["train-defaults"](out.get("train-defaults", DEFAULTS["train-defaults"]))
    preset = KEYS["preset"](out.get("preset", DEFAULTS["preset"]))
    values = METHOD_TRAIN_DEFAULTS.get(str(out.get("method", DEFAULTS["method"])), {})
    return out if mode != "method" or preset else _fill_defaults(out, values)


def method_train_changes(run_config: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (package default, the method's value)}`` of the keys that
    :func:`apply_method_train_defaults` (its Raises) changes in ``run_config``."""
    before = apply_preset(run_config)
    after = apply_method_train_defaults(before)
    return {
        k: (before.get(k, DEFAULTS[k]), after[k])
        for k in sorted(after)
        if k in DEFAULTS and after[k] != before.get(k, DEFAULTS[k])
    }


@dataclass(frozen=True)
class RunConfig(Section):
    """The whole run config: run-level keys (fields of the same name; docs/run-config.md), the
    app's ``scenario``, ``federation`` and ``train`` sections and the methods' :attr:`sections`
    (read as ``config.<name>`` or typed, :meth:`section`).
    """

    method: str = field(  # declared by a unit on import (declare_default_method): read then
        default_factory=lambda: _default_method(), metadata={"key": "method"}
    )
    method_module: str = key_field("method-module")
    num_server_rounds: int = key_field("num-server-rounds")
    round_timeout: float = key_field("round-timeout")
    discovery_timeout: float = key_field("discovery-timeout")
    discovery: str = key_field("discovery")
    results_dir: str = key_field("results-dir")
    preset: str = key_field("preset")
    train_defaults: str = key_field("train-defaults")
    checkpoint_every: int = key_field("checkpoint-every")
    resume: bool = key_field("resume")
    resume_from: str = key_field("resume-from")
    node_state_dir: str = key_field("node-state-dir")
    overwrite: bool = key_field("overwrite")
    keep_previous: int = key_field("keep-previous")
    max_failed_fraction: float = key_field("max-failed-fraction")
    resume_fresh_nodes: bool = key_field("resume-fresh-nodes")
    tracking: str = key_field("tracking")
    tracking_dir: str = key_field("tracking-dir")
    wandb_project: str = key_field("wandb-project")
    wandb_mode: str = key_field("wandb-mode")

    #: every section every run parses, by name: the app's three, then those methods register
    SECTIONS: ClassVar[dict[str, type[Section]]] = {}

    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    train: LocalTrainConfig = field(default_factory=LocalTrainConfig)
    #: the registered sections (:func:`register_section`) by name; missing ones take their defaults
    sections: Mapping[str, Section] = field(default_factory=dict)
    #: the selected method's own section (a method declaring its keys with :class:`Key`), else None
    method_section: Section | None = None
    #: agents of a method with its own problem, not the CNN zoo (RFedAGS, ``Method.num_nodes``):
    #: ``participation`` is checked on them, no graph built; None = the zoo's; 0 = not known yet
    agents: int | None = field(default=None, compare=False)
    #: what the run config likely does not mean, found by :meth:`check` (logged by the ServerApp and
    #: recorded in ``results.json``'s ``warnings``)
    warnings: tuple[str, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        own = dict(self.sections)
        unknown = sorted(set(own) - set(self.SECTIONS))
        if unknown:
            raise ConfigError(
                f"unknown config section(s) {unknown}; known: {sorted(self.SECTIONS)}"
            )
        for name, cls in self.SECTIONS.items():
            if name not in _FIELD_SECTIONS and name not in own:
                own[name] = cls()
        object.__setattr__(self, "sections", own)
        super().__post_init__()

    def __getattr__(self, name: str) -> Any:
        """A registered section (:attr:`sections`) read as an attribute (``config.fedproto``)."""
        sections = self.__dict__.get("sections")
        if sections is None or name not in sections:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return sections[name]

    def section(self, cls: type[S]) -> S:
        """The registered section of type ``cls``; :class:`ConfigError` when none is."""
        for s in self.sections.values():
            if type(s) is cls:
                return s
        raise ConfigError(f"no registered config section {cls.__name__}")

    def own(self, cls: type[S]) -> S:
        """The method's own section, checked to be a ``cls`` (else :class:`ConfigError`)."""
        if not isinstance(self.method_section, cls):
            raise ConfigError(
                f"method={self.method!r}: expected its {cls.__name__} section, "
                f"got {type(self.method_section).__name__}"
            )
        return self.method_section

    @classmethod
    def from_run_config(
        cls,
        run_config: Mapping[str, Any],
        method_section: type[Section] | None = None,
        agents: int | None = None,
    ) -> RunConfig:
        """Parse a Flower run config (defaults, :func:`apply_preset`,
        :func:`apply_method_train_defaults`); ``method_section`` parses the selected method's keys.

        Raises:
            ConfigError: an unknown key (with the closest known key) or a bad value, named.
        """
        known = set(KEYS) | set(METHOD_KEYS)
        unknown = sorted(set(run_config) - known)
        if unknown:
            text = ", ".join(f"{k!r}{did_you_mean(k, known)}" for k in unknown)
            raise ConfigError(f"unknown run-config key(s) {text}; known keys: {sorted(known)}")
        run_config = apply_method_train_defaults(apply_preset(run_config))
        sections = {name: sec.from_mapping(run_config) for name, sec in cls.SECTIONS.items()}
        top = cls._given(run_config)
        own = method_section.from_mapping(run_config) if method_section is not None else None
        app_sections: dict[str, Any] = {n: sections.pop(n) for n in _FIELD_SECTIONS}
        return cls(**top, **app_sections, sections=sections, method_section=own, agents=agents)

    def check(self) -> None:
        """Build the graph and participation probabilities now: bad values fail before any message.

        Raises:
            ConfigError: :meth:`check_scale`'s; an unknown, out-of-zoo or unconnected graph;
                ``participation`` of another count than the agents or 0 everywhere; or a section's
                :meth:`Section.check_dims` refusing the zoo's stalk dimensions.
        """
        if self.agents is not None:  # the method's own problem: no zoo, no graph
            self._check_participation(self.agents, f"method={self.method!r} ({self.agents} agents)")
            return
        self.check_scale()  # O(1) facts first: nothing of the zoo's size is built before they pass
        try:
            specs = zoo_specs(self.scenario.zoo)
            graph = build_graph(
                self.federation.graph, len(specs), class_sets=[s.classes for s in specs]
            )
        except ValueError as exc:
            raise ConfigError(
                f"graph={self.federation.graph!r} on zoo={self.scenario.zoo!r}: {exc}"
            ) from None
        object.__setattr__(self, "warnings", self._graph_warnings(graph))
        self._check_participation(len(specs), f"zoo={self.scenario.zoo!r}")
        dims = sorted({int(s.d) for s in specs})
        for name in self.SECTIONS:
            getattr(self, name).check_dims(dims, self.scenario.zoo)

    def _graph_warnings(self, graph: Any) -> tuple[str, ...]:
        """The default graph on a small zoo (4 to 6 agents) leaving a node with one neighbour
        (docs/own-app.md)."""
        n = graph.number_of_nodes()
        if not 4 <= n < 7 or self.federation.graph != KEYS["graph"].default:
            return ()
        degrees = sorted(d for _, d in graph.degree())
        if degrees[0] > 1:
            return ()
        return (
            f"graph not set: the default graph={self.federation.graph!r} (density 0.4) on {n} "
            f"agents keeps {graph.number_of_edges()} of {n * (n - 1) // 2} pairs, degrees "
            f"{degrees} (nodes with a single neighbour); set graph='ring' or graph='complete' for "
            "a small federation (or a denser graph='class-overlap:<density>')",
        )

    def check_scale(self) -> None:
        """O(1) size checks from the zoo's ``N``: :func:`~flwr_sheaf.topology.check_graph_scale`,
        :func:`check_run_memory`, :func:`~flwr_sheaf.data.partition.check_agents_fit`.

        Raises:
            ConfigError: the key (``graph``, ``zoo``, ``dataset``, ``num-pilots``), the numbers and the
                remedy named.
        """
        zoo, graph = self.scenario.zoo, self.federation.graph
        n = zoo_size(zoo)
        check_run_memory(zoo, n)
        try:
            check_graph_scale(graph, n)
        except ValueError as exc:
            raise ConfigError(f"graph={graph!r} on zoo={zoo!r}: {exc}") from None
        try:
            check_agents_fit(
                self.scenario.dataset,
                n,
                self.scenario.num_pilots or None,
                zoo=zoo,
                partitioner=self.scenario.partitioner,
            )
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _check_participation(self, agents: int, on: str) -> None:
        """``participation`` fits ``agents`` (0 = not known yet) and lets some node train."""
        part = self.federation.participation
        if agents == 0:
            return
        try:
            p = parse_participation(part, agents, self.federation.seed)
        except ValueError as exc:
            raise ConfigError(f"participation={part!r} on {on}: {exc}") from None
        if p is not None and p.max() == 0.0:  # (the Python API allows it: an evaluation-only run)
            raise ConfigError(
                f"participation={part!r}: every node has probability 0, so no node would ever train"
            )

    def to_dict(self) -> dict[str, Any]:
        """Every run-config key with its effective value (what ``results.json`` records)."""
        out = super().to_dict()
        for name in self.SECTIONS:
            out.update(getattr(self, name).to_dict())
        own = self.method_section.to_dict() if self.method_section is not None else {}
        return {**{k: out[k] for k in KEYS}, **own}


#: A CNN-zoo run's peak memory, base + per agent (benchmarks/records/performance.md, scale curve).
RUN_BASE_BYTES = 1.2 * 2**30
RUN_BYTES_PER_AGENT = 52 * 2**10


def check_run_memory(zoo: str, num_agents: int, memory: int | None = None) -> None:
    """Refuse a zoo of ``num_agents`` whose run needs more than ``memory`` bytes (default: this
    machine's, ``os.sysconf``; unknown: not checked).

    Raises:
        ConfigError: ``zoo`` named with the estimate, the machine's memory and the largest zoo that fits.
    """
    if memory is None:
        try:
            memory = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):
            return
    need = RUN_BASE_BYTES + num_agents * RUN_BYTES_PER_AGENT
    if need <= memory:
        return
    most = max(2, int((memory - RUN_BASE_BYTES) // RUN_BYTES_PER_AGENT))
    raise ConfigError(
        f"zoo={zoo!r}: a run of {num_agents} agents needs about {need / 2**30:.0f} GiB "
        f"({RUN_BYTES_PER_AGENT // 2**10} KiB an agent past {RUN_BASE_BYTES / 2**30:.1f} GiB, measured "
        f"in benchmarks/records/performance.md), more than this machine's {memory / 2**30:.0f} GiB; use at most "
        f"zoo='tiny-{most}' here, or a machine with more memory"
    )


RESUME_MUTABLE_KEYS: frozenset[str] = frozenset(
    "num-server-rounds round-timeout discovery-timeout results-dir checkpoint-every resume "
    "resume-from node-state-dir device torch-threads overwrite keep-previous max-failed-fraction "
    "resume-fresh-nodes tracking tracking-dir wandb-project wandb-mode".split()
)
"""Run-config keys a resumed run may change (they enter no result); every other key must equal the
checkpointed run's and the node state file's (docs/resume.md)."""


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` (as given, ``None`` when absent) of the keys outside
    :data:`RESUME_MUTABLE_KEYS` whose :func:`effective_values` differ; empty: a resume may go on."""
    keys = (set(saved) | set(current)) - RESUME_MUTABLE_KEYS
    a, b = effective_values(saved), effective_values(current)
    return {k: (saved.get(k), current.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)}


def resume_identity(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` without :data:`RESUME_MUTABLE_KEYS`, keys sorted (node state files' copy)."""
    return {str(k): v for k, v in sorted(run_config.items()) if k not in RESUME_MUTABLE_KEYS}


def effective_values(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Every known key's effective value (defaults, presets, parsed if valid); others as given."""
    known = {**METHOD_KEYS, **KEYS}
    full = {**{k: key.default for k, key in known.items()}, **run_config}
    with contextlib.suppress(ConfigError):
        full = apply_method_train_defaults(apply_preset(full))
    for k, v in full.items():
        if k in known:
            with contextlib.suppress(ConfigError, ValueError, TypeError):
                full[k] = known[k](v)
    return full


def _check_defaults() -> None:
    """Import-time guard: defaults (but ``method``'s) pass their checks; every field names a key."""
    for k in KEYS.values():
        if k.name != "method":
            k(k.default)
    for cls in (ScenarioConfig, FederationConfig, LocalTrainConfig):
        for f in fields(cls):
            assert f.metadata["key"] in KEYS and f.default is not MISSING


_check_defaults()


#: the sections that are written-out fields of :class:`RunConfig` (the app's own)
_FIELD_SECTIONS = ("scenario", "federation", "train")
RunConfig.SECTIONS.update(
    scenario=ScenarioConfig, federation=FederationConfig, train=LocalTrainConfig
)
_RUN_CONFIG_FIELDS = frozenset(f.name for f in fields(RunConfig))


def register_section(name: str, cls: type[Section]) -> type[Section]:
    """Add a built-in method's section (keys from :func:`register_keys`) to every run's config, read
    as ``config.<name>``; returns ``cls``.

    Raises:
        ValueError: ``name`` is taken, or a field of ``cls`` names no key of :data:`KEYS`.
    """
    old = RunConfig.SECTIONS.get(name)
    if (old is not None and old.__qualname__ != cls.__qualname__) or (
        old is None and name in _RUN_CONFIG_FIELDS
    ):
        raise ValueError(f"config section {name!r} is already registered ({old})")
    for f in fields(cls):
        if f.metadata.get("key") not in KEYS or f.default is MISSING:
            raise ValueError(f"{cls.__name__}.{f.name}: not bound to a key of KEYS (register_keys)")
    RunConfig.SECTIONS[name] = cls
    return cls
