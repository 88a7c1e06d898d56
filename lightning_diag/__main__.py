"""``python -m lightning_diag``."""

import sys

from lightning_diag.cli import main

sys.exit(main())
