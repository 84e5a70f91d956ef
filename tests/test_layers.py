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
import re
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


# --------------------------------------------------- the layer order, import circles, method names
# Layers, lowest first (docs/design.md): a module imports its own layer and those below, never one
# above. Every import counts: module level, inside functions and under ``if TYPE_CHECKING:`` (a
# helper that needs a type from above takes a narrow Protocol of its own instead).
LAYERS = ("maths", "base", "config", "core", "methods", "apps", "tools")
MATHS_TOP = ("sheaf", "models", "data", "topology", "devices", "paper", "integrity")
#: below the run config: the message protocol, error hints, participation draws and
#: the engine/in-process grid helpers (they import nothing of the package but maths)
BASE_TOP = ("protocol", "hints", "participation", "engine", "testing")

#: the method names the core must not contain in code (identifiers and string values): every
#: registered method's name, its unit's folder name, and the words of its class names
METHOD_WORDS = re.compile(
    r"fedproto|fedsaf|fedmuscle|comfed|sheaf[-_ ]?fmtl|rfedags|rfedavg|rfedsvrg|rfedproj"
    r"|non[-_ ]?cooperative|sheaf[-_]?frl",
    re.IGNORECASE,
)

#: Core files that still name methods in code, each with the reason; the test below fails when an
#: entry is no longer needed, so the list only shrinks.
NAMES_METHODS: dict[str, str] = {}

#: Import circles still present, each with the reason (the test fails when one disappears).
CIRCLES: dict[tuple[str, ...], str] = {}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in PKG.rglob("*.py")}


def _all_imports(path: Path, name: str | None = None) -> set[str]:
    """Package modules ``path`` (module ``name``) imports anywhere, ``if TYPE_CHECKING:`` blocks
    included (relative imports resolved; ``from pkg import sub`` counts as ``pkg.sub``)."""
    tree = ast.parse(path.read_text())
    name = name or _module(path)
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES)
    out = set()
    for m in found:
        while m and m not in MODULES:
            m = m.rpartition(".")[0]
        # a module reading its own package's constants (``from . import ACTION`` in a method's
        # unit) is not an edge; the facade ``flwr_sheaf`` (apps layer) always is
        own_package = m == name.rpartition(".")[0] and m != "flwr_sheaf"
        if m and m != name and not own_package:
            out.add(m)
    return out


def _layer(mod: str) -> str:
    if mod == "flwr_sheaf":
        return "apps"  # the facade: re-exports the public names of every layer
    top = mod.split(".")[1]
    if top in MATHS_TOP:
        return "maths"
    if top in BASE_TOP:
        return "base"
    if top == "config":
        return "config"
    if top == "methods":
        return "core" if mod == "flwr_sheaf.methods.registry" else "methods"
    if top in ("apps", "tools"):
        return top
    return "core"


def _graph() -> dict[str, set[str]]:
    return {m: _all_imports(p) for m, p in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in graph.items() for b in bs])
    # each circle once, starting at its smallest module name
    out = set()
    for c in nx.simple_cycles(g):
        i = c.index(min(c))
        out.add(tuple(c[i:] + c[:i]))
    return sorted(out)


def _against_the_order(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
        for a, bs in graph.items()
        for b in bs
        if LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))
    )


def _docstrings(tree: ast.AST) -> set[int]:
    """``id`` of every docstring node of ``tree``: the first statement of a module, class or
    function when it is a string constant (what ``ast.get_docstring`` reads)."""
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and isinstance(node.body[0].value.value, str)
    }


def _names(node: ast.AST) -> list[str]:
    """The identifiers ``node`` itself introduces or uses (not those of its children)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.alias):
        return [node.name] + ([node.asname] if node.asname else [])
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.module else []
    if isinstance(node, (ast.Global, ast.Nonlocal)):
        return list(node.names)
    if isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
        return [node.name] if node.name else []
    if isinstance(node, ast.MatchMapping):
        return [node.rest] if node.rest else []
    return []


def _code_words(path: Path) -> list[str]:
    """Method names in ``path``'s code: identifiers and string values (f-string parts included),
    not docstrings (the first string statement of a module, class or function) or comments: a
    docstring may name a method as an example; code that names one depends on it."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        words = _names(node)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            words.append(node.value)
        if isinstance(node, ast.Constant) and isinstance(node.value, bytes):
            words.append(node.value.decode("utf-8", "replace"))
        line = getattr(node, "lineno", 0)
        hits += [(line, w) for text in words for w in METHOD_WORDS.findall(text)]
    return [f"{path.name}:{line} {w}" for line, w in sorted(hits)]


def _core_files() -> list[Path]:
    return sorted(p for m, p in MODULES.items() if m != "flwr_sheaf" and _layer(m) == "core")


def test_no_import_circle():
    assert {c: CIRCLES.get(c, "not listed") for c in _circles(_graph())} == CIRCLES


def test_no_import_against_the_layer_order():
    assert _against_the_order(_graph()) == []


