"""The calibration harness's oracle for ``dataloader_bound`` (benchmarks/calibration_oracle.py): it reads a
slow-collation loader as loader-bound and an in-memory one as not, and the harness's table counts a healthy run
the oracle finds loader-bound as a finding to catch, not as a false alarm."""

from __future__ import annotations

import time
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from benchmarks import calibration as cal
from benchmarks import calibration_oracle as oracle
from benchmarks.calibration_plan import RunSpec, execute
from lightning_diag.rules.dataloader_bound import DATALOADER_BOUND, DEFAULT_DATALOADER_BOUND_THRESHOLD

THR = DEFAULT_DATALOADER_BOUND_THRESHOLD


class _Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _slow_collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(0.02)  # 20 ms of collation a batch in the main process: the step (about 1 ms) waits for it
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _fitted(loader: Any, tmp_path: Any) -> pl.Trainer:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        default_root_dir=str(tmp_path), max_steps=6, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", log_every_n_steps=5,
    )  # fmt: skip
    trainer.fit(_Regressor(), train_dataloaders=loader)
    return trainer


def _data(n: int = 256) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 64, generator=gen), torch.randn(n, generator=gen))


def test_the_oracle_reads_a_slow_collation_loader_as_loader_bound(tmp_path: Any) -> None:
    loader = torch.utils.data.DataLoader(_data(), batch_size=32, collate_fn=_slow_collate)
    measured = oracle.data_share(_fitted(loader, tmp_path))
    assert "error" not in measured, measured
    assert measured["batches"] == 8 and measured["workers"] == 0  # an epoch of 8 batches: all of it read
    assert measured["data_s"] >= 0.02  # the sleep is a floor of the collation, whatever the machine's load
    assert measured["share"] > 0.5, measured
    record = {"oracle": {DATALOADER_BOUND: measured}}
    assert oracle.verdict(record, DATALOADER_BOUND, THR) == oracle.TRUE_FINDING


def test_the_oracle_lets_workers_prefetch_while_the_step_computes(tmp_path: Any) -> None:
    """With workers the loader is read again with the step's compute time between two batches: two workers that
    each take 20 ms a batch still cannot feed a 1 ms step (about 10 ms a batch, plus their start each epoch)."""
    loader = torch.utils.data.DataLoader(_data(), batch_size=32, collate_fn=_slow_collate, num_workers=2)
    measured = oracle.data_share(_fitted(loader, tmp_path))
    assert "error" not in measured, measured
    assert measured["workers"] == 2 and measured["batches"] == 8
    assert measured["data_s"] >= 0.005 and measured["share"] > 0.5, measured


def test_the_oracle_reads_an_in_memory_loader_as_not_loader_bound(tmp_path: Any) -> None:
    data = _data()
    batches = [(data.tensors[0][i : i + 32], data.tensors[1][i : i + 32]) for i in range(0, 256, 32)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)  # collated already: nothing to wait for
    measured = oracle.data_share(_fitted(loader, tmp_path))
    assert "error" not in measured, measured
    assert measured["share"] < 0.15, measured
    assert oracle.verdict({"oracle": {DATALOADER_BOUND: measured}}, DATALOADER_BOUND, THR) == oracle.QUIET


def test_the_oracle_reports_what_it_cannot_measure(tmp_path: Any) -> None:
    class _NoLoader:
        def __init__(self) -> None:
            self.train_dataloader = {"a": [], "b": []}  # two loaders: which one the step waits for is unknown
            self.num_training_batches = 2

    assert "not one train dataloader" in oracle.data_share(_NoLoader())["error"]


def _record(
    key: str, share: float | None, alarm: bool, peak: float, data_s: float = 0.02, severity: str = "warning"
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "spec": {"key": key, "kind": "fault", "name": "none", "family": "baselines", "expected": [],
                 "onset_step": None, "onset_epoch": None, "epoch_len": None, "length_check": False},
        "alerts": [{"rule": DATALOADER_BOUND, "severity": severity, "step": 15, "epoch": 0, "value": 0.5}]
        if alarm else [],
        "peaks": {DATALOADER_BOUND: peak},
        "watched": [DATALOADER_BOUND],
    }  # fmt: skip
    if share is not None:
        record["oracle"] = {DATALOADER_BOUND: {"share": share, "data_s": data_s, "compute_s": 0.01}}
    return record


