#!/usr/bin/env bash
# Creates ./.venv with the CPU build of torch and lightning-diag (editable), for one of two uses:
#   bash scripts/setup.sh demo   the package and its own dependencies only: what `lightning-diag demo` imports
#   bash scripts/setup.sh test   (the default) also the dev, plots and foreign extras: what the test suite needs
# Safe to run again: a stamp per use (.venv/.lightning-diag-demo, .venv/.lightning-diag-pyproject) holds the
# pyproject.toml it was installed from, and pip runs only when that file changed or the stamp is missing, so a
# second run costs no pip call and no Python start-up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
use=${1:-test}
case "$use" in
  demo) stamp=.venv/.lightning-diag-demo; target="." ;;
  test) stamp=.venv/.lightning-diag-pyproject; target=".[dev,plots,foreign]" ;;
  *) echo "usage: bash scripts/setup.sh [demo|test] (got '$use')" >&2; exit 2 ;;
esac
# CI only: Chromium for the dashboard's browser check (tests/test_browser_check.py). With CI=true that test
# fails when Chromium cannot be found, so a failed install here shows as a failing test, not a silent skip.
ci_browser() {
  if [ "$use" = test ] && [ "${CI:-}" = "true" ] && ! command -v chromium >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    timeout 300 sh -c "(apt-get update -qq || true) >/dev/null 2>&1; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1" \
      || echo "setup: could not install chromium; tests/test_browser_check.py will fail" >&2
  fi
}
# The full install covers the demo's: either stamp up to date means the demo has what it needs.
if [ -x .venv/bin/python ] && { cmp -s pyproject.toml "$stamp" \
  || { [ "$use" = demo ] && cmp -s pyproject.toml .venv/.lightning-diag-pyproject; }; }; then
  ci_browser
  exit 0
fi
# pip, without the "WARNING: Location 'file:///...' is ignored" line some machines' pip configuration prints for
# every package looked up (hundreds of lines that hide the real messages). Everything else, errors included,
# is shown, and pip's exit status is kept (pipefail). --no-compile: pip would byte-compile every file of torch
# (tens of seconds on two cores); Python compiles what is imported on first use instead.
pip_install() {
  .venv/bin/python -m pip install --quiet --no-compile "$@" 2>&1 \
    | { grep -v "^WARNING: Location 'file://.*' is ignored" || true; }
}
step() { printf 'setup (%s): %s\n' "$use" "$*"; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
# torch first, always: a bare `torch` requirement on a machine without it would pull a multi-GB CUDA build. The
# constraint file then holds every later install to the build installed here.
if [ ! -s .venv/.torch-constraint ] || ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  step "installing torch==2.13.0 (CPU build)"
  pip_install "torch==2.13.0"
  .venv/bin/python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
    > .venv/.torch-constraint
fi
if [ "$use" = test ]; then
  # The extras make a resolution of some 200 packages: a current pip's resolver, not the venv's bundled one. The
  # demo's few packages install as well with the bundled pip, and skipping the upgrade saves it seconds.
  pip_install --upgrade pip
fi
step "installing lightning-diag${target#.} (editable)"
# setuptools' notice that an editable install is one (a boxed multi-line UserWarning) is not for the user.
PYTHONWARNINGS="ignore::UserWarning" pip_install -c .venv/.torch-constraint -e "$target"
cp pyproject.toml "$stamp"
step "done"
ci_browser
