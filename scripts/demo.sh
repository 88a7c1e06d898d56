#!/usr/bin/env bash
# Sets up ./.venv with what the demo needs (scripts/setup.sh demo: the package, no extras), then runs the demo.
# Extra arguments go to `lightning-diag demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
# The first run writes the byte code of what the demo imports into .venv (setup.sh installs with pip --no-compile),
# even where PYTHONDONTWRITEBYTECODE is set, so that the next run starts training in seconds.
exec env -u PYTHONDONTWRITEBYTECODE .venv/bin/lightning-diag demo "$@"
