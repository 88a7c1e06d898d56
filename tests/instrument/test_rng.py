"""The one RNG save/restore helper (issue 20): every generator back as it was, device generators included."""

import random

import numpy as np
import pytest
import torch

from lightning_diag.instrument import rng as rng_module
from lightning_diag.instrument.rng import RngState, device_generators, preserved_rng


def _draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def test_preserved_rng_leaves_every_global_generator_unchanged():
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    expected = _draws()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    with preserved_rng():
        _draws(), _draws()
    assert _draws() == expected


def test_preserved_rng_restores_when_the_block_raises():
    state = torch.get_rng_state()
    python = random.getstate()
    with pytest.raises(RuntimeError), preserved_rng():
        torch.rand(5), random.random()
        raise RuntimeError("boom")
    assert torch.equal(state, torch.get_rng_state()) and python == random.getstate()


def test_python_false_leaves_random_and_numpy_to_the_block():
    random.seed(1)
    with preserved_rng(python=False):
        random.random()
    after = random.random()
    random.seed(1)
    random.random()
    assert random.random() == after


def test_no_device_generator_is_read_on_a_cpu_run():
    _device_type, devices = device_generators()
    if not torch.cuda.is_available():
        assert devices == []
    with preserved_rng():
        torch.rand(1)
    if torch.cuda.is_available() and not devices:
        assert not torch.cuda.is_initialized()  # saving never initialises CUDA


class _FakeDevices:
    """A two-device accelerator module with the generator API torch's device modules have."""

    def __init__(self):
        self.states = {0: torch.tensor([1, 2], dtype=torch.uint8), 1: torch.tensor([3, 4], dtype=torch.uint8)}

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def device_count(self):
        return 2

    def get_rng_state(self, device=0):
        return self.states[int(device)].clone()

    def set_rng_state(self, state, device=0):
        self.states[int(device)] = state.clone()


@pytest.fixture
def fake_accelerator(monkeypatch):
    fake = _FakeDevices()
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module", lambda kind=None: fake if kind == "cuda" else real(kind))
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    return fake


def test_every_device_generator_is_saved_and_restored(fake_accelerator):
    assert device_generators() == ("cuda", [0, 1])
    with preserved_rng():
        fake_accelerator.states[0] = torch.tensor([9, 9], dtype=torch.uint8)
        fake_accelerator.states[1] = torch.tensor([8, 8], dtype=torch.uint8)
    assert fake_accelerator.states[0].tolist() == [1, 2] and fake_accelerator.states[1].tolist() == [3, 4]
    state = RngState.capture(python=False)
    fake_accelerator.states[1] = torch.tensor([7, 7], dtype=torch.uint8)
    state.restore()
    assert fake_accelerator.states[1].tolist() == [3, 4]


def test_rng_state_rewinds_torch_and_optionally_python():
    state = RngState.capture()
    first = _draws()
    state.restore()
    assert _draws() == first
    partial = RngState.capture(python=False)
    assert partial.python is None and partial.numpy is None


def test_the_three_former_copies_use_the_helper():
    import inspect

    from lightning_diag.callbacks.data_diagnostics import batch as data_batch
    from lightning_diag.callbacks.probes import probe
    from lightning_diag.instrument import nonfinite_locate

    for module in (probe, data_batch, nonfinite_locate):
        source = inspect.getsource(module)
        assert "preserved_rng" in source, module.__name__
        assert "get_rng_state" not in source and "random.getstate" not in source, module.__name__
    assert nonfinite_locate.RngState is rng_module.RngState


def test_capture_uses_the_generators_it_is_given(fake_accelerator):
    # A per-step caller passes what device_generators() said at the fit's start: only those are copied.
    state = RngState.capture(python=False, generators=("cuda", [1]))
    assert list(state.devices) == [1]
    fake_accelerator.states[0] = torch.tensor([9, 9], dtype=torch.uint8)
    fake_accelerator.states[1] = torch.tensor([8, 8], dtype=torch.uint8)
    state.restore()
    assert fake_accelerator.states[0].tolist() == [9, 9] and fake_accelerator.states[1].tolist() == [3, 4]
