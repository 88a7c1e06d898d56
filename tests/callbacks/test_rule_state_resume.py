"""Resuming from a checkpoint of an earlier release, whose callback state lacks a rule declared since."""

from __future__ import annotations

import logging

import pytest
import pytorch_lightning as pl
import torch

from lightning_diag import DataDiagnostics, GradientFlowMonitor
from lightning_diag.rules.updates import UpdateRule
from tests.callbacks.tiny import FAST, TinyAttention


def _fit(tmp_path, callback, max_steps, ckpt_path=None):
    trainer = pl.Trainer(
        max_steps=max_steps,
        default_root_dir=tmp_path,
        callbacks=[callback],
        logger=False,
        limit_val_batches=0,
        **FAST,
    )
    trainer.fit(TinyAttention(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize(
    ("factory", "dropped", "attribute"),
    [
        (lambda: GradientFlowMonitor(log_every_n_steps=2), "updates", "update_rule"),
        (DataDiagnostics, "sequences", "sequence_rules"),
    ],
)
def test_missing_rule_state_starts_fresh(tmp_path, caplog, factory, dropped, attribute):
    torch.set_num_threads(1)
    first = factory()
    trainer = _fit(tmp_path / "a", first, max_steps=4)
    ckpt = tmp_path / "old.ckpt"
    trainer.save_checkpoint(ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    state = checkpoint["callbacks"][first.state_key]
    kept = sorted(k for k in state if k != dropped)
    del state[dropped]  # what a checkpoint of the release before that rule holds
    torch.save(checkpoint, ckpt)

    loaded: list[str] = []
    resumed = factory()
    original = resumed.load_rules_state_dict

    def spy(rule_state):
        original(rule_state)
        loaded.append(type(getattr(resumed, attribute)).__name__)

    resumed.load_rules_state_dict = spy  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="lightning_diag"):
        _fit(tmp_path / "b", resumed, max_steps=8, ckpt_path=str(ckpt))
    notes = [r for r in caplog.records if "no state for the rules" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO and dropped in notes[0].getMessage()
    assert loaded, "the checkpoint's callback state was not loaded"
    assert sorted(k for k in resumed.state_dict() if k != dropped) == kept  # every other key loaded
    assert dropped in resumed.state_dict()  # and the missing rule is there again, built afresh


def test_missing_rule_state_rebuilds_that_rule_only():
    monitor = GradientFlowMonitor()
    state = monitor.state_dict()
    del state["updates"]
    resumed = GradientFlowMonitor()
    stale = resumed.update_rule
    resumed.load_state_dict(state)
    assert isinstance(resumed.update_rule, UpdateRule) and resumed.update_rule is not stale
    assert resumed.update_rule.state_dict() == UpdateRule.from_settings(resumed.thresholds()).state_dict()
