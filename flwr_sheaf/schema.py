"""The one schema of ``results.json`` (docs/results-schema.md), its one reader and the writer's converter.

:class:`Results` (pydantic v2) is checked by the writer and by :func:`read_results`, every reader's
way in (one error, :class:`ResultsFileError`); :func:`to_json_value` makes a method's values JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["Results", "Round", "ResultsFileError", "read_results", "check_results", "to_json_value"]

#: A number as results.json holds it: finite (NaN and inf are written as null).
Num = Annotated[float, Field(allow_inf_nan=False)]
#: An accuracy or a share: a number in [0, 1].
Share = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]
#: Suffixes of per-round keys that are accuracies whichever method wrote them (``<method>_...``).
SHARE_SUFFIXES = ("_accuracy_degree_weighted", "_accuracy_mean")


class _Entry(BaseModel):
    """Strict (no string-to-number coercion), other keys kept: the methods add their own."""

    model_config = ConfigDict(strict=True, extra="allow")


class Round(_Entry):
    """One entry of ``rounds`` (:meth:`flwr_sheaf.strategy.records.RoundRecord.as_dict`)."""

    round: int
    sampled: list[int] | None = None
    num_sampled: Count | None = None
    num_trained: Count | None = None
    bytes_sent: Count | None = None
    bytes_received: Count | None = None
    failed: dict[str, list[int]] | None = None
    evaluated: list[int] | None = None
    evaluated_trained: Count | None = None
    private_accuracy_mean: Share | None = None
    communication_accuracy_mean: Share | None = None
    communication_accuracy_degree_weighted: Share | None = None
    communication_accuracy_non_edges: Share | None = None
    communication_accuracy_non_edges_direct: Share | None = None
    low_variance_fraction_mean: Share | None = None
    non_edge_pairs_measured: Count | None = None
    sheaf_near_kernel_dim: Count | None = None
    sheaf_kernel_dim_bound: Count | None = None
    sheaf_laplacian_eigenvalues: list[Num | None] | None = None
    sheaf_tv_mean: Num | None = None
    gap: Num | None = None
    distance_to_optimum: Num | None = None
    wall_seconds: Num | None = None
    elapsed_seconds: Num | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Round:
        for key, value in (self.model_extra or {}).items():
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
            if key.endswith(SHARE_SUFFIXES) and value is not None and not ok:
                raise ValueError(
                    f"{key} = {value!r:.40} is not an accuracy (a number in [0, 1]) or null"
                )
        if self.private_accuracy_mean is not None:  # evaluated: the report reads both
            fields = self.model_fields_set
            for key in ("communication_accuracy_degree_weighted", "communication_accuracy_mean"):
                if key not in fields:
                    raise ValueError(
                        f"round {self.round} is evaluated (private_accuracy_mean) but has no {key!r} "
                        "(every evaluated round records it, null when not measured)"
                    )
        if self.evaluated is not None and self.evaluated_trained is not None:
            if self.evaluated_trained > len(self.evaluated):
                raise ValueError(
                    f"evaluated_trained = {self.evaluated_trained} is more than the "
                    f"{len(self.evaluated)} evaluated node(s)"
                )
        return self


class Node(_Entry):
    """One entry of ``nodes`` (per partition-id, the last evaluation)."""

    d: Count | None = None
    private_accuracy: Share | None = None
    val_private_accuracy: Share | None = None
    low_variance_fraction: Share | None = None
    device: str | None = None
    trained: bool | None = None


class Degradation(_Entry):
    """``degradation``: the counts behind ``status``."""

    reasons: list[str] = []
    problems: list[str] = []


class Results(_Entry):
    """``results.json`` (every key: docs/results-schema.md); keys not named here are kept as they are."""

    config: dict[str, Any] = {}
    rounds: list[Round]
    nodes: dict[str, Node] = {}
    edges: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    total_wall_seconds: Num | None = None
    status: Literal["completed", "degraded", "failed"] | None = None
    degradation: Degradation | None = None
    latent_collapse: dict[str, Any] | None = None
    participation: dict[str, Any] | None = None
    action: str | None = None
    evaluation: dict[str, Any] | None = None
    graph: dict[str, Any] | None = None
    non_edges: list[dict[str, Any]] | None = None
    discovery: dict[str, Any] | None = None
    resumed: dict[str, Any] | None = None
    previous_run: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    tracking: dict[str, Any] | None = None
    warnings: list[str] | None = None
    #: the machine the ServerApp ran on (CPU model, ...)
    environment: dict[str, str | None] | None = None


class ResultsFileError(ValueError):
    """A ``results.json`` that cannot be read or does not have the schema (file and field named)."""


def _field(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out or "the top level"


def check_results(results: Any, source: str = "results.json") -> dict:
    """``results`` (a parsed ``results.json``) after checking it against :class:`Results`.

    Raises:
        ResultsFileError: ``"<source>: <field>: <problem>"`` for the first few problems, with the fix.
    """
    try:
        Results.model_validate(results)
    except ValidationError as e:
        shown = []
        for err in e.errors(include_url=False)[:5]:
            got = (
                "" if err["type"] in ("missing", "value_error") else f" (got {err['input']!r:.60})"
            )
            msg = str(err["msg"]).removeprefix("Value error, ").replace("Field required", "missing")
            msg = msg.replace("a valid dictionary or instance of Results", "a JSON object")
            msg = msg.replace("a valid dictionary", "a JSON object")
            shown.append(f"{_field(err['loc'])}: {msg}{got}")
        more = f"; and {e.error_count() - 5} more" if e.error_count() > 5 else ""
        raise ResultsFileError(
            f"{source}: {'; '.join(shown)}{more}; it does not have the results.json schema "
            "(docs/results-schema.md): it was edited or written by something else: rerun the run, "
            "or fix the fields named"
        ) from None
    return results


def read_results(path: str | Path) -> dict:
    """The parsed, checked ``results.json`` at ``path`` (the file, or its results directory).

    Raises:
        ResultsFileError: the file is missing, not a regular file, unreadable, not valid JSON or not
            of the schema; the file, the field, what is wrong and what to do named.
    """
    path = Path(path)
    if path.is_dir() and path.name != "results.json":
        path = path / "results.json"
    if path.is_dir():
        raise ResultsFileError(f"{path}: is a directory, not a results.json file")
    if path.exists() and not path.is_file():  # never opened: a FIFO would wait for a writer
        raise ResultsFileError(
            f"{path}: is not a regular file (a FIFO or a device), not a results.json file"
        )
    if not path.is_file():
        link = (
            f" (a link to {path.readlink()}: missing, or a loop of links)"
            if path.is_symlink()
            else ""
        )
        raise ResultsFileError(
            f"{path}: does not exist{link} (give a results.json or its results-dir)"
        )
    try:
        text = path.read_text()
        return check_results(json.loads(text), str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise ResultsFileError(f"{path}: cannot be read: {e}") from e
    except RecursionError:
        raise ResultsFileError(
            f"{path}: nested too deeply to be a results.json (an edit, or another file)"
        ) from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(
            f"{path}: is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}; the file has "
            f"{len(text)} characters): it is truncated or damaged (a run killed while writing it, or "
            "an edit); rerun the run, or restore the file from a copy"
        ) from e


def to_json_value(value: Any, where: str = "value") -> tuple[Any, list[str]]:
    """``value`` as JSON can write it, and what could not be (one line each, path from ``where``).

    numpy values become Python numbers and lists, NaN and inf null ("not measured"), tuples lists,
    mapping keys strings; any other object becomes null and is named.
    """
    problems: list[str] = []

    def conv(x: Any, at: str) -> Any:
        if isinstance(x, (np.ndarray, np.generic)):
            x = x.tolist()
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else None
        if isinstance(x, Mapping):
            out: dict[str, Any] = {}
            for k, v in x.items():
                if str(k) in out:  # {1: a, "1": b}: one would replace the other
                    problems.append(
                        f"{at}[{k!r}]: key is not JSON-writable: it is written {str(k)!r}, as "
                        "another key of the mapping (not written; use distinct string keys)"
                    )
                    continue
                out[str(k)] = conv(v, f"{at}[{k!r}]")
            return out
        if isinstance(x, (list, tuple)):
            return [conv(v, f"{at}[{i}]") for i, v in enumerate(x)]
        fix = "; return a list" if isinstance(x, (set, frozenset)) else ""
        problems.append(f"{at}: {type(x).__name__} is not JSON-writable{fix} (written as null)")
        return None

    try:
        return conv(value, where), problems
    except RecursionError:
        return None, [f"{where}: nested too deeply to be written (written as null)"]
