"""The tensor work the default detectors need, and nothing else: the floor under their cost (issue 43).

:class:`FloorCallback` makes the operators the three default callbacks' detectors run on a step of the 1.1M MLP,
with no rule, no judgment, no logging and no Python bookkeeping beyond one cadence check a step:

* every step, the exact non-finite guard's pass as ``AnomalyAlarm``'s guard makes it on the CPU
  (``callbacks/anomaly_alarm/guard_pass.py``: each gradient's float32 sum read on the host, their magnitudes
  added up; the loss's likewise), before the optimizer step;
* every ``every``-th step (the measuring step, ``log_every_n_steps`` at the defaults):

  - before the optimizer step, the gradients' and the weights' norms in one multi-tensor kernel
    (``torch._foreach_norm``, as ``instrument/grad_measure.measure_step``), squared; the zero-gradient share of
    the weight of each layer that feeds a rectifier (``instrument/activation_watch._zero_share``); the weights
    copied into reused buffers (``torch._foreach_copy_``, as ``grad_measure.CopyBuffers``); one host read of the
    squares and shares (the guard reads the gradients' total from it: no separate pass then, as ``clean_measured``);
  - after the optimizer step, the updates' norms (``torch._foreach_sub_`` into the copies, one
    ``torch._foreach_norm``, as ``grad_measure.update_norms``) and one host read;

* with ``sampled`` (the second variant), every ``sampled``-th step the forward hooks of the sampled checks
  (``instrument/output_watch``: each module's output's ``aminmax`` over a NaN-free copy), and on the measuring
  step the activation watch's forward pre-hooks on the rectifiers (the share of dead units of each input,
  ``activation_watch._alive``), their statistics read with the measuring step's one host copy.

Left out: the sampled reads of 8 or 32 elements (``update_none``, ``update_stale``, ``grad_not_zeroed``; no pass
over a tensor), the histograms (every 10th measuring step), the first layer's input mean square (64 x 64).

What it computes is thrown away: it exists to be timed (``benchmarks/paired_share.py --variants floor``).
"""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytorch_lightning as pl
import torch
from torch import nn

__all__ = ["FloorCallback", "floor_ops"]


def _zero_share(grad: torch.Tensor) -> torch.Tensor:
    """The share of a gradient's elements that are exactly zero (as ``activation_watch._zero_share``)."""
    n = grad.numel()
    return (n - torch.count_nonzero(grad.bool())).float().div_(n)


def _dead_share(x: torch.Tensor) -> torch.Tensor:
    """The share of an input's units never positive over the batch (as ``activation_watch._alive``)."""
    return 1.0 - (torch.nan_to_num(x, nan=0.0).amax(0) > 0).float().mean()


