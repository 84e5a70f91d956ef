#!/usr/bin/env python3
"""Print the run-config keys of flwr_sheaf.config.KEYS as pyproject TOML and as the README's markdown table.

``python scripts/run_config_table.py --write`` rewrites both places (pyproject.toml's
``[tool.flwr.app.config]`` and the README's "Run config" table); ``tests/test_config.py`` checks
that they agree with KEYS.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flwr_sheaf.config import KEYS

ROOT = Path(__file__).resolve().parents[1]
HEAD = ["[tool.flwr.app.config]",
        "# Every key with its default, as defined once in flwr_sheaf/config.py (KEYS); tests/test_config.py",
        "# keeps this table, that module and the README's run-config table equal. Override with --run-config."]


def literal(v) -> str:
    """TOML literal of a default."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v) if isinstance(v, float) else str(v)


def toml() -> str:
    """The ``[tool.flwr.app.config]`` table."""
    return "\n".join(HEAD + [f"{k.name} = {literal(k.default)}" for k in KEYS.values()]) + "\n"


def markdown() -> str:
    """The README table."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    return "\n".join(rows + [f"| `{k.name}` | `{literal(k.default)}` | {k.doc} |" for k in KEYS.values()]) + "\n"


def write() -> None:
    """Rewrite both places in the repository."""
    p = ROOT / "pyproject.toml"
    s = p.read_text()
    a, b = s.index("[tool.flwr.app.config]"), s.index("[tool.pytest.ini_options]")
    p.write_text(s[:a] + toml() + "\n" + s[b:])
    r = ROOT / "README.md"
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
