"""MkDocs hooks of the docs site (mkdocs.yml `hooks:`; notes/contributing-docs.md explains the rules).

* **Home page**: without a ``docs/index.md`` the repository's ``README.md`` is the site's home page
  (its links ``docs/x.md`` become ``x.md``).
* **Links to repository files outside docs/** (``../benchmarks/run.py``, ``../README.md``,
  ``../examples/dropin_app/``): written as plain relative links, so they work on GitHub and in an
  editor. This hook checks that the target exists in the repository and is not git-ignored (else a
  warning, which ``mkdocs build --strict`` turns into an error), copies it into the site under
  ``repo/<path>`` (a Markdown file there becomes a page that is not in the navigation) and rewrites
  the link to that copy. A link to a folder goes to its ``README.md`` (a folder without one is an
  error: link a file in it). Links inside docs/ are left to MkDocs' own validation
  (``validation:`` in mkdocs.yml: unknown pages and anchors are warnings, hence errors).
* **Sphinx roles in docstrings** (``:class:`~a.b.C```, ``:func:`f```), which mkdocstrings does not
  read, are rendered as code spans (``C``, ``f``).
* **Public names without a docstring**: every module named by a ``::: module`` directive of a page
  is walked by ``scripts/check_docstrings.py``; each public class, function, method or property
  without a docstring is a warning (an error under ``--strict``).
"""

from __future__ import annotations

import logging
import posixpath
import re
import subprocess
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

# the repository: the folder of mkdocs.yml (set by on_config)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_docstrings import directives, undocumented  # noqa: E402