def test_the_core_imports_no_method():
    bad = {
        m: sorted(b for b in bs if _layer(b) == "methods")
        for m, bs in _graph().items()
        if _layer(m) == "core"
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_the_core_names_no_method_in_code():
    found = {str(p.relative_to(PKG)): _code_words(p) for p in _core_files()}
    found = {k: v for k, v in found.items() if v}
    assert sorted(set(found) - set(NAMES_METHODS)) == [], found
    assert sorted(set(NAMES_METHODS) - set(found)) == []  # an entry no longer needed: remove it


def test_the_layer_checks_catch_a_planted_violation(tmp_path):
    """Oracle for the checks themselves: a circle, an upward import and a method name, planted."""
    graph = _graph()
    graph["flwr_sheaf.topology"] = graph["flwr_sheaf.topology"] | {"flwr_sheaf.config"}
    graph["flwr_sheaf.config"] = graph["flwr_sheaf.config"] | {"flwr_sheaf.topology"}
    graph["flwr_sheaf.protocol"] = graph["flwr_sheaf.protocol"] | {"flwr_sheaf.methods.fedproto"}
    assert ("flwr_sheaf.config", "flwr_sheaf.topology") in _circles(graph)
    assert "flwr_sheaf.topology (maths) imports flwr_sheaf.config (config)" in _against_the_order(
        graph
    )
    assert any("flwr_sheaf.methods.fedproto (methods)" in v for v in _against_the_order(graph))
    probe = tmp_path / "probe.py"
    probe.write_text('"""FedProto in a docstring is fine."""\n\nSTEP = "fedproto-lambda"  # ok\n')
    assert _code_words(probe) == ["probe.py:3 fedproto"]
    lazy = tmp_path / "lazy.py"
    lazy.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flwr_sheaf import apps\n"
        "def f():\n    from flwr_sheaf.methods import fedproto\n"
    )
    assert _all_imports(lazy, "flwr_sheaf.lazy") == {
        "flwr_sheaf",  # the facade, under TYPE_CHECKING: it counts
        "flwr_sheaf.apps",
        "flwr_sheaf.methods",
        "flwr_sheaf.methods.fedproto",
    }


def test_only_real_docstrings_are_skipped(tmp_path):
    """Oracle for the name check: a string at the start of a continuation line (an argument, a
    parenthesised help text, an f-string) is code; a module's, class's or function's first string
    statement is its docstring and is skipped, as are comments."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Module docstring: FedProto."""\n'
        "\n"
        "\n"
        "class C:\n"
        '    """Class docstring: ComFed."""\n'
        "\n"
        "    def f(self, x):\n"
        '        """Function docstring: RFedAGS."""\n'
        "        return g(\n"
        '            "sheaf-frl",  # comment: fedsaf\n'
        "            x,\n"
        "        )\n"
        "\n"
        "\n"
        "HELP = (\n"
        '    "a help text naming "\n'
        '    "FedProto\'s own settings"\n'
        ")\n"
        'MSG = f"{HELP}: use "\n'
        "(\n"
        '    "fedmuscle"\n'
        ")\n"
    )
    assert _code_words(probe) == [
        "probe.py:10 sheaf-frl",
        "probe.py:16 FedProto",
        "probe.py:21 fedmuscle",
    ]


def test_names_bound_by_except_and_match_and_bytes_are_code(tmp_path):
    """Oracle: the names an ``except ... as`` or a ``match`` pattern binds, and bytes literals, are
    code too (the tokenizer-based check before the ``ast`` one saw them)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "try:\n"
        "    pass\n"
        "except ValueError as fedproto:\n"
        "    pass\n"
        "match {}:\n"
        '    case {"k": comfed, **fedsaf}:\n'
        "        pass\n"
        "    case [*rfedags]:\n"
        "        pass\n"
        'X = b"sheaf-fmtl"\n'
    )
    assert _code_words(probe) == [
        "probe.py:3 fedproto",
        "probe.py:6 comfed",
        "probe.py:6 fedsaf",
        "probe.py:8 rfedags",
        "probe.py:10 sheaf-fmtl",
    ]


# --------------------------------------------------- the core protocol holds the core's vocabulary
def _protocol_names_used(path: Path, name: str | None = None) -> set[str]:
    """Names of ``flwr_sheaf.protocol`` that ``path`` (module ``name``) uses: imported from it
    (``from flwr_sheaf.protocol import X``, relative forms too) or read as an attribute of it
    (``import flwr_sheaf.protocol as P; P.X``, ``from flwr_sheaf import protocol; protocol.X``)."""
    tree = ast.parse(path.read_text())
    name = name or _module(path)
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    used, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "flwr_sheaf.protocol" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            base = (
                ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                if node.level
                else node.module or ""
            )
            for a in node.names:
                if base == "flwr_sheaf.protocol":
                    used.add(a.name)
                elif base == "flwr_sheaf" and a.name == "protocol":
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            used.add(node.attr)
    return used


def test_every_public_name_of_the_core_protocol_is_used_by_the_core():
    """``flwr_sheaf/protocol.py`` holds the core's message vocabulary: a name of its ``__all__`` that
    no module outside ``methods/`` uses (only methods, tests or docs) belongs to the method's unit
    (``methods/<name>/``) or, when several methods use it, to ``methods/_shared/``."""
    from flwr_sheaf import protocol

    core = [
        (m, p)
        for m, p in MODULES.items()
        if _layer(m) != "methods" and m not in ("flwr_sheaf", "flwr_sheaf.protocol")
    ]
    used = set().union(*(_protocol_names_used(p, m) for m, p in core))
    assert sorted(set(protocol.__all__) - used) == []


def test_the_protocol_use_detector_detects(tmp_path):
    """Oracle for the check above: absolute, relative and attribute uses are seen, other modules not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import flwr_sheaf.protocol as P\n"
        "from flwr_sheaf import protocol\n"
        "from ..protocol import CONFIG, METRICS as M\n"
        "from flwr_sheaf.protocol import SEED\n"
        "from ..config import KEYS\n"
        "x = P.TRAIN, protocol.QUERY, KEYS.POINT\n"
    )
    assert _protocol_names_used(probe, "flwr_sheaf.strategy.probe") == {
        "CONFIG",
        "METRICS",
        "SEED",
        "TRAIN",
        "QUERY",
    }
