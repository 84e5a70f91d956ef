#!/usr/bin/env bash
# Install a named offline dataset into data/<name> (SHA-256 checked), e.g.
#   bash scripts/get_data.sh fashion-mnist
# Fashion-MNIST (70,000 images) comes from Debian's `dataset-fashion-mnist` package via
# `apt-get download` (as root, `apt-get update` runs first when the package lists are missing).
# Then run with the run-config value dataset=fashion-mnist. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then bash scripts/setup.sh; fi
.venv/bin/python -c "import sys; from flwr_sheaf.data.catalog import main; main(sys.argv[1:])" "$@"