log = logging.getLogger("mkdocs.hooks.docs")
COPY_PREFIX = "repo"
# [text](target) and ![alt](target "title"); the target is group 2
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)((?:\s+\"[^\"\n]*\")?\))")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def _sub_outside_code(pattern: re.Pattern, repl, line: str) -> str:
    """``pattern.sub(repl, line)`` for the matches that do not start inside an inline code span
    (a link whose text holds a code span, ``[`x`](y)``, is still a link)."""
    spans = [m.span() for m in CODE_SPAN.finditer(line)]

    def sub(m: re.Match) -> str:
        if any(a <= m.start() < b for a, b in spans):
            return m.group(0)
        return repl(m)

    return pattern.sub(sub, line)


ROLE = re.compile(
    r":(?:class|func|meth|mod|attr|data|exc|obj|const|ref|py:\w+):<code>(~?)\.*([^<]*)</code>"
)

# page src_uri -> its real file (for pages whose real place is not docs/<src_uri>)
_real: dict[str, Path] = {}


def _outside_targets(text: str, real: Path) -> list[tuple[str, Path]]:
    """``(target, resolved path)`` of every relative link of ``text`` (a file at ``real``) that
    points outside the docs folder; fenced code blocks are skipped."""
    out = []
    for target in _links(text):
        path = (real.parent / target.split("#", 1)[0]).resolve()
        out.append((target, path))
    return out


def _links(text: str) -> list[str]:
    """Relative link targets of ``text`` outside code blocks and code spans (no URL scheme, no
    pure anchor)."""
    found, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue

        def keep(m: re.Match) -> str:
            t = m.group(2)
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith(("#", "/")):
                found.append(t)
            return m.group(0)

        _sub_outside_code(LINK, keep, line)
    return found


def _site_uri(path: Path, docs_dir: Path, home_is_readme: bool) -> str | None:
    """The site src_uri that stands for the repository file ``path`` (None: not a repo file)."""
    if path.is_dir():
        path = path / "README.md"
    if path == REPO / "README.md" and home_is_readme:
        return "index.md"
    if path.is_relative_to(docs_dir):
        return path.relative_to(docs_dir).as_posix()
    if path.is_relative_to(REPO):
        return f"{COPY_PREFIX}/{path.relative_to(REPO).as_posix()}"
    return None


def _ignored(paths: list[Path]) -> set[Path]:
    """The paths git ignores (empty where git or the .git folder is not there)."""
    if not paths or not (REPO / ".git").exists():
        return set()
    try:
        res = subprocess.run(
            ["git", "-C", str(REPO), "check-ignore", "--stdin"],
            input="\n".join(str(p) for p in paths),
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return set()
    return {Path(line) for line in res.stdout.splitlines() if line}


def on_config(config):
    """The repository root is the folder of the mkdocs.yml being built."""
    global REPO
    REPO = Path(config.config_file_path).resolve().parent
    return config


def on_files(files: Files, config) -> Files:
    """Add the home page (README.md) and every repository file a page links to outside docs/."""
    docs_dir = Path(config["docs_dir"]).resolve()
    home_is_readme = files.get_file_from_path("index.md") is None
    _real.clear()
    if home_is_readme:
        files.append(File.generated(config, "index.md", abs_src_path=str(REPO / "README.md")))
        _real["index.md"] = REPO / "README.md"
    queue = [
        (Path(f.abs_src_path), f.src_uri)
        for f in files.documentation_pages()
        if f.abs_src_path is not None
    ]
    seen: set[Path] = set()
    problems: list[tuple[str, str, Path]] = []
    while queue:
        real, uri = queue.pop()
        for target, path in _outside_targets(real.read_text(encoding="utf-8"), real):
            if path.is_relative_to(docs_dir) or path in seen:
                continue
            if not path.exists():
                problems.append((uri, target, path))
                continue
            if path.is_dir() and not (path / "README.md").is_file():
                log.warning(
                    "%s links to the folder %r, which has no README.md: link a file in it "
                    "(notes/contributing-docs.md)",
                    uri,
                    target,
                )
                continue
            file_path = path / "README.md" if path.is_dir() else path
            seen.add(path)
            site = _site_uri(file_path, docs_dir, home_is_readme)
            if site is None:
                log.warning("%s links to %r, outside the repository %s", uri, target, REPO)
                continue
            if files.get_file_from_path(site) is not None:
                continue
            f = File.generated(config, site, abs_src_path=str(file_path))
            if f.is_documentation_page():
                f.inclusion = InclusionLevel.NOT_IN_NAV
                _real[site] = file_path
                queue.append((file_path, site))
            files.append(f)
    for uri, target, path in problems:
        log.warning("%s links to %r, but %s does not exist", uri, target, path)
    for path in _ignored(sorted(seen)):
        log.warning("a page links to %s, which git ignores (not in the repository)", path)
    return files


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Rewrite links that leave docs/ to the site's copy of the repository file."""
    docs_dir = Path(config["docs_dir"]).resolve()
    src = page.file.src_uri
    real = _real.get(src, docs_dir / src)
    home_is_readme = "index.md" in _real
    here = posixpath.dirname(src)

    def rewrite(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path_part, _, anchor = target.partition("#")
        path = (real.parent / path_part).resolve()
        if real.is_relative_to(docs_dir) and path.is_relative_to(docs_dir):
            return m.group(0)  # an ordinary docs link: MkDocs validates it
        exists = path.is_file() or (path / "README.md").is_file()
        site = _site_uri(path, docs_dir, home_is_readme) if exists else None
        if site is None:
            return m.group(0)  # reported by on_files / MkDocs
        new = posixpath.relpath(site, here or ".") + (f"#{anchor}" if anchor else "")
        return f"{m.group(1)}{new}{m.group(3)}"

    out, fenced = [], False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        out.append(line if fenced or FENCE.match(line) else _sub_outside_code(LINK, rewrite, line))
    return "".join(out)


def on_page_content(html: str, page, config, files: Files) -> str:
    """Docstrings' Sphinx roles (``:class:`~a.B```) as plain code spans (``B``)."""

    def code(m: re.Match) -> str:
        name = m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2)
        return f"<code>{name}</code>"

    return ROLE.sub(code, html)


def on_pre_build(config) -> None:
    """Warn (error under --strict) for each public name without a docstring in the API pages."""
    docs_dir = Path(config["docs_dir"])
    for name in undocumented(directives(docs_dir)):
        log.warning("public name without a docstring: %s (scripts/check_docstrings.py)", name)