class FloorCallback(pl.Callback):
    """The default detectors' tensor work on a step (see the module's docstring).

    Args:
        every: The measuring steps' period (the trainer's ``log_every_n_steps``); 0: none (the guard's pass alone,
            every step: the variant "floor guard").
        sampled: The sampled checks' period (their forward hooks); 0: none (the variant "floor").
    """

    def __init__(self, every: int = 10, sampled: int = 0) -> None:
        self.every = every
        self.sampled = sampled
        self.params: list[torch.Tensor] = []
        self.feeding_relu: list[torch.Tensor] = []
        self.relu_inputs: list[nn.Module] = []
        self.copies: list[torch.Tensor] = []
        self.weight_sq: torch.Tensor | None = None
        self.stats: list[torch.Tensor] = []
        self.handles: list[Any] = []
        self.leaves: list[nn.Module] = []
        self.measuring = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = [p for p in pl_module.parameters() if p.requires_grad]
        modules = [m for m in pl_module.modules() if not list(m.children())]
        # as the activation watch: the rectifiers' inputs (their dead units), the weight gradient of the layer that
        # feeds each (its zero share)
        self.relu_inputs = [b for b in modules if isinstance(b, nn.ReLU)]
        weights = (getattr(a, "weight", None) for a, b in itertools.pairwise(modules) if isinstance(b, nn.ReLU))
        self.feeding_relu = [w for w in weights if isinstance(w, nn.Parameter)]
        self.copies = [p.detach().clone() for p in self.params]
        self.leaves = modules

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self.measuring = bool(self.every) and step % self.every == 0
        if self.sampled and step % self.sampled == 0:
            self.handles = [m.register_forward_hook(self._output_hook) for m in self.leaves]
        if self.sampled and self.measuring:
            self.handles += [m.register_forward_pre_hook(self._input_hook) for m in self.relu_inputs]

    def _output_hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        with torch.no_grad():
            self.stats.extend(torch.aminmax(torch.nan_to_num(output, nan=1.0)))

    def _input_hook(self, module: nn.Module, args: Any) -> None:
        with torch.no_grad():
            self.stats.append(_dead_share(args[0]))

    @torch.no_grad()
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        grads = [p.grad for p in self.params if p.grad is not None]
        if not self.measuring:
            total = 0.0
            for g in grads:  # the guard's quiet pass: each gradient's float32 sum, read on the host
                total += abs(cast(float, g.sum(dtype=torch.float32).tolist()))
            if not total < 1e38:
                raise FloatingPointError("non-finite gradient")
            if self.stats:  # a sampled step's outputs: their one host read
                torch.stack(self.stats).tolist()
                self.stats = []
            return
        n = len(grads)
        both = torch.stack(torch._foreach_norm([*grads, *self.params])).pow_(2)
        shares = [_zero_share(p.grad) for p in self.feeding_relu if p.grad is not None]
        torch._foreach_copy_(self.copies, self.params)
        self.weight_sq = both[n:]
        host = torch.cat([both[:n], torch.stack(shares + self.stats)]).tolist()  # the one copy before the step
        self.stats = []
        if not sum(host[:n]) < 1e38:
            raise FloatingPointError("non-finite gradient")

    @torch.no_grad()
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if not abs(loss.sum(dtype=torch.float32).tolist()) < 1e38:  # the guard's check of the loss
            raise FloatingPointError("non-finite loss")
        if self.measuring and self.weight_sq is not None:
            torch._foreach_sub_(self.copies, self.params)
            updates = torch.stack(torch._foreach_norm(self.copies)).pow_(2)
            torch.cat([self.weight_sq, updates]).sqrt_().tolist()  # the one copy after the step
            self.weight_sq = None


def floor_ops(params: list[torch.Tensor], grads: list[torch.Tensor]) -> dict[str, Any]:
    """Each operator of the floor as a zero-argument function on ``params`` and ``grads`` (same shapes), to time."""
    copies = [p.detach().clone() for p in params]
    matrices = [g for g in grads if g.ndim == 2][:-1]  # those of the layers feeding a rectifier in the MLP
    loss = torch.tensor(1.0)

    def guard() -> float:
        total = 0.0
        for g in grads:
            total += abs(cast(float, g.sum(dtype=torch.float32).tolist()))
        return total

    return {
        "guard pass: each gradient's float32 sum, read on the host": guard,
        "loss check: its float32 sum, read on the host": lambda: loss.sum(dtype=torch.float32).tolist(),
        "_foreach_norm of gradients and weights, stacked, squared": lambda: torch.stack(
            torch._foreach_norm([*grads, *params])
        ).pow_(2),
        "zero-gradient shares of the 4 weight matrices feeding a ReLU": lambda: [_zero_share(g) for g in matrices],
        "_foreach_copy_ of the weights into reused buffers": lambda: torch._foreach_copy_(copies, params),
        "_foreach_sub_ then _foreach_norm of the updates, stacked": lambda: (
            torch._foreach_sub_(copies, params),
            torch.stack(torch._foreach_norm(copies)),
        ),
        "one host read (cat of 2 x 10 values, tolist)": lambda: torch.cat([loss.reshape(1)] * 20).tolist(),
    }


def time_ops(width: int = 600, repeats: int = 7, calls: int = 50) -> list[tuple[str, float]]:
    """(operator, µs per call) of :func:`floor_ops` on the parameters and gradients of ``cost_table.MLP(width)``
    after one backward pass: warm (one call first), best of ``repeats`` rounds of ``calls`` calls each, CPU time of
    this thread (``time.thread_time``)."""
    import os
    import sys
    import time

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cost_table import MLP, mlp_data

    model = MLP(width)
    x, y = next(iter(mlp_data(1)))
    nn.functional.mse_loss(model.net(x).squeeze(-1), y).backward()
    params = [p.detach() for p in model.parameters()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    rows = []
    for name, op in floor_ops(params, grads).items():
        op()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            for _ in range(calls):
                op()
            best = min(best, (time.thread_time() - t0) / calls)
        rows.append((name, best * 1e6))
    return rows


if __name__ == "__main__":
    import os

    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, MLP(600) (1.1M parameters); load average {os.getloadavg()[0]:.1f}")
    print("| operator | µs per call (best of 7) |\n|---|---|")
    for op_name, us in time_ops():
        print(f"| {op_name} | {us:.1f} |")
