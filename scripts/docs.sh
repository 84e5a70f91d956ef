#!/usr/bin/env bash
# Build the docs site (mkdocs.yml: docs/*.md, the README as home page, the API reference from the
# docstrings) with warnings as errors: `bash scripts/docs.sh` -> site/ (git-ignored); CI runs it.
# A broken link or anchor, a link to a repository file that does not exist, or a public name
# without a docstring fails it (notes/contributing-docs.md). `bash scripts/docs.sh serve` serves
# the site at http://127.0.0.1:8000 and rebuilds on every change (extra arguments go to mkdocs,
# e.g. `bash scripts/docs.sh serve -a 0.0.0.0:8001`).
# Needs the `docs` extra (scripts/setup.sh installs it: pip install -e ".[dev,docs]").
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
[ -x .venv/bin/python ] && . .venv/bin/activate
if ! python -c "import mkdocs, mkdocstrings_handlers.python, material" 2>/dev/null; then
  echo "docs: mkdocs, mkdocstrings[python] or mkdocs-material missing: run bash scripts/setup.sh (it installs the docs extra: pip install -e '.[dev,docs]')" >&2
  exit 1
fi
export NO_MKDOCS_2_WARNING=1  # Material's banner about its successor, not a docs warning
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the API reference reads this checkout's package
if [ "${1:-}" = "serve" ]; then
  shift
  exec python -m mkdocs serve "$@"  # warnings are printed; the strict check is the build
fi
start=$(date +%s)
python -m mkdocs build --strict --clean "$@"
echo "docs: built site/ strictly in $(( $(date +%s) - start )) s ($(find site -name index.html | wc -l) pages)"
