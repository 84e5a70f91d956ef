"""The docs site (mkdocs.yml, scripts/docs.sh, scripts/docs_hooks.py, scripts/check_docstrings.py).

A small site built with the project's mkdocs.yml and hooks fails strictly on each kind of fault
(unknown page, unknown anchor, missing or git-ignored repository file, folder without README, public
name without a docstring) and, once fixed, builds with repository files copied and links
rewritten; the real site builds strictly with every docs page in its navigation and every public
name of ``flwr_sheaf`` in the API reference; the user docs fit 175 KiB, name no issue number,\nand the nav lists every page in the Diataxis order.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from check_docstrings import directives, undocumented  # noqa: E402

# needs the `docs` extra (mkdocs, mkdocs-material, mkdocstrings), which scripts/setup.sh installs:
# no skip when it is missing, CI must build the docs.
MODULE = '''"""A module of the small site."""

__all__ = ["Documented", "undocumented_fn", "CONSTANT", "DOCUMENTED_CONSTANT"]

CONSTANT = 3
DOCUMENTED_CONSTANT = 4
"""Four."""


class Documented:
    """A class."""

    def method(self):
        return 1

    @property
    def prop(self):
        """A property."""
        return 2


def undocumented_fn():
    return 0
'''


def _nav(html: str) -> set[str]:
    """The page URLs of a built page's navigation (Material's ``md-nav__link`` anchors), without
    trailing slashes (the home page is ``.``)."""
    return {
        h.rstrip("/") or "." for h in re.findall(r'<a href="([^"]*)" class="md-nav__link', html)
    }


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    return env


def _small_site(tmp_path: Path) -> Path:
    """A repository in ``tmp_path``: mkdocs.yml inheriting the project's, docs/, a README, files."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("results/\nsite/\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "out.json").write_text("{}")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text("print(1)\n")
    (tmp_path / "example").mkdir()
    (tmp_path / "example" / "README.md").write_text("# Example\n\nSee [run.py](../bench/run.py).\n")
    (tmp_path / "nodoc").mkdir()
    (tmp_path / "nodoc" / "x.txt").write_text("x")
    (tmp_path / "README.md").write_text(
        "# Small\n\n[guide](docs/guide.md#second-part) and [the script](bench/run.py).\n"
    )
    (tmp_path / "smallmod.py").write_text(MODULE)
    (tmp_path / "mkdocs.yml").write_text(
        f"INHERIT: {ROOT / 'mkdocs.yml'}\n"
        f"docs_dir: {tmp_path / 'docs'}\nsite_dir: {tmp_path / 'site'}\n"
        f"hooks: [{ROOT / 'scripts' / 'docs_hooks.py'}]\n"
        "plugins: [search]\nwatch: []\n"  # no mkdocstrings (the hook checks docstrings itself)
        "nav: [index.md, guide.md, faults.md]\n"  # its own pages, not the project's nav
    )
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text(
        "# Guide\n\n## Second part\n\nText with :class:`~smallmod.Documented`.\n\n"
        "::: smallmod\n    options:\n      show_source: false\n"
    )
    return tmp_path


def _build(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(repo / "mkdocs.yml")],
        capture_output=True,
        text=True,
        env=_env(repo),
        timeout=300,
    )


def test_strict_build_fails_on_each_fault_then_passes_once_fixed(tmp_path):
    repo = _small_site(tmp_path)
    page = repo / "docs" / "faults.md"
    page.write_text(
        "# Faults\n\n"
        "[no page](missing.md), [no anchor](guide.md#no-such-heading), "
        "[no file](../bench/missing.py), [ignored](../results/out.json), "
        "[folder without README](../nodoc/)\n\n"
        "In code, not links: `[x](../bench/missing.py)`\n"
    )
    res = _build(repo)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "missing.md" in out and "not found among documentation files" in out
    assert "no-such-heading" in out and "does not contain an anchor" in out
    assert "'../bench/missing.py', but" in out and "does not exist" in out
    assert "[x](" not in out  # the link-like text in a code span is not checked
    assert "out.json, which git ignores" in out
    assert "'../nodoc/', which has no README.md" in out
    for name in ("smallmod.undocumented_fn", "smallmod.Documented.method", "smallmod.CONSTANT"):
        assert f"public name without a docstring: {name} " in out
    assert "smallmod.Documented.prop " not in out and "DOCUMENTED_CONSTANT" not in out

    # fixed: the build passes; repository files are copied and links point at the copies
    page.write_text(
        "# Faults\n\n[script](../bench/run.py), [example](../example/), [home](../README.md), "
        "[anchor](guide.md#second-part)\n\n`[x](../bench/missing.py)`\n"
    )
    (repo / "smallmod.py").write_text(
        MODULE.replace("        return 1", '        """A method."""\n        return 1')
        .replace("    return 0", '    """A function."""\n    return 0')
        .replace("CONSTANT = 3\n", 'CONSTANT = 3\n"""Three."""\n')
    )
    res = _build(repo)
    assert res.returncode == 0, res.stdout + res.stderr
    site = repo / "site"
    assert (site / "repo" / "bench" / "run.py").read_text() == "print(1)\n"
    faults = (site / "faults" / "index.html").read_text()
    assert 'href="../repo/bench/run.py"' in faults
    assert 'href="../repo/example/"' in faults  # the folder's README, rendered as a page
    assert 'href="../"' in faults  # the README is the home page
    assert "<code>[x](../bench/missing.py)</code>" in faults  # code span left as written
    example = (site / "repo" / "example" / "index.html").read_text()
    assert 'href="../bench/run.py"' in example  # the copied page's own link, rewritten
    home = (site / "index.html").read_text()
    assert 'href="guide/#second-part"' in home and 'href="repo/bench/run.py"' in home
    guide = (site / "guide" / "index.html").read_text()
    assert "<code>Documented</code>" in guide and ":class:" not in guide
    assert _nav(home) == {".", "faults", "guide"}  # copied files stay out of the navigation


