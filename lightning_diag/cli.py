"""The ``lightning-diag`` command line: ``demo``, ``report``, ``compare`` and ``repro``; ``--version``.

Exit codes: 0 done; 1 ``report`` or ``compare`` found no diagnostics, or (``report --fail-on warning|critical``)
a run has an alert or a FAIL row at that level; 2 bad input (arguments, a configuration that cannot be read)
or an output that cannot be written. Every message is one line on stderr naming the file and the problem, with
control characters removed; on a stream whose encoding cannot show a character (cp1252 and ``ε``) the
character is replaced, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from lightning_diag.report import FAIL_ON
from lightning_diag.report.render import FORMATS
from lightning_diag.report.text import clean, display

__all__ = ["main"]

#: The folder under ``--out`` that holds the plots: the report writes only its own names into ``--out``.
PLOTS_DIR = "lightning-diag-plots"
# How each format's report file starts: an existing file is replaced only when it is one of ours.
_OURS = {"md": b"# lightning-diag report", "json": b'{\n  "runs": [', "html": b"<!doctype html><html><head>"}


def _say(command: str, message: str) -> None:
    """One line on stderr: ``lightning-diag <command>: <message>``, control characters removed."""
    print(f"lightning-diag {command}: {clean(message)}", file=sys.stderr)


def _tolerant_streams() -> None:
    """Replace, instead of failing on, characters stdout and stderr cannot encode (``ε`` on cp1252)."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        reconfigure = getattr(stream, "reconfigure", None)
        if encoding != "utf8" and reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):
                reconfigure(errors="replace")


