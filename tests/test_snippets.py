"""Every fenced code block of README.md, docs/, notes/, benchmarks/records/ and examples/**/README.md is checked, so a
changed API, script, flag or run-config key breaks this test, not a reader.

What each block gets (by its fence's language):

- ``python``: compiled; its import statements executed (every imported name must exist); every
  call whose callee resolves to a ``flwr_sheaf`` or ``flwr`` object (a name imported from there, an
  attribute of one, or a method of an instance made by one, of a parameter annotated with one, or
  of a loop over such instances) is bound against the real signature with
  ``inspect.signature(callee).bind(...)``, so a renamed or removed keyword fails. A block marked
  ``<!-- snippet: run -->`` (the line before its fence) is also executed in-process (tiny
  settings only: the in-process ``LocalGrid``, a few nodes, one or two rounds), in a temporary
  working directory, with ``examples/dropin_app`` importable.
- ``bash`` / ``sh`` / ``shell`` / ``console``: each simple command is checked: ``cd`` targets
  exist; ``python X.py`` / ``bash X.sh`` scripts exist (relative to the block's working
  directory); each ``--flag`` exists in the script (argparse option strings parsed from its
  source, or the literal in its source); ``python -m M`` modules import; ``python -c`` and
  heredoc (``python - <<'PY'``) code is checked as a python block; run-config overrides
  (``simulations/inprocess.py key=value``, ``--run-config "k=v ..."``, ``--extra k=v``,
  ``scripts/main.sh "k=v"``) are typed and validated by the app's own parser
  (``flwr_sheaf.config.RunConfig.from_run_config``: unknown keys and bad values fail); ``flwr``
  and ``flower-*`` flags are checked against their ``--help``, ``ray <command>`` flags against
  Ray's own CLI (``ray start --num-gpus``: the command must exist, and each flag in it); ``flwr run <app>`` needs an app
  directory, and ``--run-config`` keys of another app (``examples/dropin_app``) must be in its
  ``pyproject.toml``. Values holding shell variables or ``<placeholders>`` are not checked.
- ``toml``: parsed. ``text``: output or a file listing, not code (counted).
- A fence without a language fails (say ``bash``, ``python``, ``toml`` or ``text``).

A block opts out only with ``<!-- snippet: skip (reason) -->`` on the line before its fence; the
reason is required and the skips are counted (``python tests/test_snippets.py`` prints the
inventory). Each failure names the file and the line of the block's opening fence.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys
import tomllib
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DROPIN = ROOT / "examples" / "dropin_app"


def doc_files() -> list[Path]:
    """README.md, docs/**/*.md, notes/*.md (implementation notes), benchmarks/records/**/*.md
    (measurement logs) and examples/**/README.md (sorted)."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "notes").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "records").rglob("*.md")),
        *sorted((ROOT / "examples").glob("**/README.md")),
    ]


# ---------------------------------------------------------------------------------------- blocks

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*snippet:\s*(?P<kind>skip|run)\b\s*(?:\((?P<reason>.*)\))?\s*-->")
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
TEXT = {"text", "txt", "output"}
TOML = {"toml"}


@dataclass
class Block:
    """One fenced block: its file, the 1-based line of its opening fence, language, code, marker."""

    path: Path
    line: int
    lang: str
    code: str
    marker: str = ""  # "", "skip" or "run"
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path}:{self.line}"


def parse_blocks(path: Path, text: str | None = None) -> list[Block]:
    """Fenced blocks of a markdown file (indented fences inside list items are dedented).

    Raises:
        ValueError: a fence that is never closed (named by file and line).
    """
    lines = (path.read_text() if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]
        ):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        if i == len(lines):
            raise ValueError(f"{path}:{start + 1}: code fence never closed")
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mk = MARKER.search(prev)
        out.append(
            Block(
                path,
                start + 1,
                lang,
                "\n".join(body) + "\n",
                mk["kind"] if mk else "",
                (mk["reason"] or "").strip() if mk else "",
            )
        )
    return out


def all_blocks() -> list[Block]:
    return [b for p in doc_files() for b in parse_blocks(p)]


# ------------------------------------------------------------------------------ python checking


@dataclass
class PyReport:
    """What checking one python source found: problems, and how many calls were bound."""

    problems: list[str] = field(default_factory=list)
    bound: int = 0


class _Unknown:
    """A value the static walk cannot resolve."""


UNKNOWN = _Unknown()
TRACKED = ("flwr_sheaf", "flwr")


