"""The layering the README promises, checked on the source: imports point one way, defaults live once.

- ``strategy/`` never imports ``client/`` and ``client/`` never imports ``strategy/`` (both import
  ``protocol``); in a method's unit (``methods/<name>/``) its server side (``strategy.py``) never
  imports client code and its client side (``client.py``) never imports server code; shared layers
  never import ``methods/`` or ``apps/``;
- the maths packages import nothing of Flower;
- no file under ``strategy/`` or ``client/`` defines a default value for a run-config key (no
  ``x.get("<key>", default)``, no parameter named after a key with a literal default).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flwr_sheaf.config import KEYS

PKG = Path(__file__).resolve().parents[1] / "flwr_sheaf"
MATHS = (
    "sheaf",
    "models",
    "data",
    # each method's maths, beside its strategy and client plug-in
    *sorted(str(p.relative_to(PKG).with_suffix("")) for p in (PKG / "methods").glob("*/maths.py")),
    "methods/_shared/prototypes",
    *(
        f"methods/rfedags/{m}"
        for m in ("aggregation", "baselines", "frechet", "local", "manifolds", "pca")
    ),
)


def _imports(path: Path) -> set[str]:
    """Absolute module names imported by ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(PKG.parent).with_suffix("").parts[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg[: len(pkg) - node.level + 1])
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module or "")
    return out


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py")) if (PKG / sub).is_dir() else [PKG / f"{sub}.py"]


def _hits(mods: set[str], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if any(m == f or m.startswith(f + ".") for f in forbidden))


@pytest.mark.parametrize(
    "src, forbidden",
    [
        ("strategy", ("flwr_sheaf.client", "flwr_sheaf.methods", "flwr_sheaf.apps")),
        ("client", ("flwr_sheaf.strategy", "flwr_sheaf.methods", "flwr_sheaf.apps")),
        ("protocol", ("flwr_sheaf.methods", "flwr_sheaf.apps")),
        ("config", ("flwr_sheaf.methods", "flwr_sheaf.apps")),
        ("methods", ("flwr_sheaf.apps",)),
    ],
)
def test_shared_layers_import_no_layer_above_them(src, forbidden):
    bad = {str(f.relative_to(PKG)): _hits(_imports(f), forbidden) for f in _files(src)}
    assert {k: v for k, v in bad.items() if v} == {}


UNITS = sorted(
    d
    for d in (PKG / "methods").iterdir()
    if (d / "__init__.py").is_file() and not d.name.startswith("_")
)


@pytest.mark.parametrize("unit", UNITS, ids=lambda d: d.name)
def test_a_units_server_and_client_sides_never_import_each_other(unit):
    units = [f"flwr_sheaf.methods.{u.name}" for u in UNITS]
    server = [f for f in unit.glob("*.py") if "strategy" in f.stem]
    client = [f for f in unit.glob("*.py") if "client" in f.stem]
    assert server and client
    bad = {
        str(f.relative_to(PKG)): _hits(
            _imports(f), ("flwr_sheaf.client", *(f"{u}.client" for u in units))
        )
        for f in server
    }
    bad.update(
        {
            str(f.relative_to(PKG)): _hits(
                _imports(f),
                (
                    "flwr_sheaf.strategy",
                    *(f"{u}.{s}" for u in units for s in ("strategy", "baselines_strategy")),
                ),
            )
            for f in client
        }
    )
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_walker_sees_relative_imports():
    # oracle for the walker itself: methods/sheaf_frl/client.py imports ...protocol and ...client.handlers
    mods = _imports(PKG / "methods" / "sheaf_frl" / "client.py")
    assert "flwr_sheaf.protocol" in mods and "flwr_sheaf.client.handlers" in mods


@pytest.mark.parametrize("sub", MATHS + ("topology", "paper", "participation"))
def test_maths_layers_import_nothing_of_flower(sub):
    bad = {
        str(f.relative_to(PKG)): sorted(
            m for m in _imports(f) if m == "flwr" or m.startswith("flwr.")
        )
        for f in _files(sub)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def _defaults_of_run_config_keys(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in KEYS
        ):
            found.append(f"{path.name}:{node.lineno} .get({node.args[0].value!r}, ...)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            defaults = (
                [None] * (len(node.args.args) - len(node.args.defaults))
                + list(node.args.defaults)
                + list(node.args.kw_defaults)
            )
            for a, d in zip(args, defaults):
                key = a.arg.replace("_", "-")
                if (
                    (key in KEYS or (key == "lam" and "lambda" in KEYS))
                    and isinstance(d, ast.Constant)
                    and d.value is not None
                ):
                    found.append(f"{path.name}:{node.lineno} {node.name}({a.arg}={d.value!r})")
    return found


def test_no_run_config_default_outside_config_py():
    # a method's maths (pure functions, e.g. a planted problem's ``seed=0``) reads no run config
    maths = {f for sub in MATHS for f in _files(sub)}
    found = [
        x
        for sub in ("strategy", "client", "methods")
        for f in _files(sub)
        if f not in maths
        for x in _defaults_of_run_config_keys(f)
    ]
    assert found == []


def test_the_default_detector_detects(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cfg, seed=0, lam=0.1):\n    return cfg.get('lambda', 0.1)\n")
    assert len(_defaults_of_run_config_keys(probe)) == 3