def test_rule_row_counts_the_oracles_findings_as_detections_and_misses() -> None:
    records = [
        _record("found_caught", 0.6, True, 2.4),  # oracle 2.4x the threshold, the rule fired: a detection
        _record("found_missed", 0.5, False, 0.9),  # oracle 2x, the rule quiet: a miss
        _record("found_contended", 0.5, True, 0.0, severity="info"),  # an info on a busy machine: neither
        _record("near", 0.27, True, 1.1),  # oracle 1.08x: ambiguous, neither a false alarm nor a detection
        _record("tiny_wait", 0.6, True, 1.3, data_s=0.001),  # under the rule's min_wait_s: quiet by contract
        _record("quiet", 0.05, False, 0.4),
        _record("unmeasured", None, False, 0.3),  # an older record: judged by its label, as before
    ]
    row = cal.rule_row(DATALOADER_BOUND, records)
    assert row["healthy"] == 7 and row["measured"] == 7
    assert row["false_alarm_runs"] == ["tiny_wait"]
    assert row["oracle"]["measured"] == 6
    assert (row["oracle"]["caught"], row["oracle"]["missed"]) == (["found_caught"], ["found_missed"])
    assert row["oracle"]["contended"] == ["found_contended"]
    assert row["oracle"]["ambiguous"] == ["near"]
    assert row["oracle"]["excess"]["found_caught"] == pytest.approx(0.6 / THR)
    # the margin is the quiet runs' only: the findings' and the ambiguous run's peaks are not a healthy margin
    assert (row["margin"], row["margin_run"]) == (1.3, "tiny_wait")
    # a rule without an oracle keeps counting every alarm of a healthy run, whatever the records hold
    assert cal.rule_row("grad_explode", records)["oracle"] is None


def test_the_table_and_the_findings_show_the_oracle() -> None:
    records = [_record("found_caught", 0.6, True, 2.4), _record("found_missed", 0.5, False, 0.9),
               _record("near", 0.27, True, 1.1), _record("quiet", 0.05, True, 1.2),
               _record("found_contended", 0.5, True, 0.0, severity="info")]  # fmt: skip
    rows = cal.table(records, [DATALOADER_BOUND])
    line = cal.render(rows, {DATALOADER_BOUND: THR}).splitlines()[2]
    assert cal.is_table_line(line, 7 + len(cal.EPOCH_LENGTHS))
    assert "**1**: `quiet`" in line
    assert (
        "**1 / 3 healthy runs the oracle finds (1 said as an info on a contended machine)** (missed: `found_missed`)"
        in line
    )
    quiet_only = cal.render(cal.table(records[3:4], [DATALOADER_BOUND]), {DATALOADER_BOUND: THR})
    assert "; no healthy run the oracle finds" in quiet_only
    note = "\n".join(cal.oracle_note(rows, records))
    assert "5 of 5 healthy runs measured" in note and "`found_caught` (oracle 2.40: share 60%" in note
    assert "ambiguous, counted neither way): 1: `near`" in note
    found = "\n".join(cal.findings(records, [DATALOADER_BOUND], {DATALOADER_BOUND: THR}))
    assert "- detection (the oracle agrees): `dataloader_bound` on `found_caught`" in found
    assert "- missed: `dataloader_bound` on `found_missed` (healthy, but its oracle reads 2.00" in found
    assert "- ambiguous alarm: `dataloader_bound` on `near`" in found
    assert "- said as an info on a contended machine: `dataloader_bound` on `found_contended`" in found
    assert "- false alarm: `dataloader_bound` on `quiet`" in found and "oracle 0.20 of the threshold" in found


def test_a_healthy_harness_run_records_its_oracle() -> None:
    spec = RunSpec("test:none", "fault", "none", "baselines", epoch_len=4, n_train=128, batch_size=32,
                   limit_batches=4, max_epochs=2, optin=("SystemMonitor",))  # fmt: skip
    record = execute(spec)
    assert "error" not in record, record.get("trace")
    measured = record["oracle"][DATALOADER_BOUND]
    assert measured["batches"] == 4 and measured["compute_s"] > 0, measured
    # the fault library's synthetic data are tensors in memory: the step does not wait for them
    assert oracle.verdict(record, DATALOADER_BOUND, THR) == oracle.QUIET
    # a fault of another rule gets no oracle
    fault = execute(RunSpec("test:nan", "fault", "nan", "faults", expected=("nonfinite_loss",), max_epochs=1,
                            optin=("SystemMonitor",)))  # fmt: skip
    assert "error" not in fault and "oracle" not in fault
