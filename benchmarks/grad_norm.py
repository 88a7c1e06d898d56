"""Gradient-norm pass: GradientFlowMonitor's fused measurement against Lightning's ``grad_norm``.

Both compute per-layer gradient L2 norms of the same model with the same gradients, in one process, interleaved
(A B A B ...). Prints a markdown table with the median time of each and the ratio.

    python benchmarks/grad_norm.py [--repeats 30] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from pytorch_lightning.utilities import grad_norm
from torch import nn

from lightning_diag.stats.grad import grouped_norms, per_tensor_norms


def build(device: str) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).to(device)
    x = torch.randn(16, 128, 256, device=device)
    model(x).pow(2).mean().backward()
    return model


def fused_pass(names: list[str], params: list[torch.Tensor], group_of: torch.Tensor, n: int) -> list[float]:
    grads = [p.grad for p in params]
    norms = grouped_norms(per_tensor_norms(grads), group_of, n)  # type: ignore[arg-type]
    return torch.cat([norms.pow(2).sum().sqrt().reshape(1), norms]).tolist()


def lightning_pass(model: nn.Module) -> dict[str, float]:
    return {k: float(v) for k, v in grad_norm(model, norm_type=2).items()}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    model = build(args.device)
    named = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    names = [n for n, _ in named]
    params = [p for _, p in named]
    layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))
    group_of = torch.tensor([layers.index(n.rsplit(".", 1)[0]) for n in names], device=args.device)
    fused_times, lightning_times = [], []
    for _ in range(3):  # warm-up
        fused_pass(names, params, group_of, len(layers))
        lightning_pass(model)
    for _ in range(args.repeats):
        for fn, bucket in (
            (lambda: fused_pass(names, params, group_of, len(layers)), fused_times),
            (lambda: lightning_pass(model), lightning_times),
        ):
            sync(args.device)
            t0 = time.perf_counter()
            fn()
            sync(args.device)
            bucket.append(time.perf_counter() - t0)
    fused, light = statistics.median(fused_times), statistics.median(lightning_times)
    print(f"model: 4-layer nn.TransformerEncoder, d_model 256, {len(params)} parameter tensors, device {args.device}")
    print("| pass | median ms | spread (IQR) ms | ratio to grad_norm |")
    print("|---|---|---|---|")
    for name, times, med in (
        ("GradientFlowMonitor fused (per layer + total)", fused_times, fused),
        ("pytorch_lightning.utilities.grad_norm (per parameter)", lightning_times, light),
    ):
        q = statistics.quantiles(times, n=4)
        print(f"| {name} | {med * 1e3:.3f} | {(q[2] - q[0]) * 1e3:.3f} | {med / light:.2f}x |")


if __name__ == "__main__":
    main()
