"""List the public names of the API reference that have no docstring (exit 1 if any).

The API reference (docs/api/*.md) renders each object named by a ``::: identifier`` directive with
mkdocstrings, which silently leaves out whatever has no docstring. This check walks the same
objects: for a module, its ``__all__`` (or, without one, the public classes and functions defined
in it); for a class, its own public methods and properties (dunders excepted). A method that
overrides a documented one of a base class counts as documented (``inspect.getdoc``), as does
nothing else inherited: a dataclass's generated ``Name(field, ...)`` text is not a docstring.
A constant in a module's ``__all__`` needs an attribute docstring (a string literal right after
the assignment, read with griffe as mkdocstrings does), unless its directive renders undocumented
names with their values (``show_if_no_docstring: true``, as the protocol page does for its record
names).

Usage: ``python scripts/check_docstrings.py [docs_dir]`` (default ``docs``). The docs site runs it
on every build (scripts/docs_hooks.py), so ``mkdocs build --strict`` fails on a missing docstring.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

DIRECTIVE = re.compile(r"^:::\s+([A-Za-z_][\w.]*)\s*\n((?:[ \t]+\S.*\n?)*)", re.MULTILINE)


def directives(docs_dir: Path) -> dict[str, dict]:
    """``{identifier: options}`` of the ``::: identifier`` directives of every page under
    ``docs_dir`` (options: the indented YAML block under the directive's ``options:`` key)."""
    found: dict[str, dict] = {}
    for page in sorted(Path(docs_dir).rglob("*.md")):
        for ident, block in DIRECTIVE.findall(page.read_text(encoding="utf-8") + "\n"):
            parsed = yaml.safe_load(textwrap.dedent(block)) if block.strip() else None
            found.setdefault(ident, (parsed or {}).get("options") or {})
    return found


def resolve(identifier: str) -> object:
    """Import ``identifier`` (``pkg.module`` or ``pkg.module.Name[.attr]``).

    Raises:
        ImportError: no prefix of ``identifier`` is an importable module, or an attribute after
            it is missing (the message names the identifier).
    """
    parts = identifier.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError as exc:
            raise ImportError(f"cannot resolve {identifier!r}: {exc}") from exc
        return obj
    raise ImportError(f"cannot import any module of {identifier!r}")


def _own_doc(obj: object) -> str | None:
    """The docstring written on ``obj`` itself (a class: not inherited, not a dataclass's
    generated signature text)."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
        if doc and doc.startswith(f"{obj.__name__}(") and doc.rstrip().endswith(")"):
            return None  # dataclasses / NamedTuple generate "Name(a: int, ...)"
        return doc.strip() if isinstance(doc, str) and doc.strip() else None
    return inspect.getdoc(obj)


def _public(module: object) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(v) or inspect.isfunction(v))
        and getattr(v, "__module__", None) == module.__name__  # type: ignore[attr-defined]
    ]


def _class_members(cls: type, qual: str) -> Iterable[str]:
    for name, raw in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        if isinstance(raw, property):
            doc = inspect.getdoc(raw) or _inherited(cls, name)
        elif inspect.isfunction(raw):
            doc = inspect.getdoc(raw) or _inherited(cls, name)
        elif hasattr(raw, "func") and hasattr(raw, "attrname"):  # functools.cached_property
            doc = inspect.getdoc(raw.func)
        else:
            continue
        if not doc:
            yield f"{qual}.{name}"


def _inherited(cls: type, name: str) -> str | None:
    for base in cls.__mro__[1:]:
        if name in vars(base):
            return inspect.getdoc(vars(base)[name])
    return None


def _attribute_doc(module: str, name: str) -> str | None:
    """griffe's docstring of the module attribute ``module.name`` (None: none, or griffe cannot
    see the name, e.g. one of several names assigned in one tuple)."""
    import griffe

    top = module.split(".", 1)[0]
    if top not in _GRIFFE:
        _GRIFFE[top] = griffe.load(top, search_paths=[str(REPO), *sys.path], resolve_aliases=False)
    path = ".".join([*module.split(".")[1:], name])
    try:
        obj = _GRIFFE[top][path]
        while obj.is_alias:
            obj = obj.target
    except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return None
    return obj.docstring.value if obj.docstring else None


_GRIFFE: dict[str, object] = {}


def undocumented(identifiers: Iterable[str] | Mapping[str, Mapping]) -> list[str]:
    """Dotted names of the public classes, functions, methods and properties (and constants, see
    the module docstring) without a docstring among the objects the ``identifiers`` name.

    Args:
        identifiers: dotted names, or ``{name: directive options}`` as :func:`directives` gives.

    Raises:
        ImportError: an identifier cannot be imported (see :func:`resolve`).
    """
    options: Mapping[str, Mapping] = (
        identifiers if isinstance(identifiers, Mapping) else dict.fromkeys(identifiers, {})
    )
    missing: list[str] = []
    seen: set[int] = set()

    def check(obj: object, qual: str, opts: Mapping) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if inspect.ismodule(obj):
            if not inspect.getdoc(obj):
                missing.append(qual)
            for name in _public(obj):
                value = getattr(obj, name)
                if (
                    not (inspect.ismodule(value) or inspect.isclass(value) or callable(value))
                    or type(value).__module__ == "typing"
                    or "GenericAlias" in type(value).__name__
                ):
                    if not opts.get("show_if_no_docstring") and not _attribute_doc(qual, name):
                        missing.append(f"{qual}.{name}")
                    continue
                check(value, f"{qual}.{name}", opts)
        elif inspect.isclass(obj):
            if not _own_doc(obj):
                missing.append(qual)
            missing.extend(_class_members(obj, qual))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            if not inspect.getdoc(obj):
                missing.append(qual)

    for ident, opts in options.items():
        check(resolve(ident), ident, opts)
    return missing


def main(argv: list[str]) -> int:
    """Print each public name without a docstring; return 1 if there is one, else 0."""
    docs_dir = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "docs"
    idents = directives(docs_dir)
    missing = undocumented(idents)
    for name in missing:
        print(f"no docstring: {name}")
    print(f"{len(missing)} public names without a docstring in {len(idents)} API objects")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
