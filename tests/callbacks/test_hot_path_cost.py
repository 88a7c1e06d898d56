"""The per-step bookkeeping the quiet path does not repeat: the checkpoint key built once per set of arguments, one
copy of the loss shared by the loss sums and the run-time checks."""

from __future__ import annotations

import torch

from lightning_diag import AnomalyAlarm
from lightning_diag.stats.loss_sums import LossSums


def test_the_state_key_is_built_once_and_follows_its_arguments():
    alarm = AnomalyAlarm()
    first = alarm.state_key
    assert alarm.state_key is first  # Lightning reads it at every hook call: the cached string
    alarm.monitor = "other_metric"
    assert alarm.state_key != first and "other_metric" in alarm.state_key


def test_the_loss_sums_copy_is_shared_and_never_written():
    sums = LossSums(baseline_steps=2)
    loss = torch.tensor(1.5)
    sums.add(loss)
    copy = sums.latest
    assert copy is not None and copy is not loss and float(copy) == 1.5
    loss.add_(1.0)  # the caller's tensor changes; the copy does not
    for value in range(70):  # past a fold: the held copies are stacked, not written
        sums.add(torch.tensor(float(value)))
    assert float(copy) == 1.5
