#!/usr/bin/env bash
# Creates ./.venv with the CPU build of torch and lightning-diag (editable, with its dev extras).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first: a bare `torch` requirement on a machine without it would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
# Reinstall whenever pyproject.toml changed (new dependencies), not only when the package is missing.
stamp=.venv/.lightning-diag-pyproject
if ! cmp -s pyproject.toml "$stamp" || ! .venv/bin/python -c "import lightning_diag" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet -e ".[dev]"
  cp pyproject.toml "$stamp"
fi