def _tracked(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    if inspect.ismodule(obj):
        mod = obj.__name__
    return any(mod == t or mod.startswith(t + ".") for t in TRACKED)


def _signature(callee: Any, instance_method: bool) -> inspect.Signature | None:
    try:
        sig = inspect.signature(callee)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[-1].kind is params[-1].VAR_KEYWORD:  # `**kw: Unpack[TypedDict]` (PEP 692)
        try:
            fn = callee.__init__ if inspect.isclass(callee) else callee
            hint = typing.get_type_hints(fn, include_extras=True).get(params[-1].name)
        except Exception:  # annotations that do not resolve at run time: keep `**kw` as it is
            hint = None
        if typing.get_origin(hint) is typing.Unpack:  # its keys are the only keywords accepted
            keys = typing.get_args(hint)[0].__annotations__
            kw_only = [
                inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in keys
            ]
            sig = sig.replace(parameters=params[:-1] + kw_only)
    if instance_method:  # a function looked up on a class, called on an instance: drop `self`
        params = list(sig.parameters.values())
        if params and params[0].kind in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            sig = sig.replace(parameters=params[1:])
    return sig


class _Binder(ast.NodeVisitor):
    """Resolve callees to flwr_sheaf/flwr objects and bind each call against its signature."""

    def __init__(self, ns: dict[str, Any], label: str) -> None:
        self.ns = ns  # name -> object (imported) ; instances as ("instance", [classes])
        self.label = label
        self.report = PyReport()

    # -- resolution
    def resolve(self, node: ast.AST) -> Any:
        """An object, ("instance", [classes]) or UNKNOWN."""
        if isinstance(node, ast.Name):
            return self.ns.get(node.id, UNKNOWN)
        if isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted in self.ns:
                return self.ns[dotted]
            base = self.resolve(node.value)
            if base is UNKNOWN:
                return UNKNOWN
            if isinstance(base, tuple):  # attribute of an instance: a method or an attribute
                found = []
                for cls in base[1]:
                    try:
                        found.append((cls, inspect.getattr_static(cls, node.attr)))
                    except AttributeError:
                        pass
                return ("attr", node.attr, found) if found else UNKNOWN
            if not _tracked(base):
                return UNKNOWN
            try:
                return getattr(base, node.attr)
            except AttributeError:
                self.report.problems.append(
                    f"{self.label}: line {node.lineno}: {ast.unparse(node)}: "
                    f"{getattr(base, '__name__', base)!s} has no attribute {node.attr!r}"
                )
                return UNKNOWN
        if isinstance(node, ast.Call):
            callee = self.resolve(node.func)
            if inspect.isclass(callee) and _tracked(callee):
                return ("instance", [callee])
            return UNKNOWN
        if isinstance(node, (ast.Tuple, ast.List)):
            classes = []
            for elt in node.elts:
                v = self.resolve(elt)
                if not (isinstance(v, tuple) and v[0] == "instance"):
                    return UNKNOWN
                classes += v[1]
            return ("elements", classes)
        return UNKNOWN

    # -- binding
    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        callee = self.resolve(node.func)
        targets: list[tuple[Any, bool, str]] = []  # (callable, drop self, name)
        if isinstance(callee, tuple) and callee[0] == "attr":
            for cls, static in callee[2]:
                if isinstance(static, staticmethod):
                    targets.append((static.__func__, False, f"{cls.__name__}.{callee[1]}"))
                elif isinstance(static, classmethod):
                    targets.append((getattr(cls, callee[1]), False, f"{cls.__name__}.{callee[1]}"))
                elif inspect.isfunction(static):
                    targets.append((static, True, f"{cls.__name__}.{callee[1]}"))
        elif (
            callee is not UNKNOWN
            and not isinstance(callee, tuple)
            and callable(callee)
            and _tracked(callee)
        ):
            targets.append((callee, False, getattr(callee, "__qualname__", ast.unparse(node.func))))
        for fn, drop_self, name in targets:
            sig = _signature(fn, drop_self)
            if sig is None:
                continue
            problem = _bind(sig, node)
            self.report.bound += 1
            if problem:
                self.report.problems.append(
                    f"{self.label}: line {node.lineno}: {ast.unparse(node)[:120]}: "
                    f"does not match {name}{sig}: {problem}"
                )

    # -- what names hold
    def visit_Assign(self, node: ast.Assign) -> None:
        self.generic_visit(node)
        value = self.resolve(node.value)
        for t in node.targets:
            key = _dotted(t)
            if key and value is not UNKNOWN:
                self.ns[key] = value

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.generic_visit(node)
        ann = self.resolve(node.annotation)
        key = _dotted(node.target)
        if key and inspect.isclass(ann) and _tracked(ann):
            self.ns[key] = ("instance", [ann])

    def visit_For(self, node: ast.For) -> None:
        it = self.resolve(node.iter)
        key = _dotted(node.target)
        if key and isinstance(it, tuple) and it[0] == "elements":
            self.ns[key] = ("instance", it[1])
        self.generic_visit(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for d in node.decorator_list:
            self.visit(d)
        for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
            if a.annotation is not None:
                ann = self.resolve(a.annotation)
                if inspect.isclass(ann) and _tracked(ann):
                    self.ns[a.arg] = ("instance", [ann])
        for stmt in node.body:
            self.visit(stmt)

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _bind(sig: inspect.Signature, call: ast.Call) -> str:
    """'' when ``call``'s arguments fit ``sig``, else the binding error."""
    starred = any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    )
    names = [k.arg for k in call.keywords if k.arg is not None]
    params = sig.parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        bad = [
            n
            for n in names
            if n not in params or params[n].kind == inspect.Parameter.POSITIONAL_ONLY
        ]
        if bad:
            return f"unexpected keyword argument(s) {', '.join(map(repr, bad))}"
    if not starred:
        try:
            sig.bind(*[object()] * len(call.args), **{n: object() for n in names})
        except TypeError as e:
            return str(e)
        return ""
    return ""  # *args / **kwargs at the call site: only the explicit keywords were checked


@contextlib.contextmanager
def _dropin_importable():
    """``examples/dropin_app`` on sys.path (what ``pip install -e examples/dropin_app`` gives)."""
    sys.path.insert(0, str(DROPIN))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(DROPIN))


