"""The ``lightning-diag`` command line: ``demo`` (and ``report`` once it lands)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from lightning_diag.demo.faults import FAULTS

    parser = argparse.ArgumentParser(prog="lightning-diag", description="Diagnose PyTorch Lightning training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny transformer on the shipped synthetic task, with one fault")
    demo.add_argument("--fault", default="none", choices=sorted(FAULTS), help="the fault to inject (default: none)")
    demo.add_argument("--max-epochs", type=int, default=None, help="epochs to train (default: the fault's own)")
    demo.add_argument("--root", default=None, help="directory for the logs (default: ./diag_runs)")
    demo.add_argument("--seed", type=int, default=0, help="seed of data, model and trainer")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-diag`` and ``python -m lightning_diag``; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "demo":
        if args.max_epochs is not None and args.max_epochs < 1:
            print("lightning-diag demo: --max-epochs must be >= 1", file=sys.stderr)
            return 2
        from lightning_diag.demo.run import run_demo

        result = run_demo(fault=args.fault, max_epochs=args.max_epochs, root=args.root, seed=args.seed)
        print(result.summary())
        return 0
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