def _parser(fault_names: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``fault_names`` are the demo's ``--fault`` choices (``None``: not checked here).

    The fault library imports torch and Lightning, so it is loaded only for ``demo``: ``report`` (and its
    ``--help``) stays light.
    """
    from lightning_diag import __version__

    parser = argparse.ArgumentParser(prog="lightning-diag", description="Diagnose PyTorch Lightning training runs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
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
        description="Read the TensorBoard event files, CSVLogger metrics.csv and diag/alerts.jsonl of every run "
        "under LOGDIR and print the layered diagnosis checklist (pass / fail / not measured, measured value beside "
        "threshold) and the alert timeline; several runs also get one summary line each, the worst first (in md "
        "the summary alone unless --details). A run trained without lightning_diag callbacks is judged on its own "
        "logged losses. html, and any format with --out, also draws PNG plots (needs matplotlib).",
    )
    report.add_argument("logdir", metavar="LOGDIR", help="a run's log directory, or a directory of runs")
    report.add_argument("--format", default="md", choices=FORMATS, help="output format (default: md)")
    report.add_argument(
        "--out", default=None, metavar="DIR", help="write report.<format> and the plots into DIR instead of stdout"
    )
    report.add_argument(
        "--fail-on",
        default="never",
        choices=FAIL_ON,
        help="exit 1 when a run has an alert or a FAIL row at this level or above, for CI (default: never)",
    )
    report.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="ROLE=TAG",
        help="for runs without lightning_diag callbacks: the logged tag that is ROLE, overriding the automatic "
        "choice; ROLE is train_loss, train_loss_epoch, val_loss, lr or epoch (repeat for several), e.g. "
        "--map val_loss=valid/nll",
    )
    report.add_argument(
        "--details",
        action="store_true",
        help="with several runs in md, print every run's checklist before the summary (default: the summary only)",
    )
    compare = sub.add_parser(
        "compare",
        help="what changed between runs: provenance, checklist, alerts, metrics, where the losses diverge",
        description="Compare two or more runs (their log directories): provenance differences from diag/run.json "
        "(hyperparameters first), the checklist side by side, alert counts per rule with the first alert of each, "
        "final and best loss values, and the step where the training-loss curves first diverge beyond noise.",
    )
    compare.add_argument("runs", nargs="+", metavar="RUN", help="run log directories (at least two)")
    compare.add_argument("--format", default="md", choices=FORMATS, help="output format (default: md)")
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
        _say("compare", "give at least two RUN directories")
        return 2
    missing = [r for r in runs if not os.path.isdir(r)]
    if missing:
        _say("compare", f"not a directory: {', '.join(display(r) for r in missing)}")
        return 2
    try:
        comparison = compare_runs(runs)
    except NoDiagnosticsError as err:
        _say("compare", str(err))
        return 1
    _print_chunks([render_comparison(comparison, fmt)])
    for rep in comparison.reports:
        for problem in rep.run.problems:
            _say("compare", problem)
    return 0


def _repro(config: str, fraction: float) -> int:
    if not 0 < fraction <= 1:
        _say("repro", "--fraction must be in (0, 1]")
        return 2
    if not os.path.isfile(config):
        _say("repro", f"--config {display(config)}: not a file")
        return 2
    from lightning_diag.repro import ConfigError, check_config, run_repro

    try:
        check_config(config)
        log_dir = run_repro(config, fraction)
    except ConfigError as err:
        _say("repro", str(err))
        return 2
    return _report(log_dir, "md", None, details=True)


class _Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal and there is more than one run."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, index: int, total: int, path: Path) -> None:
        if total < 2 or not sys.stderr.isatty():
            return
        width = 24
        filled = width * index // total
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\rlightning-diag report [{bar}] {index + 1}/{total} {display(path)[-40:]}\x1b[K")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _report(
    logdir: str,
    fmt: str,
    out: str | None,
    fail_on: str = "never",
    maps: Sequence[str] = (),
    details: bool = False,
) -> int:
    from lightning_diag.report import NoDiagnosticsError, RunReport, gate, iter_reports, render_stream
    from lightning_diag.report.tag_map import parse_overrides

    try:
        mapping = parse_overrides(maps)
    except ValueError as err:
        _say("report", str(err))
        return 2
    if not os.path.isdir(logdir):
        what = "not a directory" if os.path.exists(logdir) else "does not exist"
        _say("report", f"LOGDIR {display(logdir)}: {what}")
        return 2
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        refused = _refuse_out(out_dir, fmt)
        if refused:
            _say("report", refused)
            return 2
    plot_dir = out_dir / PLOTS_DIR if out_dir is not None else None
    tmp = None
    if plot_dir is None and fmt == "html":
        tmp = tempfile.TemporaryDirectory(prefix="lightning-diag-plots-")
        plot_dir = Path(tmp.name)
    failures: list[str] = []
    problems: list[str] = []
    plots = 0
    noted = False
    progress = _Progress()

    def reports() -> Iterator[RunReport]:
        # One run at a time: gated, its plot note printed once, then rendered and dropped.
        nonlocal plots, noted
        for rep in iter_reports(logdir, plot_dir=plot_dir, progress=progress, mapping=mapping):
            if rep.plot_note and not noted:
                progress.done()
                _say("report", rep.plot_note)
                noted = True
            failures.extend(f"{rep.run.name}: {why}" for why in gate(rep, fail_on))  # type: ignore[arg-type]
            problems.extend(rep.run.problems)
            plots += len(rep.plots)
            yield rep

    try:
        try:
            runs = reports()
            first = next(runs)  # nothing is written before a run with diagnostics is found
            chunks = render_stream(
                itertools.chain([first], runs),
                fmt,  # type: ignore[arg-type]
                plot_base=out_dir,
                details=details,
            )
            if out_dir is None:
                _print_chunks(chunks)
            else:
                try:
                    out_dir.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    _say("report", f"--out {display(out_dir)}: cannot be created ({err.strerror or err})")
                    return 2
                _write_report(out_dir / f"report.{fmt}", chunks)
        except NoDiagnosticsError as err:
            progress.done()
            _say("report", str(err))
            return 1
        except OSError as err:
            progress.done()
            _say("report", f"--out {display(out_dir or '')}: the report could not be written ({err})")
            return 2
        finally:
            progress.done()
    finally:
        if tmp is not None:
            tmp.cleanup()
    for problem in problems[:20]:
        _say("report", problem)
    if len(problems) > 20:
        _say("report", f"... and {len(problems) - 20} more problems (listed in the report)")
    if out_dir is not None:
        print(f"lightning-diag report: wrote {display(out_dir / f'report.{fmt}')} ({plots} plots)")
    if failures:
        _say("report", f"--fail-on {fail_on}: {len(failures)} finding(s) at that level")
        for why in failures[:20]:
            print(f"  {clean(why)}", file=sys.stderr)
        if len(failures) > 20:
            print(f"  ... and {len(failures) - 20} more", file=sys.stderr)
        return 1
    return 0


def _refuse_out(out_dir: Path, fmt: str) -> str:
    """Why ``report --out out_dir`` must not write there (``""``: it may).

    The report writes ``report.<fmt>`` and the :data:`PLOTS_DIR` folder, nothing else: an existing
    ``report.<fmt>`` is replaced only when it is a regular file holding a lightning-diag report of that format,
    so a user's own file or folder of that name (a run folder named ``report.md``) is never overwritten.
    """
    if os.path.lexists(out_dir) and not out_dir.is_dir():
        return f"--out {display(out_dir)}: exists and is not a directory"
    target = out_dir / f"report.{fmt}"
    if os.path.lexists(target):
        if target.is_symlink() or not target.is_file():
            return f"--out {display(out_dir)}: {target.name} exists and is not a regular file; not overwritten"
        try:
            with open(target, "rb") as fh:
                head = fh.read(len(_OURS[fmt]))
        except OSError as err:
            return f"--out {display(out_dir)}: {target.name} cannot be read ({err}); not overwritten"
        if head != _OURS[fmt]:
            return f"--out {display(out_dir)}: {target.name} exists and is not a lightning-diag report; not overwritten"
    plots = out_dir / PLOTS_DIR
    if os.path.lexists(plots) and (plots.is_symlink() or not plots.is_dir()):
        return f"--out {display(out_dir)}: {PLOTS_DIR} exists and is not a directory; not overwritten"
    return ""


def _write_report(path: Path, chunks: Iterable[str]) -> None:
    """Write the report to a temporary file beside ``path``, then rename it: a failure (a full disk) leaves
    the earlier file, or none, never an empty or partial one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with open(fd, "w", encoding="utf-8") as fh:
            for chunk in chunks:
                fh.write(chunk)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _print_chunks(chunks: Iterable[str]) -> None:
    """Write the report to stdout as it is rendered; quiet on a closed pipe (``... | head``)."""
    try:
        for chunk in chunks:
            sys.stdout.write(chunk)
        sys.stdout.write("\n")
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        for _ in chunks:  # finish the runs, so --fail-on still judges every one
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-diag`` and ``python -m lightning_diag``; returns the exit code."""
    _tolerant_streams()
    words = list(sys.argv[1:] if argv is None else argv)
    fault_names = None
    if words[:1] == ["demo"]:
        from lightning_diag.demo.faults import FAULTS

        fault_names = list(FAULTS)
    args = _parser(fault_names).parse_args(words)
    if args.command == "demo":
        if args.max_epochs is not None and args.max_epochs < 1:
            _say("demo", "--max-epochs must be >= 1")
            return 2
        from lightning_diag.demo.run import run_demo

        # Lightning's start-up notes (the accelerators found, an advertisement for a cloud logger) are not the
        # demo's output; its warnings still show, and the level is put back after the demo
        notes = logging.getLogger("pytorch_lightning.utilities.rank_zero")
        level = notes.level
        notes.setLevel(logging.WARNING)
        try:
            result = run_demo(fault=args.fault, max_epochs=args.max_epochs, root=args.root, seed=args.seed)
        finally:
            notes.setLevel(level)
        print(result.summary())
        return 0
    if args.command == "report":
        return _report(args.logdir, args.format, args.out, args.fail_on, args.map, args.details)
    if args.command == "compare":
        return _compare(args.runs, args.format)
    if args.command == "repro":
        return _repro(args.config, args.fraction)
    return 2  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
