#!/usr/bin/env bash
# Lint, format check and type check (CI runs this): ruff (rules and formatter settings in
# pyproject.toml) over the package, scripts, benchmarks, simulations and tests; mypy over the package
# at its default strictness, third-party imports ignored. `bash scripts/lint.sh --fix` applies ruff's
# fixes and formatting first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
# shellcheck disable=SC1091
. .venv/bin/activate
PATHS=(flwr_sheaf scripts tools benchmarks simulations tests examples/dropin_app)
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix "${PATHS[@]}" || true
  ruff format "${PATHS[@]}"
fi
ruff check "${PATHS[@]}"
ruff format --check "${PATHS[@]}"
mypy
echo "lint: ruff and mypy clean"