def check_python(code: str, label: str) -> PyReport:
    """Compile ``code``, run its imports, bind every flwr_sheaf/flwr call against its signature."""
    report = PyReport()
    try:
        tree = ast.parse(code, filename=label)
        compile(tree, label, "exec")
    except SyntaxError as e:
        report.problems.append(f"{label}: line {e.lineno}: does not compile: {e.msg}")
        return report
    ns: dict[str, Any] = {}
    extra = [  # sys.path.insert(0, "scripts") / .append("x") with a literal: honoured for the imports
        str(ROOT / n.args[-1].value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and _dotted(n.func) in ("sys.path.insert", "sys.path.append")
        and n.args
        and isinstance(n.args[-1], ast.Constant)
        and isinstance(n.args[-1].value, str)
    ]
    sys.path[:0] = extra
    try:
        _check_imports(tree, label, ns, report)
    finally:
        for e in extra:
            sys.path.remove(e)
    binder = _Binder(ns, label)
    binder.visit(tree)
    report.problems += binder.report.problems
    report.bound = binder.report.bound
    return report


def _check_imports(tree: ast.Module, label: str, ns: dict[str, Any], report: PyReport) -> None:
    """Execute each import statement of ``tree`` (names land in ``ns``; failures in ``report``)."""
    with _dropin_importable():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                scratch: dict[str, Any] = {}
                try:
                    exec(compile(ast.Module([node], []), label, "exec"), scratch)
                except Exception as e:  # noqa: BLE001 - reported, named
                    report.problems.append(
                        f"{label}: line {node.lineno}: {ast.unparse(node)}: {type(e).__name__}: {e}"
                    )
                    continue
                scratch.pop("__builtins__", None)
                ns.update(scratch)


def run_python(code: str, label: str, workdir: Path) -> list[str]:
    """Execute ``code`` in a fresh namespace, in ``workdir``; problems (traceback tail) if it raises."""
    old = Path.cwd()
    os.chdir(workdir)
    out = io.StringIO()
    try:
        with _dropin_importable(), contextlib.redirect_stdout(out):
            exec(
                compile(code, label, "exec"),
                {"__name__": "__main__", "__builtins__": builtins},  # as `python file.py` runs it
            )
    except Exception as e:  # noqa: BLE001 - reported with file and line
        import traceback

        tb = "".join(traceback.format_exception(e)[-4:])
        return [f"{label}: raised {type(e).__name__}: {e}\n{tb}"]
    finally:
        os.chdir(old)
    if not out.getvalue().strip():  # a run block shows its reader a result
        return [f"{label}: ran but printed nothing (its main part did not run?)"]
    return []


# ------------------------------------------------------------------------------- shell checking

PY_EXE = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
PREFIXES = {"nice", "time", "timeout", "env", "exec", "do", "then", "else", "!"}
SEPARATORS = {";", "&&", "||", "|", "&", "\n", "(", ")", ";;", "|&"}
REDIRECT = re.compile(r"^\d*(>>?|<<?|>&|&>)")
OVERRIDE_FLAGS = {"--run-config", "--extra"}
#: scripts whose positional ``key=value`` arguments (or first argument) are run-config overrides
OVERRIDE_SCRIPTS = {"simulations/inprocess.py": "positional", "scripts/main.sh": "first"}


@functools.cache
def _script_flags(path: Path) -> frozenset[str]:
    """Option strings of a python script (argparse ``add_argument`` literals, also in sibling
    modules it imports) plus every ``--literal`` in its source (scripts reading ``sys.argv``)."""
    flags: set[str] = set()
    src = path.read_text()
    flags |= set(re.findall(r"""["'](--[A-Za-z0-9][\w-]*)["']""", src))
    if path.suffix == ".py":
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                sib = path.parent / (node.module.replace(".", "/") + ".py")
                if sib.exists() and sib != path:
                    flags |= _script_flags(sib)
    else:  # shell: --flags it handles in a case or passes on
        flags |= set(re.findall(r"(--[A-Za-z0-9][\w-]*)", src))
    return frozenset(flags)


@functools.cache
def _flwr_commands() -> Any:
    """Flower's ``flwr`` CLI as a click command tree (typer builds it; nothing is run)."""
    import typer
    from flwr.cli.app import app

    return typer.main.get_command(app)


@functools.cache
def _module_flags(module: str, depth: int = 2) -> frozenset[str]:
    """``--literals`` in an installed module's source and (``depth``) in the modules it imports from
    the same top-level package (where argparse helpers live)."""
    spec = importlib.util.find_spec(module)
    if not spec or not spec.origin or not spec.origin.endswith(".py"):
        return frozenset()
    src = Path(spec.origin).read_text()
    flags = set(re.findall(r"""["'](--[A-Za-z0-9][\w-]*)["']""", src))
    if depth:
        top = module.split(".")[0]
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.ImportFrom):
                continue
            pkg = module if spec.submodule_search_locations else module.rpartition(".")[0]
            name = "." * node.level + (node.module or "") if node.level else node.module or ""
            with contextlib.suppress(ImportError, ValueError):
                target = importlib.util.resolve_name(name, pkg) if node.level else name
                if target.split(".")[0] == top and target != module:
                    flags |= _module_flags(target, depth - 1)
    return frozenset(flags)


