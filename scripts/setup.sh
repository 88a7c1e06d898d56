#!/usr/bin/env bash
# Creates ./.venv with the CPU build of torch and lightning-diag (editable, with its dev and plots extras).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip, without the "WARNING: Location 'file:///...' is ignored" line some machines' pip configuration prints for
# every package looked up (hundreds of lines that hide the real messages). Everything else, errors included,
# is shown, and pip's exit status is kept (pipefail).
pip_install() {
  .venv/bin/python -m pip install "$@" 2>&1 | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }
}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch first: a bare `torch` requirement on a machine without it would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  pip_install --quiet --upgrade pip
  pip_install --quiet "torch==2.13.0"
fi
# Reinstall whenever pyproject.toml changed (new dependencies), not only when the package is missing.
stamp=.venv/.lightning-diag-pyproject
if ! cmp -s pyproject.toml "$stamp" || ! .venv/bin/python -c "import lightning_diag" >/dev/null 2>&1; then
  # setuptools' notice that an editable install is one (a boxed multi-line UserWarning) is not for the user.
  # The `foreign` extra (tests/foreign: forecasting, tabular and time-series libraries built on Lightning) is
  # installed under a constraint holding torch at the build installed above: nothing may swap it for a CUDA one.
  .venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
    > .venv/.torch-constraint
  PYTHONWARNINGS="ignore::UserWarning" pip_install --quiet -c .venv/.torch-constraint -e ".[dev,plots,foreign]"
  cp pyproject.toml "$stamp"
fi
# CI only: Chromium for the dashboard's browser check (tests/test_browser_check.py). With CI=true that test
# fails when Chromium cannot be found, so a failed install here shows as a failing test, not a silent skip.
if [ "${CI:-}" = "true" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
  && [ "$(id -u)" = "0" ]; then
  timeout 300 sh -c "(apt-get update -qq || true) >/dev/null 2>&1; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1" \
    || echo "setup: could not install chromium; tests/test_browser_check.py will fail" >&2
fi
