"""Detection matrix of the faults that need several processes: replicas that drift apart under DDP and under
tensor parallelism (2 gloo processes on CPU each), measured by running the scripts the tests run.

    python benchmarks/multiprocess_matrix.py                             # print the markdown table
    python benchmarks/multiprocess_matrix.py --write docs/detection.md   # replace the marked section of the page

Each case runs ``tests/callbacks/ddp_desync_script.py`` or ``tests/callbacks/sharded_desync_script.py`` in a fresh
directory (``AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 2}})``, 8 steps; the early checks after steps 1, 2
and 4 are the defaults' too) and reads back every rank's alerts, the checks made and the largest difference seen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "callbacks"
COMMAND = "PYTHONPATH=. .venv/bin/python benchmarks/multiprocess_matrix.py --write docs/detection.md"
START, END = "<!-- multiprocess:start -->", "<!-- multiprocess:end -->"
RULE = "ddp_desync"


@dataclasses.dataclass(frozen=True)
class Case:
    """One two-process run: the script, its arguments, what goes wrong and from which step."""

    name: str
    description: str
    model: str
    script: str
    args: tuple[str, ...]
    result: str
    onset_step: int | None = None

    @property
    def healthy(self) -> bool:
        return self.onset_step is None


CASES = (
    Case(
        "ddp_perturb",
        "one DDP rank's weights changed outside the optimizer (rank 1's `last.weight` + 1e-3 after step 3)",
        "2-layer MLP, DDP, 2 ranks",
        "ddp_desync_script.py",
        ("perturb",),
        "perturb{rank}.json",
        onset_step=3,
    ),
    Case(
        "ddp_nosync",
        "gradients never all-reduced (a DDP communication hook that returns each rank's own gradient: a model never "
        "wrapped, or DDP's hooks lost by a conversion after wrapping; pytorch #104336)",
        "2-layer MLP, DDP, 2 ranks",
        "ddp_desync_script.py",
        ("nosync",),
        "nosync{rank}.json",
        onset_step=1,
    ),
    Case(
        "tp_clip_local",
        "gradient clipping by each tensor-parallel rank's own shards (BLOOM-176B / DeepSpeed PR 1801): the plain "
        "LayerNorm's copies drift",
        "TP MLP with a plain LayerNorm, `ModelParallelStrategy` (1 x 2), SGD",
        "sharded_desync_script.py",
        ("tpln", "clip"),
        "tpln-clip{rank}.json",
        onset_step=1,
    ),
    Case(
        "ddp_healthy",
        "the DDP run unperturbed",
        "2-layer MLP, DDP, 2 ranks",
        "ddp_desync_script.py",
        ("healthy",),
        "healthy{rank}.json",
    ),
    Case(
        "tp_healthy",
        "the tensor-parallel model without the bug",
        "TP MLP with a plain LayerNorm, `ModelParallelStrategy` (1 x 2), SGD",
        "sharded_desync_script.py",
        ("tpln", "healthy"),
        "tpln-healthy{rank}.json",
    ),
)


@dataclasses.dataclass
class Outcome:
    """What every rank of one case reported."""

    case: Case
    ranks: list[dict[str, Any]]
    seconds: float
    error: str = ""

    def first(self, rank: dict[str, Any]) -> dict[str, Any] | None:
        hits = [a for a in rank.get("alerts", []) if a["rule"] == RULE]
        return min(hits, key=lambda a: a["global_step"]) if hits else None

    def warnings(self) -> list[dict[str, Any]]:
        return [a for rank in self.ranks for a in rank.get("alerts", []) if a.get("severity") != "info"]

    def caught(self) -> bool:
        firsts = [self.first(r) for r in self.ranks]
        return bool(self.ranks) and all(f is not None for f in firsts)

    def cell(self) -> str:
        if self.error:
            return f"run failed: {self.error}"
        firsts = [self.first(r) for r in self.ranks]
        found = [f for f in firsts if f is not None]
        if not found:
            return "nothing"
        a = found[0]
        steps = sorted({f["global_step"] for f in found})
        after = f", +{a['global_step'] - self.case.onset_step} steps" if self.case.onset_step is not None else ""
        where = "on every rank" if len(found) == len(self.ranks) else f"on {len(found)} of {len(self.ranks)} ranks"
        return f"**`{RULE}`** step {', '.join(map(str, steps))}{after}, {where}, naming `{a['source']}`"


def run_case(case: Case, root: Path) -> Outcome:
    """Run one case's script in ``root`` and read back every rank's results."""
    root.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / case.script), str(root), *case.args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=root,
    )
    seconds = time.perf_counter() - start
    ranks = []
    for rank in range(2):
        path = root / case.result.format(rank=rank)
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    error = "" if proc.returncode == 0 and len(ranks) == 2 else (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
    return Outcome(case, ranks, seconds, error)


def section(outcomes: list[Outcome]) -> str:
    """The marked section of ``docs/detection.md``."""
    faults = [o for o in outcomes if not o.case.healthy]
    healthy = [o for o in outcomes if o.case.healthy]
    caught = sum(o.caught() for o in faults)
    alarms = sum(len(o.warnings()) for o in healthy)
    lines = [
        START,
        "Measured by running the two-process scripts of the tests (2 gloo ranks on CPU, 8 steps,",
        '`AnomalyAlarm(rules={"ddp_desync": {"every_n_steps": 2}})`; the checks after steps 1, 2 and 4 are the',
        f"defaults' too). Reproduce (about {max(1, round(sum(o.seconds for o in outcomes) / 60))} minutes):",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        f"Result: **{caught} of {len(faults)} faults caught** on every rank; **{alarms} warning/critical alerts on the "
        f"{len(healthy)} healthy runs** (target: none). The Lightning comparison tools are not run here: none of them "
        "compares replicas.",
        "",
        "| fault | model | onset | expected | lightning_diag (first alert, all ranks) | caught | onset to alert "
        "| checks |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in faults:
        first = [o.first(r) for r in o.ranks]
        steps = [f["global_step"] for f in first if f is not None]
        delay = f"+{max(steps) - o.case.onset_step} steps" if steps and o.case.onset_step is not None else "-"
        checks = ", ".join(str(r.get("checks")) for r in o.ranks)
        lines.append(
            f"| `{o.case.name}`: {o.case.description} | {o.case.model} | step {o.case.onset_step} | `{RULE}` | "
            f"{o.cell()} | {'yes' if o.caught() else '**no**'} | {delay} | {checks} |"
        )
    lines += [
        "",
        "| healthy run | model | lightning_diag warnings/criticals (target: none) | checks | largest difference |",
        "|---|---|---|---|---|",
    ]
    for o in healthy:
        warns = "; ".join(f"`{a['rule']}` step {a['global_step']}" for a in o.warnings()) or "none"
        if o.error:
            warns = f"run failed: {o.error}"
        checks = ", ".join(str(r.get("checks")) for r in o.ranks)
        diff = max((float(r.get("max_diff") or 0.0) for r in o.ranks), default=0.0)
        lines.append(f"| `{o.case.name}`: {o.case.description} | {o.case.model} | {warns} | {checks} | {diff:.3g} |")
    times = ", ".join(f"{o.case.name} {o.seconds:.0f}s" for o in outcomes)
    lines += ["", f"Run times: {times}.", END]
    return "\n".join(lines) + "\n"


def splice(path: str, text: str) -> None:
    """Replace the marked section of the page at ``path`` (append it when the page has no markers)."""
    page = Path(path).read_text() if os.path.exists(path) else ""
    if START in page and END in page:
        before, rest = page.split(START, 1)
        page = before + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        page = page.rstrip("\n") + "\n\n" + text
    Path(path).write_text(page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", choices=[c.name for c in CASES], help="run only these")
    parser.add_argument("--write", default=None, help="also write the section into this page (docs/detection.md)")
    parser.add_argument("--root", default=None, help="directory for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    root = Path(args.root or tempfile.mkdtemp(prefix="multiprocess_matrix_"))
    outcomes = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        outcomes.append(run_case(case, root / case.name))
        print(f"{case.name}: {outcomes[-1].cell()} ({outcomes[-1].seconds:.0f}s)", file=sys.stderr)
    text = section(outcomes)
    print(text)
    if args.write:
        splice(args.write, text)
    failed = [o.case.name for o in outcomes if o.error or (not o.case.healthy and not o.caught())]
    failed += [o.case.name for o in outcomes if o.case.healthy and o.warnings()]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
