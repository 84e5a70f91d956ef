#!/usr/bin/env bash
# Set up, then run the whole test suite (arguments go to pytest; e.g. -m "not engine" skips the
# tests that start the real Flower engine). Two pytest-xdist workers by default (PYTEST_WORKERS=0
# runs in one process), scheduled by file (`--dist loadfile`): the tests of one file run in one
# worker, so a module-scoped fixture (tests/test_deploy.py's deployment) is set up once, and engine
# tests of different files use different ports. (`--dist loadgroup` with xdist_group markers grouped
# nothing with pytest 9.2 / xdist 3.8.)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q --durations=12 -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
