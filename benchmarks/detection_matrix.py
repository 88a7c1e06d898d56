"""Detection matrix: every fault and every healthy baseline of the fault library, with the default callbacks,
side by side with what Lightning users have: ``EarlyStopping(check_finite=True)``, ``SpikeDetection`` and
``Trainer(detect_anomaly=True)``, each in its own real run.

    python benchmarks/detection_matrix.py                       # print the markdown tables
    python benchmarks/detection_matrix.py --write docs/detection.md
    python benchmarks/detection_matrix.py --only nan --only healthy_gru --max-epochs 2   # a quick subset

The lightning_diag column uses ``lightning_diag.demo.run.default_callbacks()``, so a callback added there is in
the matrix at the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl

from lightning_diag.alerts import ALL_RULES, Alert
from lightning_diag.demo.faults import FAULTS, Fault, build_fault
from lightning_diag.demo.run import default_callbacks, quiet, run_demo

try:  # SpikeDetection is in pytorch_lightning >= 2.2 (experimental); older versions lack it
    from pytorch_lightning.callbacks import SpikeDetection
except ImportError:  # pragma: no cover - depends on the installed Lightning
    SpikeDetection = None  # type: ignore[assignment,misc]

COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/detection_matrix.py --write docs/detection.md"


@dataclasses.dataclass
class Outcome:
    """What one comparison run did: the step/epoch it stopped or raised at, and why."""

    detected: bool
    step: int | None = None
    epoch: int | None = None
    reason: str = ""

    def cell(self, fault: Fault) -> str:
        if not self.detected:
            return f"no{f' ({self.reason})' if self.reason else ''}"
        return f"yes, step {self.step} (epoch {self.epoch}){_after(fault, self.step, self.epoch)}: {self.reason}"


def _after(fault: Fault, step: int | None, epoch: int | None) -> str:
    if fault.onset_step is not None and step is not None:
        return f", +{step - fault.onset_step} steps"
    if fault.onset_epoch is not None and epoch is not None:
        return f", +{epoch - fault.onset_epoch} epochs"
    return ""


def _trainer(root: str, fault: Fault, max_epochs: int | None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        max_epochs=max_epochs or fault.max_epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=5,
        accelerator="cpu",
        deterministic=True,
        **kwargs,
    )


def _fit(
    name: str, root: str, max_epochs: int | None, callbacks: list[Any], seed: int = 0, **kwargs: Any
) -> tuple[pl.Trainer, BaseException | None]:
    model, data, fault = build_fault(name, seed=seed)
    pl.seed_everything(seed, verbose=False)
    trainer = _trainer(root, fault, max_epochs, callbacks=callbacks, **kwargs)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # the comparison tools stop a run by raising
        return trainer, err
    return trainer, None


def early_stopping(name: str, root: str, max_epochs: int | None) -> Outcome:
    """``EarlyStopping(monitor="val_loss", check_finite=True)`` with its defaults (patience 3)."""
    from pytorch_lightning.callbacks import EarlyStopping

    es = EarlyStopping(monitor="val_loss", check_finite=True)
    trainer, err = _fit(name, root, max_epochs, [es])
    if err is not None:
        return Outcome(True, trainer.global_step, trainer.current_epoch, f"raised {type(err).__name__}")
    reason = getattr(es, "stopping_reason", None)
    if not es.stopped_epoch:
        return Outcome(False)
    why = {"NON_FINITE_METRIC": "val_loss not finite", "PATIENCE_EXHAUSTED": "val_loss stopped improving"}.get(
        str(getattr(reason, "name", reason)), str(reason)
    )
    return Outcome(True, trainer.global_step, es.stopped_epoch, f"stopped, {why}")


def spike_detection(name: str, root: str, max_epochs: int | None) -> Outcome:
    """Lightning's ``SpikeDetection()`` with its defaults (window 10, rtol 2, non-finite losses count)."""
    if SpikeDetection is None:
        return Outcome(False, reason="not in the installed pytorch_lightning")
    spike = SpikeDetection(exclude_batches_path=os.path.join(root, "skip_batches.json"))
    trainer, err = _fit(name, root, max_epochs, [spike])
    if err is None:
        return Outcome(False)
    if type(err).__name__ != "TrainingSpikeException":
        raise err
    # raised in on_train_batch_end, after the optimizer step of the batch counted in global_step
    return Outcome(True, trainer.global_step - 1, trainer.current_epoch, "TrainingSpikeException")


