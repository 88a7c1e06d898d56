#!/usr/bin/env bash
# Sets up ./.venv with what the demo needs (scripts/setup.sh demo: the package, no extras), then runs the demo.
# Extra arguments go to `lightning-diag demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/lightning-diag demo "$@"
