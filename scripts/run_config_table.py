#!/usr/bin/env python3
"""Print the run-config keys as pyproject TOML and as docs/run-config.md's markdown table.

The keys are the app's (flwr_sheaf.config.KEYS) followed by the own keys of each built-in method
unit (flwr_sheaf/methods/<name>: its config section's keys, in METHOD_KEYS). ``python
scripts/run_config_table.py --write`` rewrites both places (pyproject.toml's
``[tool.flwr.app.config]`` and the table in ``docs/run-config.md``); ``tests/test_config.py`` checks
that they agree with these keys.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flwr_sheaf.config import KEYS, METHOD_KEYS, Key
from flwr_sheaf.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
HEAD = [
    "[tool.flwr.app.config]",
    "# Every key with its default, as defined once in flwr_sheaf/config.py (KEYS, with the built-in methods'",
    "# keys from flwr_sheaf/methods/<name>/config.py); tests/test_config.py",
    "# keeps this table, that module and docs/run-config.md's table equal. Override with --run-config.",
]


def literal(v) -> str:
    """TOML literal of a default."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)


def method_sections() -> dict[str, list[Key]]:
    """``{package path of a built-in method unit: its own keys}``, in registry order (a section
    shared by several methods, like the RFedAGS family's, once)."""
    out: dict[str, list[Key]] = {}
    for m in METHODS.values():
        cls = m.config
        if cls is None or not cls.__module__.startswith("flwr_sheaf."):
            continue
        path = cls.__module__.replace(".", "/")
        if path not in out:
            out[path] = [METHOD_KEYS[k] for k in cls.keys()]
    return out


def toml() -> str:
    """The ``[tool.flwr.app.config]`` table."""
    lines = HEAD + [f"{k.name} = {literal(k.default)}" for k in KEYS.values()]
    for path, keys in method_sections().items():
        lines += [f"# the method's own section ({path})"] + [
            f"{k.name} = {literal(k.default)}" for k in keys
        ]
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The table of ``docs/run-config.md``."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    keys = [*KEYS.values(), *(k for ks in method_sections().values() for k in ks)]
    return (
        "\n".join(rows + [f"| `{k.name}` | `{literal(k.default)}` | {k.doc} |" for k in keys])
        + "\n"
    )


def write() -> None:
    """Rewrite both places in the repository."""
    p = ROOT / "pyproject.toml"
    s = p.read_text()
    a, b = s.index("[tool.flwr.app.config]"), s.index("[tool.pytest.ini_options]")
    p.write_text(s[:a] + toml() + "\n" + s[b:])
    r = ROOT / "docs" / "run-config.md"
    s = r.read_text()
    a = s.index("| key | default | meaning |")
    b = s.index("\n\n", a) + 1
    r.write_text(s[:a] + markdown() + s[b:])


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        print(toml())
        print(markdown())
