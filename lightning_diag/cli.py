"""The ``lightning-diag`` command line: ``demo``, ``report``, ``compare`` and ``repro``.

Exit codes: 0 done; 1 ``report`` or ``compare`` found no diagnostics; 2 bad command-line input.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _parser(fault_names: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``fault_names`` are the demo's ``--fault`` choices (``None``: not checked here).

    The fault library imports torch and Lightning, so it is loaded only for ``demo``: ``report`` (and its
    ``--help``) stays light.
    """
    parser = argparse.ArgumentParser(prog="lightning-diag", description="Diagnose PyTorch Lightning training runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a tiny transformer on the shipped synthetic task, with one fault")
    demo.add_argument(
        "--fault",
        default="none",
        choices=sorted(fault_names) if fault_names is not None else None,
        help="the fault to inject (default: none)",
    )
    demo.add_argument("--max-epochs", type=int, default=None, help="epochs to train (default: the fault's own)")
    demo.add_argument("--root", default=None, help="directory for the logs (default: ./diag_runs)")
    demo.add_argument("--seed", type=int, default=0, help="seed of data, model and trainer")
    report = sub.add_parser(
        "report",
        help="the diagnosis checklist and alert timeline of every run under a log directory",
        description="Read the TensorBoard event files and diag/alerts.jsonl of every run under LOGDIR and print "
        "the layered diagnosis checklist (pass / fail / not measured, measured value beside threshold) and the "
        "alert timeline. html, and any format with --out, also draws PNG plots (needs matplotlib).",
    )
    report.add_argument("logdir", metavar="LOGDIR", help="a run's log directory, or a directory of runs")
    report.add_argument("--format", default="md", choices=["md", "json", "html"], help="output format (default: md)")
    report.add_argument(
        "--out", default=None, metavar="DIR", help="write report.<format> and the plots into DIR instead of stdout"
    )
    compare = sub.add_parser(
        "compare",
        help="what changed between runs: provenance, checklist, alerts, metrics, where the losses diverge",
        description="Compare two or more runs (their log directories): provenance differences from diag/run.json "
        "(hyperparameters first), the checklist side by side, alert counts per rule with the first alert of each, "
        "final and best loss values, and the step where the training-loss curves first diverge beyond noise.",
    )
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run log directories (at least two)")
    compare.add_argument("--format", default="md", choices=["md", "json", "html"], help="output format (default: md)")
    repro = sub.add_parser(
        "repro",
        help="re-run a LightningCLI config on a fraction of the data with every lightning_diag callback",
        description="Fit a LightningCLI `fit` configuration (model and data given by class_path) on a fraction of "
        "its train and validation batches with every lightning_diag callback attached, then print the report.",
    )
    repro.add_argument("--config", required=True, metavar="CONFIG", help="a LightningCLI YAML configuration")
    repro.add_argument("--fraction", type=float, default=0.01, help="share of the batches (default: 0.01)")
    return parser


def _compare(runs: Sequence[str], fmt: str) -> int:
    from lightning_diag.report import NoDiagnosticsError
    from lightning_diag.report.compare import compare_runs, render_comparison

    if len(runs) < 2:
        print("lightning-diag compare: give at least two RUN directories", file=sys.stderr)
        return 2
    missing = [r for r in runs if not os.path.isdir(r)]
    if missing:
        print(f"lightning-diag compare: not a directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    try:
        comparison = compare_runs(runs)
    except NoDiagnosticsError as err:
        print(f"lightning-diag compare: {err}", file=sys.stderr)
        return 1
    print(render_comparison(comparison, fmt))
    return 0


def _repro(config: str, fraction: float) -> int:
    if not 0 < fraction <= 1:
        print("lightning-diag repro: --fraction must be in (0, 1]", file=sys.stderr)
        return 2
    if not os.path.isfile(config):
        print(f"lightning-diag repro: --config {config!r} is not a file", file=sys.stderr)
        return 2
    from lightning_diag.repro import run_repro

    log_dir = run_repro(config, fraction)
    return _report(log_dir, "md", None)


def _report(logdir: str, fmt: str, out: str | None) -> int:
    from lightning_diag.report import NoDiagnosticsError, build_report, render

    if not os.path.isdir(logdir):
        what = "is not a directory" if os.path.exists(logdir) else "does not exist"
        print(f"lightning-diag report: LOGDIR {logdir!r} {what}", file=sys.stderr)
        return 2
    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        print(f"lightning-diag report: --out {out!r} exists and is not a directory", file=sys.stderr)
        return 2
    out_dir = Path(out) if out is not None else None
    plot_dir = out_dir if out_dir is not None else None
    tmp = None
    if plot_dir is None and fmt == "html":
        import tempfile

        tmp = tempfile.TemporaryDirectory(prefix="lightning-diag-plots-")
        plot_dir = Path(tmp.name)
    try:
        try:
            reports = build_report(logdir, plot_dir=plot_dir)
        except NoDiagnosticsError as err:
            print(f"lightning-diag report: {err}", file=sys.stderr)
            return 1
        for rep in reports:
            if rep.plot_note:
                print(f"lightning-diag report: {rep.plot_note}", file=sys.stderr)
                break
        text = render(reports, fmt, plot_base=out_dir)  # type: ignore[arg-type]
    finally:
        if tmp is not None:
            tmp.cleanup()
    if out_dir is None:
        try:
            print(text)
            sys.stdout.flush()
        except BrokenPipeError:  # `lightning-diag report ... | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"report.{fmt}"
    path.write_text(text + "\n", encoding="utf-8")
    print(f"lightning-diag report: wrote {path} ({sum(len(r.plots) for r in reports)} plots)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-diag`` and ``python -m lightning_diag``; returns the exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    fault_names = None
    if words[:1] == ["demo"]:
        from lightning_diag.demo.faults import FAULTS

        fault_names = list(FAULTS)
    args = _parser(fault_names).parse_args(words)
    if args.command == "demo":
        if args.max_epochs is not None and args.max_epochs < 1:
            print("lightning-diag demo: --max-epochs must be >= 1", file=sys.stderr)
            return 2
        from lightning_diag.demo.run import run_demo

        result = run_demo(fault=args.fault, max_epochs=args.max_epochs, root=args.root, seed=args.seed)
        print(result.summary())
        return 0
    if args.command == "report":
        return _report(args.logdir, args.format, args.out)
    if args.command == "compare":
        return _compare(args.runs, args.format)
    if args.command == "repro":
        return _repro(args.config, args.fraction)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
