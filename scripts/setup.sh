#!/usr/bin/env bash
# Create .venv (if missing) and install flwr-sheaf with its test and docs extras (`dev`, `docs`:
# scripts/docs.sh builds the docs site). Idempotent; pip runs only when pyproject.toml changed.
# torch/torchvision are installed first with pip, pinned to builds pip can take from the local
# wheel cache on this project's machines (x86_64: 2.14.1/0.29.1; aarch64: 2.9.1/0.24.1);
# override with TORCH_SPEC="torch==X torchvision==Y". Do not use uv/poetry here: they ignore the
# local cache and download several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if [ -z "${TORCH_SPEC:-}" ]; then
  case "$(uname -m)" in
    aarch64|arm64) TORCH_SPEC="torch==2.9.1 torchvision==0.24.1" ;;
    *) TORCH_SPEC="torch==2.14.1 torchvision==0.29.1" ;;
  esac
fi
# pip is skipped (about 15 s) while pyproject.toml, TORCH_SPEC and this checkout are those of the last
# complete install, recorded in .venv/.flwr-sheaf-installed; any change installs again
STAMP=.venv/.flwr-sheaf-installed
trap 'rm -f "$STAMP"' ERR  # a failed check below: the next run installs again
WANT="$(cat pyproject.toml; echo "$TORCH_SPEC"; pwd)"
WANT="$(printf '%s' "$WANT" | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  rm -f "$STAMP"
  python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
  if ! python -c "import torch, torchvision" >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    python -m pip install -q $TORCH_SPEC 2>&1 | grep -v "is ignored" || true
  fi
  python -m pip install -q -e ".[dev,docs]" 2>&1 | grep -v "is ignored" || true
fi
python -c "import flwr_sheaf, torch, torchvision, flwr; print('flwr-sheaf ready: torch', torch.__version__, '| flwr', flwr.__version__)"
# the extras the tests and the docs build need (the pip lines above hide their own errors' noise,
# so a failed install must show up here, naming what to install, not later as import errors)
python -c "import pytest, xdist, nbclient, ruff, mypy, tensorboard, wandb, mkdocs, material, mkdocstrings_handlers.python" \
  || { echo "setup: the dev/docs extras are incomplete: run python -m pip install -e '.[dev,docs]' in .venv and read its errors" >&2; rm -f "$STAMP"; exit 1; }
echo "$WANT" > "$STAMP"
