"""The guard's pass on a measuring step (issue 43, fifth cost pass): ``GradientFlowMonitor``'s measurement reads the
gradients' total norm back to the host with its other values, and the guard's pass at that step decides from it on
the host when it proves the squares' sum finite, without an operator; every verdict is the one the flag (the sum
of the squares times 0, plus the losses' probe) gives. The per-tensor norms of one (device, dtype) bucket are the
stacked norms themselves, without the scatter into a fresh vector: the same values."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_diag.callbacks.anomaly_alarm import guard_pass
from lightning_diag.instrument.grad_measure import GradientSquares, ParamIndex, measure_step
from lightning_diag.stats.grad import grouped_squares, per_tensor_norms
from lightning_diag.stats.norms import finite_probe
from tests.callbacks.op_names import OpNames


def _model(case: str) -> tuple[list[str], list[torch.nn.Parameter], list[torch.Tensor]]:
    """Three parameters with gradients for ``case``, and the step's held losses."""
    torch.manual_seed(0)
    shapes = {"0.weight": (8, 6), "0.bias": (8,), "1.weight": (3, 8)}
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes.values()]
    for p in params:
        p.grad = torch.randn(p.shape)
    losses = [torch.tensor(0.7)]
    if case == "nan_grad":
        params[0].grad[2, 3] = float("nan")
    elif case == "inf_grad":
        params[2].grad[1, 1] = float("-inf")
    elif case == "squares_overflow":  # finite gradients whose squared norm overflows float32 (about 1e76)
        params[1].grad.fill_(1e37)
    elif case == "total_past_margin":  # a total of 1.3e19: its square (1.7e38) is finite, past the host's margin
        params[0].grad.zero_()
        params[1].grad.zero_()
        params[1].grad[0] = 1.3e19
        params[2].grad.zero_()
    elif case == "total_below_margin":  # a total of 9e18: proven on the host
        params[0].grad.zero_()
        params[1].grad.zero_()
        params[1].grad[0] = 9e18
    elif case == "nan_loss":
        losses = [torch.tensor(float("nan"))]
    elif case == "inf_loss":
        losses = [torch.tensor(0.5), torch.tensor(float("inf"))]
    elif case == "no_loss":
        losses = []
    return list(shapes), params, losses


CASES = [
    "finite",
    "nan_grad",
    "inf_grad",
    "squares_overflow",
    "total_past_margin",
    "total_below_margin",
    "nan_loss",
    "inf_loss",
    "no_loss",
]


@pytest.mark.parametrize("case", CASES)
def test_the_measured_pass_decides_as_the_flag(case):
    names, params, losses = _model(case)
    index = ParamIndex(names, params, False)
    known = GradientSquares.measure(params, weights=True)
    assert known is not None and known.covers([p.grad for p in params])
    m = measure_step(index, list(range(len(params))), None, known=known)
    # the host total of the step's one copy
    assert known.total == m.total or (math.isnan(known.total) and math.isnan(m.total))
    # the verdict before this change: 0 times the squares' float32 sum, plus the losses' probe, read from the flag
    flag = torch.sum(known.squares, 0, True).mul_(0)
    if losses:
        flag.add_(finite_probe(losses))
    expected = flag.item() == 0
    proven = case in ("finite", "total_below_margin", "no_loss")
    assert expected == (proven or case == "total_past_margin")
    guard = guard_pass.OptimizerPass([{"params": params}])
    with OpNames() as ops:
        assert guard.clean_measured(list(losses), known) is expected
    if proven:  # proven on the host: the losses' sums at most, no operator on the squares
        assert set(ops.names) <= {"sum.default"} and ops.names["sum.default"] == len(losses), ops.names
    else:  # the flag decided, as before
        assert "mul_.Tensor" in ops.names


def test_the_total_proves_finite_only_below_the_margin():
    squares = torch.tensor([1.0])
    assert GradientSquares({}, squares, 9.99e18).proves_finite()
    for total in (1e19, 2e19, float("inf"), float("nan")):
        assert not GradientSquares({}, squares, total).proves_finite()
    assert not GradientSquares({}, squares).proves_finite()  # not read: the flag decides


def test_changed_gradients_are_not_read_from_the_total():
    names, params, losses = _model("finite")
    known = GradientSquares.measure(params, weights=True)
    assert known is not None
    measure_step(ParamIndex(names, params, False), [0, 1, 2], None, known=known)
    params[0].grad[0, 0] = float("nan")  # changed in place after the measurement
    guard = guard_pass.OptimizerPass([{"params": params}])
    assert guard.clean_measured(losses, known) is None  # the guard makes its own pass
    assert guard.clean(losses) is False


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.float32, torch.float16, torch.float32, torch.float64),
        (torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
def test_per_tensor_norms_one_bucket_or_several(dtypes):
    torch.manual_seed(1)
    tensors = [torch.randn(5, 7).to(dtype) for dtype in dtypes]
    tensors[0][0, 0] = float("nan")
    norms = per_tensor_norms(tensors)
    assert norms.dtype == torch.float32 and norms.shape == (len(tensors),)
    for i, t in enumerate(tensors):
        accumulate = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
        ref = torch._foreach_norm([t], 2, dtype=accumulate)[0].to(torch.float32)
        got, want = norms[i].item(), ref.item()
        assert got == want or (math.isnan(got) and math.isnan(want)), (i, got, want)
    assert math.isnan(norms[0].item())


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_the_blocks_norm_is_the_masked_sum_of_the_block_layers(poison):
    """``measure_step``'s blocks' gradient norm picks the blocks' layers by position (no boolean mask): the same
    float as the sum over the mask."""
    torch.manual_seed(2)
    names = ["embed.weight", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight", "head.weight"]
    shapes = [(10, 6), (6, 6), (6,), (6, 6), (3, 6)]
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    if poison is not None:
        params[3].grad[0, 0] = poison
    index = ParamIndex(names, params, False)
    assert index.block_layers == {"blocks.0.fc", "blocks.1.fc"}
    m = measure_step(index, list(range(len(params))), None)
    # the computation before: the same primitives, the blocks' layers picked by a boolean mask
    squares = per_tensor_norms([p.grad for p in params]).pow(2)
    matrix = [i for i in range(len(params)) if index.is_matrix[i]]
    groups = torch.tensor([index.layer_of[i] for i in matrix])
    per_layer = grouped_squares(squares[torch.tensor(matrix)], groups, len(index.layers))
    expected = per_layer[torch.tensor(index.in_block)].sum().sqrt().item()
    assert m.blocks == expected or (math.isnan(m.blocks) and math.isnan(expected))
