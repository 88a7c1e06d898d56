#!/usr/bin/env bash
# Sets up ./.venv if needed, then runs the demo. Extra arguments go to `lightning-diag demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/lightning-diag demo "$@"