def detect_anomaly(name: str, root: str, max_epochs: int | None) -> Outcome:
    """``Trainer(detect_anomaly=True)``: autograd anomaly mode raises on a NaN produced in backward."""
    trainer, err = _fit(name, root, max_epochs, [], detect_anomaly=True)
    if err is None:
        return Outcome(False)
    if not isinstance(err, RuntimeError):
        raise err
    return Outcome(True, trainer.global_step, trainer.current_epoch, "RuntimeError from autograd")


@dataclasses.dataclass
class Row:
    """One entry of the fault library with every tool's result."""

    fault: Fault
    alerts: list[Alert]
    steps: int
    seconds: float
    comparisons: dict[str, Outcome]
    callbacks: list[str]

    @property
    def serious(self) -> list[Alert]:
        return [a for a in self.alerts if a.severity != "info"]

    def first(self) -> dict[str, Alert]:
        out: dict[str, Alert] = {}
        for a in self.serious:
            out.setdefault(a.rule, a)
        return out

    def caught(self) -> bool:
        """Every expected rule fired within the fault's documented window."""
        first = self.first()
        for rule in self.fault.expected_rules:
            if rule not in first:
                return False
            a = first[rule]
            if self.fault.onset_step is not None and a.global_step > self.fault.onset_step + self.fault.window:
                return False
            if self.fault.onset_epoch is not None and a.epoch > self.fault.onset_epoch + self.fault.window:
                return False
        return True

    def ours(self) -> str:
        first = self.first()
        if not first:
            return "nothing"
        cells = []
        for rule, a in first.items():
            mark = "**" if rule in self.fault.expected_rules else ""
            cells.append(f"{mark}`{rule}`{mark} step {a.global_step}{_after(self.fault, a.global_step, a.epoch)}")
        return "; ".join(cells)

    def verdict(self) -> str:
        if self.caught():
            return "yes"
        missing = [r for r in self.fault.expected_rules if ALL_RULES.get(r) not in self.callbacks]
        if missing:
            return f"no: {', '.join(ALL_RULES[r] for r in missing)} is not in `default_callbacks()` yet"
        return "**no**"


COMPARISONS: dict[str, Callable[[str, str, int | None], Outcome]] = {
    "EarlyStopping(check_finite=True)": early_stopping,
    "SpikeDetection": spike_detection,
    "detect_anomaly=True": detect_anomaly,
}


def run_entry(name: str, root: str, max_epochs: int | None, comparisons: bool) -> Row:
    """Run one fault (or baseline) with the default callbacks, then each comparison tool."""
    callbacks = default_callbacks()
    t0 = time.perf_counter()
    result = run_demo(name, max_epochs=max_epochs, root=os.path.join(root, "diag"), callbacks=callbacks)
    seconds = time.perf_counter() - t0
    outcomes = {}
    if comparisons:
        for label, tool in COMPARISONS.items():
            sub = os.path.join(root, label.split("(")[0].split("=")[0], name)
            outcomes[label] = tool(name, sub, max_epochs)
    return Row(
        FAULTS[name], result.alerts, result.global_step, seconds, outcomes, [type(c).__name__ for c in callbacks]
    )


def _onset(fault: Fault) -> str:
    if fault.onset_step is not None:
        return f"step {fault.onset_step} (window {fault.window} steps)"
    if fault.onset_epoch is not None:
        return f"epoch {fault.onset_epoch} (window {fault.window} epochs)"
    return "-"