def test_docstring_check_walks_the_api_pages(monkeypatch):
    found = directives(ROOT / "docs")
    assert "flwr_sheaf" in found and "flwr_sheaf.protocol" in found
    assert found["flwr_sheaf.protocol"].get("show_if_no_docstring") is True
    assert undocumented(found) == []

    # a module built here: a dataclass's generated text is no docstring, an override of a
    # documented method counts as documented, private names and dunders are not checked
    mod = types.ModuleType("fake_api", "A module.")

    @dataclasses.dataclass
    class Config:
        x: int = 0

    class Base:
        """A base."""

        def run(self):
            """Run."""

        def _private(self):
            pass

    class Child(Base):
        """A child."""

        def run(self):
            pass

        def extra(self):
            pass

        def __call__(self):
            pass

    def helper():
        pass

    for obj in (Config, Base, Child, helper):
        setattr(mod, obj.__name__, obj)
        obj.__module__ = "fake_api"
    mod.__all__ = ["Config", "Base", "Child", "helper"]
    monkeypatch.setitem(sys.modules, "fake_api", mod)
    assert undocumented(["fake_api"]) == [
        "fake_api.Config",
        "fake_api.Child.extra",
        "fake_api.helper",
    ]


#: The most the user docs may hold, in du's blocks (the docs are a guide, not a log: measurement
#: logs live in benchmarks/records/, implementation notes in notes/).
MAX_DOCS_KIB = 175
#: The nav's sections, in the order of Flower's own docs (Diataxis).
SECTIONS = ["Tutorial", "How-to guides", "Explanation", "Reference", "Results"]


def test_the_user_docs_fit_their_budget_and_name_no_issue_numbers():
    pages = sorted((ROOT / "docs").rglob("*.md"))
    assert "docs/guarantees.md" in {p.relative_to(ROOT).as_posix() for p in pages}
    kib = sum(-(-p.stat().st_size // 4096) * 4 for p in pages)  # du's 4 KiB blocks
    assert kib <= MAX_DOCS_KIB, f"user docs take {kib} KiB > {MAX_DOCS_KIB} KiB"
    for page in [*pages, ROOT / "README.md"]:
        text = page.read_text()
        hits = re.findall(r"[Ii]ssue ?#?[0-9]+|#[0-9]{2}\b", text)
        assert not hits, f"{page.relative_to(ROOT)} names issue numbers: {hits}"


def test_the_nav_lists_every_page_once_in_the_diataxis_order():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *a: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"]
    sections = [next(iter(item)) for item in nav if isinstance(item, dict)]
    assert [s for s in sections if s != "Home"] == SECTIONS

    def pages(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, dict):
            return [p for v in node.values() for p in pages(v)]
        return [p for v in node for p in pages(v)]

    listed = pages(nav)
    on_disk = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert len(listed) == len(set(listed))
    assert set(listed) - {"index.md"} == on_disk


@pytest.mark.slow
def test_the_docs_site_builds_strictly_with_every_page_and_public_name(tmp_path):
    site = tmp_path / "site"
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "docs.sh"), "-d", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    home = (site / "index.html").read_text()
    nav = _nav(home)
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").with_suffix("").as_posix()
        url = "." if rel == "index" else rel.removesuffix("/index")
        assert (site / url / "index.html").is_file(), f"docs/{rel}.md not built"
        assert url in nav, f"docs/{rel}.md is not in the site's navigation"
    import flwr_sheaf

    api = (site / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="flwr_sheaf\.(\w+)"', api))
    assert set(flwr_sheaf.__all__) - ids == set()
