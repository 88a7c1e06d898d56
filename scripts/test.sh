#!/usr/bin/env bash
# Sets up ./.venv with the dev, plots and foreign extras (scripts/setup.sh test), then runs the whole test suite
# (slow DDP tests included) and the doctests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q --doctest-modules lightning_diag tests "$@"