def render(rows: list[Row]) -> str:
    """The two markdown tables: faults, then healthy baselines."""
    labels = list(COMPARISONS) if rows and rows[0].comparisons else []
    out = []
    faults = [r for r in rows if not r.fault.healthy]
    healthy = [r for r in rows if r.fault.healthy]
    if faults:
        head = ["fault", "model", "onset", "expected", "lightning_diag (first alert of each rule)", "caught", *labels]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in faults:
            cells = [
                f"`{r.fault.name}`",
                r.fault.model,
                _onset(r.fault),
                ", ".join(f"`{x}`" for x in r.fault.expected_rules),
                r.ours(),
                r.verdict(),
                *(r.comparisons[label].cell(r.fault) for label in labels),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if healthy:
        head = ["healthy baseline", "model", "steps", "lightning_diag warnings/criticals (target: none)", *labels]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in healthy:
            alerts = "; ".join(f"`{a.rule}` step {a.global_step}" for a in r.serious) or "none"
            cells = [f"`{r.fault.name}`", r.fault.model, str(r.steps), alerts]
            cells += [r.comparisons[label].cell(r.fault) for label in labels]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def page(rows: list[Row], seconds: float) -> str:
    """``docs/detection.md``."""
    names = sorted({c for r in rows for c in r.callbacks})
    spike = (
        "`pytorch_lightning.callbacks.SpikeDetection` (experimental, in the installed version)"
        if SpikeDetection is not None
        else "`SpikeDetection` is **not** in the installed pytorch_lightning: its column says so"
    )
    caught = sum(r.caught() for r in rows if not r.fault.healthy)
    n_faults = sum(not r.fault.healthy for r in rows)
    alarms = sum(len(r.serious) for r in rows if r.fault.healthy)
    return f"""# Detection matrix

Every fault of the fault library (`lightning_diag/demo/faults.py`) and every healthy baseline, trained with
`lightning_diag.demo.run.default_callbacks()` (here: {", ".join(f"`{n}`" for n in names)}), and, in separate
real runs of the same model, data and seed, with what a Lightning user has today:

* `EarlyStopping(monitor="val_loss", check_finite=True)` with its defaults (patience 3): stops when `val_loss`
  is not finite, or after 3 validation runs without improvement.
* {spike}, defaults (running mean over 10 batches, `rtol=2`, non-finite losses count as spikes): raises
  `TrainingSpikeException`.
* `Trainer(detect_anomaly=True)`: autograd anomaly mode raises a `RuntimeError` when backward produces a NaN.

Reproduce (about {max(1, round(seconds / 60))} minutes on a 2-core CPU, one thread per run):

```bash
{COMMAND}
```

Result: **{caught} of {n_faults} faults caught** by their expected rule within the documented window;
**{alarms} warning/critical alerts on the healthy baselines** (target: none).

"Step" is the global step of the first alert (or of the stop); "+N" counts from the fault's onset. The expected
rule is in bold; other rules that fired on a fault are listed too (a fault often has several symptoms).

{render(rows)}
## Reading the comparison columns

* `EarlyStopping(check_finite=True)` sees a non-finite value only once it reaches `val_loss`, at the end of the
  epoch, after the NaN update has already been applied to the weights. Its patience stop is a generic "no
  improvement" signal, not a diagnosis.
* `SpikeDetection` looks at the training loss only and raises when it jumps to 3x its running mean: it stops
  non-finite losses at the step and faults whose loss jumps, but says nothing about the cause, cannot see a
  fault that leaves the loss smooth (a frozen layer, vanishing gradients), and raises on healthy runs whose
  loss has fallen near zero, where ordinary batch-to-batch noise is a 3x "spike".
* `detect_anomaly=True` raises only when backward produces a NaN, and slows every step several times over
  (see `docs/performance.md`).
* A fault whose expected rule belongs to a callback missing from `default_callbacks()` would read "no: ... is
  not in `default_callbacks()` yet".
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=sorted(FAULTS), help="run only these entries")
    parser.add_argument("--max-epochs", type=int, default=None, help="override every entry's epochs")
    parser.add_argument("--no-comparisons", action="store_true", help="skip the Lightning comparison runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: fastest for tiny models)")
    parser.add_argument("--write", default=None, help="also write the page (docs/detection.md) here")
    parser.add_argument("--root", default=None, help="directory for the runs' logs (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.max_epochs is not None and args.max_epochs < 1:
        parser.error("--max-epochs must be >= 1")
    with quiet(args.threads):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    root = args.root or tempfile.mkdtemp(prefix="detection_matrix_")
    names = args.only or [n for n, f in FAULTS.items() if not f.healthy] + [n for n, f in FAULTS.items() if f.healthy]
    t0 = time.perf_counter()
    rows = []
    try:
        for name in names:
            rows.append(run_entry(name, os.path.join(root, name), args.max_epochs, not args.no_comparisons))
            print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {rows[-1].ours()}", file=sys.stderr)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(render(rows))
    if args.write:
        with open(args.write, "w") as f:
            f.write(page(rows, time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