@functools.cache
def _ray_flags(command: str) -> frozenset[str] | None:
    """Options of ``ray <command>`` from Ray's click CLI (``ray.scripts.scripts.cli``); None when
    Ray has no such command."""
    from ray.scripts.scripts import cli

    cmd = cli.commands.get(command)
    if cmd is None:
        return None
    return frozenset(
        o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("--")
    ) | {"--help"}


@functools.cache
def _help_flags(argv: tuple[str, ...]) -> frozenset[str] | None:
    """Options of a Flower command: ``("flwr", "run")`` from the ``flwr`` CLI's click tree,
    ``("flower-superlink",)`` from its entry point module's argparse literals; None when unknown."""
    if argv[0] == "flwr":
        cmd = _flwr_commands()
        for name in argv[1:]:
            sub = getattr(cmd, "commands", {}).get(name)
            if sub is None:
                return None
            cmd = sub
        if getattr(cmd, "commands", None):  # a group: its own options only
            pass
        return frozenset(
            o for p in cmd.params for o in [*p.opts, *p.secondary_opts] if o.startswith("--")
        ) | {"--help"}
    import importlib.metadata as md

    for ep in md.entry_points(group="console_scripts", name=argv[0]):
        flags = _module_flags(ep.module)
        return flags | {"--help"} if flags else None
    return None


