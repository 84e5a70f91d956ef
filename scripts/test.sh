#!/usr/bin/env bash
# Set up, then run the whole test suite (arguments go to pytest; e.g. -m "not engine" skips the
# tests that start the real Flower engine). Two pytest-xdist workers by default (PYTEST_WORKERS=0
# runs in one process); the engine tests share one worker (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q --durations=12 -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
