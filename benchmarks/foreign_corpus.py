"""The foreign-code corpus's table: other projects' LightningModules (pytorch-forecasting, pytorch-tabular,
neuralforecast, darts, scvi-tools, Lightning's demo transformer) trained as their docs do with the callbacks
attached, one healthy run and one NaN run each (:mod:`tests.foreign.corpus`).

    python benchmarks/foreign_corpus.py                          # print the markdown table
    python benchmarks/foreign_corpus.py --write docs/detection.md   # and replace the page's section
    python benchmarks/foreign_corpus.py --only pf_tft --only darts_nbeats

Needs the ``foreign`` extra (``pip install -e '.[foreign]'``); a model whose library is missing gets a row
saying so. Run from the repository root (the harness lives in ``tests/foreign``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.foreign.corpus import ENTRIES, TIMING_RULES, installed, nan_stopped, run_entry, version

START, END = "<!-- foreign-corpus:start -->", "<!-- foreign-corpus:end -->"


def _alerts(result: Any) -> str:
    counts: dict[str, int] = {}
    for alert in result.serious:
        key = f"{alert.rule} ({alert.severity})" if alert.severity == "critical" else alert.rule
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"`{k}` x{n}" if n > 1 else f"`{k}`" for k, n in sorted(counts.items())) or "none"


def _row(name: str) -> tuple[str, str]:
    """One table row for ``name`` and one line of run times."""
    entry = ENTRIES[name]
    missing = installed(entry)
    if missing is not None:
        return f"| {entry.library} | - | {entry.model} | - | - | not run: {missing} | - | - |", ""
    with tempfile.TemporaryDirectory() as root:
        try:
            healthy = run_entry(name, os.path.join(root, "healthy"))
        except Exception as err:  # a crash is what the table reports
            traceback.print_exc()
            return f"| {entry.library} | {version(entry)} | {entry.model} | - | - | exception: {err!r} | - | - |", ""
        try:
            nan = run_entry(name, os.path.join(root, "nan"), nan_step=entry.nan_step, max_steps=entry.nan_step + 4)
            stopped = nan_stopped(nan, entry.nan_step)
            rules = sorted({a.rule for a in nan.alerts if a.severity == "critical"})
            verdict = f"{'yes' if stopped else 'NO'}: {', '.join(f'`{r}`' for r in rules) or 'no alert'} at step "
            verdict += f"{entry.nan_step} ({entry.nan_mode} NaN in `{nan.poisoned}`), fit ended at step "
            verdict += f"{nan.global_step}"
        except Exception as err:
            traceback.print_exc()
            verdict, nan = f"exception: {err!r}", None
    start, end = healthy.loss_span()
    if entry.has_attention:
        count = len(healthy.attention_modules)
        seen = f"{count} module{'s' * (count != 1)}" if count else "**not seen**"
        attention = f"{entry.attention_kind}: {seen}"
    else:
        attention = "none in the model" + (
            f"; **{len(healthy.attention_modules)} reported**" * bool(healthy.attention_modules)
        )
    row = (
        f"| {entry.library} | {version(entry)} | {entry.model} | {healthy.global_step} | {start:.3g} → {end:.3g} | "
        f"{_alerts(healthy)} | {attention} | {verdict} |"
    )
    times = f"{name} {healthy.seconds:.0f}s" + (f" + {nan.seconds:.0f}s" if nan is not None else "")
    return row, times


def section(names: list[str]) -> str:
    """The page's section: the table and how it was made."""
    rows, times = zip(*(_row(n) for n in names), strict=True)
    lines = [
        START,
        "## Foreign-code corpus",
        "",
        "Other projects' LightningModules, each trained the way its library's docs do, on data made on the spot by",
        "the library's own generators or by `tests/foreign/corpus.py` (no download), with `GradientFlowMonitor`,",
        "`AnomalyAlarm`, `AttentionEntropyMonitor`, `DataDiagnostics` and `SystemMonitor` attached as a new user",
        "would (`lightning_diag.lightning` for libraries on the unified `lightning` package). Regenerate with",
        "`python benchmarks/foreign_corpus.py --write docs/detection.md`; `tests/foreign/` asserts it (marked `slow`).",
        "",
        "*Loss*: the mean training loss of the first and the last 5 steps. *Alerts*: the warning and critical",
        "alerts of the healthy run, by rule (the wall-clock rules of `SystemMonitor`,",
        ", ".join(f"`{r}`" for r in TIMING_RULES) + ", follow the machine's load, not the model: listed",
        "here, not asserted by the tests). *NaN stopped*: the",
        "default callbacks, a NaN injected at one step into the output of the first `nn.Linear` that runs",
        "(`forward`) or into its gradient only (`grad`: pytorch-forecasting replaces a non-finite loss by a constant",
        "1e9 without a graph, and then its own backward raises, with or without any callback; neuralforecast's",
        "`training_step` raises on a NaN loss itself; scvi-tools' distributions reject NaN parameters); *yes* when a",
        "critical alert came at that step, `fit` returned, and the parameters are bitwise those before the step",
        "(the fit ends one step later; pytorch-tabular's `min_epochs=1` makes Lightning ignore the stop request",
        "until the epoch or `max_steps` ends, every update dropped until then).",
        "",
        "| library | version | model | steps | loss start → end | alerts (healthy run) | attention seen "
        "| NaN stopped |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Run times (healthy + NaN run, one thread): " + ", ".join(t for t in times if t) + ".",
        "",
        "`tests/foreign/test_foreign_corpus.py` asserts zero warnings on each healthy run; the models on which a",
        "rule fires are `xfail(strict=True)` there with the rule named (`QUIET_XFAIL`, `ATTENTION_XFAIL`), so a",
        "rule fix that quiets one turns its case into a failure until the mark is removed.",
        END,
    ]
    return "\n".join(lines) + "\n"


def _splice(path: str, text: str) -> None:
    page = ""
    if os.path.exists(path):
        with open(path) as f:
            page = f.read()
    if START in page and END in page:
        before, rest = page.split(START, 1)
        page = before + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + text
    with open(path, "w") as f:
        f.write(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(ENTRIES), help="run only these models")
    parser.add_argument("--write", default=None, help="also replace the section of this page (docs/detection.md)")
    args = parser.parse_args(argv)
    text = section(args.only or list(ENTRIES))
    print(text)
    if args.write:
        _splice(args.write, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