@functools.cache
def _parse_overrides():
    """``simulations/inprocess.py``'s ``parse_overrides`` (types values as ``flwr run`` does and
    validates them with ``RunConfig.from_run_config``)."""
    spec = importlib.util.spec_from_file_location(
        "_snippet_inprocess", ROOT / "simulations" / "inprocess.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_overrides


@functools.cache
def _app_keys(app: Path) -> frozenset[str] | None:
    try:
        cfg = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return None
    return frozenset(cfg.get("config", {}))


def _placeholder(tok: str) -> bool:
    return "$" in tok or "<" in tok or "`" in tok


def check_overrides(items: list[str], where: str, app: Path = ROOT) -> list[str]:
    """Run-config overrides ``k=v`` (tokens with shell variables or placeholders are left out)."""
    items = [i for i in items if i and not _placeholder(i)]
    if not items:
        return []
    if app.resolve() != ROOT:
        keys = _app_keys(app)
        if keys is None:
            return [f"{where}: {app} has no [tool.flwr.app] in pyproject.toml"]
        bad = [i for i in items if i.partition("=")[0] not in keys]
        return (
            [f"{where}: run-config key(s) {bad} not in {app.relative_to(ROOT)}/pyproject.toml"]
            if bad
            else []
        )
    try:
        _parse_overrides()(items)
    except ValueError as e:
        return [f"{where}: run-config {' '.join(items)!r}: {e}"]
    return []


def _split_overrides(value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError:
        return value.split()


def _logical_lines(code: str) -> list[tuple[str, list[str]]]:
    """(command line, heredoc body lines) with ``\\`` continuations joined; console prompts kept
    only (``$ cmd``) when the block has any."""
    lines = code.splitlines()
    if any(x.startswith("$ ") for x in lines):
        lines = [x[2:] for x in lines if x.startswith("$ ")]
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(lines):
        cur = lines[i]
        while cur.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            cur = cur.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        body: list[str] = []
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", cur)
        if m:
            while i < len(lines) and lines[i].strip() != m.group(1):
                body.append(lines[i])
                i += 1
            i += 1
        out.append((cur, body))
    return out


def _commands(line: str) -> list[list[str]]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        toks = list(lex)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        toks = line.split("#", 1)[0].split()
    cmds, cur = [], []
    skip_next = False
    for t in toks:
        if skip_next:
            skip_next = False
            continue
        if t in SEPARATORS:
            if cur:
                cmds.append(cur)
            cur = []
        elif t in {">", ">>", "<", "<<", "<&", ">&", "&>", ">|"} or REDIRECT.match(t):
            skip_next = not re.match(r"^\d*(>>?|<<?)&?\S+$", t) or t in {">", ">>", "<", "<<"}
            # `2>&1` glued: nothing follows; `> file`: skip the file
            if re.match(r"^\d*>&\d$", t):
                skip_next = False
        else:
            cur.append(t)
    if cur:
        cmds.append(cur)
    return cmds


@dataclass
class ShellReport:
    problems: list[str] = field(default_factory=list)
    commands: int = 0  # commands checked (ours: scripts, python, flwr)
    python: list[tuple[str, str]] = field(default_factory=list)  # (label, code) of -c / heredocs


def block_cwd(path: Path) -> Path:
    """Where a doc's commands run: an example app's README (a folder with a ``pyproject.toml``
    under examples/) from its folder, every other doc from the repository root."""
    d = path.resolve().parent
    if d.is_relative_to(ROOT / "examples") and (d / "pyproject.toml").exists():
        return d
    return ROOT


def check_shell(code: str, label: str, cwd: Path = ROOT) -> ShellReport:
    """Check every command of a shell block (see the module docstring); ``cwd``: where it starts."""
    rep = ShellReport()
    for line, heredoc in _logical_lines(code):
        for cmd in _commands(line):
            # strip prefixes: env assignments, nice -n N, timeout N, time
            while cmd:
                if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
                    cmd = cmd[1:]
                elif cmd[0] in PREFIXES:
                    head = cmd.pop(0)
                    if head == "nice" and cmd[:1] == ["-n"]:
                        cmd = cmd[2:]
                    elif head == "timeout" and cmd and re.match(r"^\d", cmd[0]):
                        cmd = cmd[1:]
                else:
                    break
            if not cmd or cmd[0] in {"for", "if", "while", "done", "fi", "esac", "case", "export"}:
                continue
            where = f"{label}: `{' '.join(cmd)[:100]}`"
            exe = cmd[0]
            if exe == "cd":
                target = cmd[1] if len(cmd) > 1 else ""
                if not target or _placeholder(target):
                    cwd = ROOT  # `cd <worktree>`: the repository root
                elif not (cwd / target).is_dir():
                    rep.problems.append(
                        f"{where}: no directory {target!r} (from {cwd.relative_to(ROOT) or '.'})"
                    )
                else:
                    cwd = (cwd / target).resolve()
                continue
            if PY_EXE.match(exe):
                rep.commands += 1
                _check_python_cmd(cmd, cwd, where, heredoc, rep)
            elif exe in {"bash", "sh"}:
                rep.commands += 1
                _check_script(cmd[1:], cwd, where, rep)
            elif exe == "flwr":
                rep.commands += 1
                _check_flwr(cmd, cwd, where, rep)
            elif exe == "ray" and len(cmd) > 1 and not cmd[1].startswith("-"):
                rep.commands += 1
                known = _ray_flags(cmd[1])
                if known is None:
                    rep.problems.append(f"{where}: ray has no command {cmd[1]!r}")
                _check_flags(cmd[2:], known, where, f"ray {cmd[1]}", rep)
            elif exe.startswith("flower-"):
                rep.commands += 1
                _check_flags(cmd[1:], _help_flags((exe,)), where, exe, rep)
            elif exe == "jupyter" and len(cmd) > 1:
                rep.commands += 1
                for t in cmd[2:]:
                    if t.endswith(".ipynb") and not (cwd / t).exists():
                        rep.problems.append(
                            f"{where}: no notebook {t!r} (from {cwd.relative_to(ROOT) or '.'})"
                        )
    return rep


def _check_flags(
    args: list[str], known: frozenset[str] | None, where: str, what: str, rep: ShellReport
) -> None:
    if known is None:
        return
    for t in args:
        flag = t.strip("[]").split("=", 1)[0]
        if flag.startswith("--") and len(flag) > 2 and not _placeholder(flag) and flag not in known:
            rep.problems.append(f"{where}: {what} has no option {flag}")


def _overrides_after_flags(args: list[str], where: str, rep: ShellReport, app: Path = ROOT) -> None:
    i = 0
    while i < len(args):
        flag = args[i].split("=", 1)[0]
        if flag in OVERRIDE_FLAGS:
            vals = []
            if "=" in args[i] and args[i].startswith(flag + "="):
                vals = _split_overrides(args[i].split("=", 1)[1])
                i += 1
            elif flag == "--run-config":
                vals = _split_overrides(args[i + 1]) if i + 1 < len(args) else []
                i += 2
            else:  # --extra k=v k=v ... (nargs="*")
                i += 1
                while i < len(args) and not args[i].startswith("-"):
                    vals += _split_overrides(args[i])
                    i += 1
            rep.problems += check_overrides(vals, where, app)
        else:
            i += 1


def _check_script(args: list[str], cwd: Path, where: str, rep: ShellReport) -> None:
    if not args or args[0].startswith("-"):
        return
    script = args[0]
    if _placeholder(script):
        return
    path = (cwd / script).resolve()
    if not path.is_file():
        rep.problems.append(f"{where}: no script {script!r} (from {cwd.relative_to(ROOT) or '.'})")
        return
    rest = args[1:]
    _check_flags(rest, _script_flags(path), where, script, rep)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else ""
    mode = OVERRIDE_SCRIPTS.get(rel)
    if mode == "positional":
        rep.problems += check_overrides(
            [t for t in rest if "=" in t and not t.startswith("-")], where
        )
    elif mode == "first" and rest and not rest[0].startswith("-"):
        rep.problems += check_overrides(_split_overrides(rest[0]), where)
    app = ROOT  # run_flwr.py --app DIR: the keys are that app's (its pyproject.toml)
    if "--app" in rest and rest.index("--app") + 1 < len(rest):
        app = (cwd / rest[rest.index("--app") + 1]).resolve()
    _overrides_after_flags(rest, where, rep, app)


def _check_python_cmd(
    cmd: list[str], cwd: Path, where: str, heredoc: list[str], rep: ShellReport
) -> None:
    args = cmd[1:]
    while args and args[0] in {"-u", "-B", "-O", "-X"}:
        args = args[1:]
    if not args:
        return
    if args[0] == "-m" and len(args) > 1:
        mod = args[1]
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            rep.problems.append(f"{where}: no module {mod!r}")
        elif mod.startswith("flwr_sheaf"):
            spec = importlib.util.find_spec(mod)
            if spec and spec.origin:
                _check_flags(args[2:], _script_flags(Path(spec.origin)), where, mod, rep)
        return
    if args[0] == "-c" and len(args) > 1:
        rep.python.append((where, args[1]))
        return
    if args[0] == "-":
        if heredoc:
            rep.python.append((where, "\n".join(heredoc) + "\n"))
        return
    _check_script(args, cwd, where, rep)


def _flwr_words(cmd: list[str]) -> list[str]:
    """The (at most two) subcommand words after ``flwr`` in ``cmd`` (``flwr supernode ls ...``)."""
    sub: list[str] = []
    for t in cmd[1:]:
        if re.match(r"^[a-z][a-z-]*$", t) and len(sub) < 2:
            sub.append(t)
        else:
            break
    return sub


def _check_flwr(cmd: list[str], cwd: Path, where: str, rep: ShellReport) -> None:
    sub = _flwr_words(cmd)
    # `flwr supernode ls deploy`: take the longest prefix that is a command
    known = None
    while sub:
        known = _help_flags(("flwr", *sub))
        if known:
            break
        sub.pop()
    rest = cmd[1 + len(sub) :]
    _check_flags(rest, known, where, "flwr " + " ".join(sub), rep)
    app = ROOT
    if sub == ["run"]:
        target = rest[0] if rest and not rest[0].startswith("-") else "."
        if not _placeholder(target):
            app = (cwd / target).resolve()
            if _app_keys(app) is None:
                rep.problems.append(
                    f"{where}: {target!r} is not a Flower app directory (from {cwd.relative_to(ROOT) or '.'})"
                )
                return
    _overrides_after_flags(rest, where, rep, app)


# ------------------------------------------------------------------------------------ the tests


@dataclass
class Outcome:
    kind: str  # executed / bound / shell / toml / text / skipped
    problems: list[str]
    bound: int = 0


def check_block(block: Block, workdir: Path | None = None) -> Outcome:
    """Check one block; ``workdir`` is where a ``run`` block executes (default: a temp dir)."""
    label = block.where
    if block.marker == "skip":
        if not block.reason:
            return Outcome(
                "skipped",
                [f"{label}: `snippet: skip` needs a reason: `<!-- snippet: skip (why) -->`"],
            )
        return Outcome("skipped", [])
    if block.lang in PYTHON:
        rep = check_python(block.code, label)
        if block.marker == "run" and not rep.problems:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                probs = run_python(block.code, label, Path(workdir or tmp))
            return Outcome("executed", probs, rep.bound)
        return Outcome("bound", rep.problems, rep.bound)
    if block.lang in SHELL:
        srep = check_shell(block.code, label, block_cwd(block.path))
        probs = list(srep.problems)
        bound = 0
        for sub_label, code in srep.python:
            prep = check_python(code, sub_label)
            probs += prep.problems
            bound += prep.bound
        return Outcome("shell", probs, bound)
    if block.lang in TOML:
        try:
            tomllib.loads(block.code)
        except tomllib.TOMLDecodeError as e:
            return Outcome("toml", [f"{label}: not TOML: {e}"])
        return Outcome("toml", [])
    if block.lang in TEXT:
        return Outcome("text", [])
    return Outcome(
        "unknown",
        [
            f"{label}: fence language {block.lang!r}: use bash, python, toml or text (or mark it skip)"
        ],
    )


def _prefetch_help() -> None:
    """Look up the Flower command options the blocks need (once per command)."""
    wanted: set[tuple[str, ...]] = set()
    for b in all_blocks():
        if b.lang not in SHELL or b.marker == "skip":
            continue
        for line, _ in _logical_lines(b.code):
            for cmd in _commands(line):
                cmd = [t for t in cmd if not re.match(r"^[A-Za-z_]\w*=", t)]
                if cmd and cmd[0].startswith("flower-"):
                    wanted.add((cmd[0],))
                if cmd and cmd[0] == "flwr":
                    sub = _flwr_words(cmd)
                    for k in range(1, len(sub) + 1):
                        wanted.add(("flwr", *sub[:k]))
    for argv in sorted(wanted):
        _help_flags(argv)


BLOCKS = all_blocks()


@pytest.fixture(scope="module", autouse=True)
def _help_cache():
    _prefetch_help()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_code_block(block: Block, tmp_path):
    out = check_block(block, tmp_path)
    assert not out.problems, "\n".join(out.problems)


def test_inventory_every_file_has_its_blocks_and_skips_are_rare():
    kinds = Counter(check_kind(b) for b in BLOCKS)
    assert kinds["executed"] >= 1, "at least the README's own-app snippet is executed"
    assert kinds["skipped"] <= max(2, len(BLOCKS) // 20), f"too many skipped blocks: {kinds}"
    for b in BLOCKS:
        if b.marker == "skip":
            assert b.reason, f"{b.where}: skip without a reason"


def check_kind(b: Block) -> str:
    if b.marker == "skip":
        return "skipped"
    if b.lang in PYTHON:
        return "executed" if b.marker == "run" else "bound"
    return {
        **dict.fromkeys(SHELL, "shell"),
        **dict.fromkeys(TOML, "toml"),
        **dict.fromkeys(TEXT, "text"),
    }.get(b.lang, "unknown")


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_images_resolve(doc: Path):
    """A moved page or a missing figure breaks a link: every relative link target exists."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # links in code are not links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor in inline code spans
    missing = [
        target
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
        if not re.match(r"^[a-z]+:", target) and not (doc.parent / target).exists()
    ]
    assert not missing, f"{doc.relative_to(ROOT)}: links to missing files {missing}"


def test_readme_is_an_entry_page_and_ci_runs_its_test_command():
    """At most 12 KB; the own-app section linked from the first lines; every method of the
    registry in its table; .ci/run calls the README's test command."""
    from flwr_sheaf import METHODS

    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_000, len(text.encode())
    head = "\n".join(text.splitlines()[:5])
    assert "(#use-it-in-your-own-flower-app)" in head and "## Use it in your own Flower app" in text
    table = text.split("## About this baseline", 1)[1].split("\n## ", 1)[0]
    shipped = {  # the package's own methods (a test may have registered a researcher's own one)
        name
        for name, m in METHODS.items()
        if str(getattr(getattr(m.handlers, "func", m.handlers), "__module__", "")).startswith(
            "flwr_sheaf."
        )
    }
    assert len(shipped) >= 12 and set(re.findall(r"`([a-z][a-z-]+)`", table)) >= shipped
    shell = [b for b in parse_blocks(ROOT / "README.md") if b.lang in SHELL]
    assert any("bash scripts/test.sh" in b.code for b in shell)
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/test.sh" in ci


# ------------------------------------------------------------------ the checker checks itself


def _one(text: str, tmp_path: Path) -> Outcome:
    p = tmp_path / "doc.md"
    p.write_text(text)
    (b,) = parse_blocks(p)
    return check_block(b, tmp_path)


def test_checker_reports_a_wrong_keyword_of_a_real_function_with_file_and_line(tmp_path):
    out = _one(
        "intro\n\n```python\nfrom flwr_sheaf import FederationConfig, SheafFRL\n"
        "s = SheafFRL(4, federation=FederationConfig(graph='ring'), graf='ring')\n"
        "s.start(grid=None, num_rounds=1, timout=5)\n```\n",
        tmp_path,
    )
    text = "\n".join(out.problems)
    assert out.bound == 3  # SheafFRL(...), FederationConfig(...), s.start(...)
    assert "doc.md:3" in text and "'graf'" in text and "'timout'" in text
    assert len(out.problems) == 2


def test_checker_reports_a_misspelled_setting_of_rfedags_and_its_baselines(tmp_path):
    out = _one(
        "```python\nfrom flwr_sheaf.methods.rfedags.strategy import RFedAGS\n"
        "from flwr_sheaf.methods.rfedags.baselines_strategy import RFedBaseline\n"
        "RFedAGS(3, None, local_steps=2, step_sise=0.1)\n"
        "RFedBaseline(3, None, method='rfedavg', seed=1, q_mn=0.1)\n```\n",
        tmp_path,
    )
    text = "\n".join(out.problems)
    assert "'step_sise'" in text and "'q_mn'" in text and len(out.problems) == 2


def test_checker_reports_a_missing_name_script_flag_and_run_config_key(tmp_path):
    assert "cannot import name 'SheafFLR'" in "\n".join(
        _one("```python\nfrom flwr_sheaf import SheafFLR\n```\n", tmp_path).problems
    )
    shell = _one(
        "```bash\npython simulations/inprocess.py lamda=0.1\n"
        "python scripts/run_flwr.py --num-supernode 3\n"
        "bash scripts/nothing.sh\n"
        "python scripts/run_flwr.py --run-config \"graph='star'\"\n"
        "cd simulations && python paper_figures.py --figure 2 --extra zoo=paper-16\n```\n",
        tmp_path,
    ).problems
    text = "\n".join(shell)
    assert "did you mean 'lambda'" in text
    assert "has no option --num-supernode" in text
    assert "no script 'scripts/nothing.sh'" in text
    assert "graph='star'" in text and "zoo='paper-16'" in text
    assert len(shell) == 5


def test_checker_accepts_correct_blocks(tmp_path):
    ok = _one(
        "```bash\npython simulations/inprocess.py zoo=tiny-4 graph=ring num-pilots=32 $EXTRA\n"
        "python scripts/run_flwr.py --num-supernodes 4 --run-config \"zoo='tiny-4' graph='ring'\"\n"
        "flwr run . --stream --federation-config 'num-supernodes=4' --run-config 'lambda=0.0'\n"
        "cd simulations && python inprocess.py 2>&1 | tee x.log   # a cd holds for the lines after it\n"
        "python paper_figures.py --figure 2 --extra local-epochs=1\n```\n",
        tmp_path,
    )
    assert ok.problems == [] and ok.kind == "shell"


def test_checker_checks_ray_commands_against_rays_cli(tmp_path):
    bad = _one(
        "```bash\nray start --head --port 6379 --num-gpu 4\nray begin --head\n"
        "ray start --address=10.0.0.5:6379 --num-gpus 1 --resources '{\"a\": 1}'\n```\n",
        tmp_path,
    ).problems
    text = "\n".join(bad)
    assert "ray start has no option --num-gpu" in text and "ray has no command 'begin'" in text
    assert len(bad) == 2


def test_an_untagged_fence_and_a_reasonless_skip_are_refused(tmp_path):
    assert "fence language ''" in _one("```\nls\n```\n", tmp_path).problems[0]
    assert (
        "needs a reason" in _one("<!-- snippet: skip -->\n```bash\nls\n```\n", tmp_path).problems[0]
    )


if __name__ == "__main__":  # the inventory: python tests/test_snippets.py
    import time

    t0 = time.time()
    _prefetch_help()
    counts: Counter[str] = Counter()
    bound = 0
    failed = 0
    for b in BLOCKS:
        o = check_block(b)
        counts[o.kind] += 1
        bound += o.bound
        failed += bool(o.problems)
        for p in o.problems:
            print("FAIL", p)
        if b.marker == "skip":
            print(f"skipped {b.where}: {b.reason}")
    print(
        f"{len(BLOCKS)} blocks in {len(doc_files())} files: {dict(counts)}; {bound} calls bound; "
        f"{failed} failing; {time.time() - t0:.1f} s"
    )
