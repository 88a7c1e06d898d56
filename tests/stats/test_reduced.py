"""Declared reductions: the merge of two ranks' states equals the state over the union of their data."""

import math
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from lightning_diag.callbacks.common.reduction import reduce_state, reduce_states
from lightning_diag.stats.loss_sums import LossSums
from lightning_diag.stats.reduced import ReducedState, Reduction, combine


def declared():
    state = ReducedState()
    state.add_state("total", 0.0, Reduction.SUM)
    state.add_state("low", math.inf, Reduction.MIN)
    state.add_state("high", -math.inf, Reduction.MAX)
    state.add_state("seen", [], Reduction.CAT)
    return state


def fill(state, values, as_tensors):
    for v in values:
        x = torch.tensor(v, dtype=torch.float64) if as_tensors else v
        state["total"] = state["total"] + x
        state["low"] = combine(Reduction.MIN, state["low"], x)
        state["high"] = combine(Reduction.MAX, state["high"], x)
        state["seen"] = combine(Reduction.CAT, state["seen"], [float(v)])
    return state


def close(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-12), key


SPLITS = [([], []), ([1.5], []), ([], [-2.0, 3.0]), ([0.25, 4.0, -1.0], [7.0, 0.5]), ([1e-8] * 3, [1e8])]


@pytest.mark.parametrize("as_tensors", [False, True])
@pytest.mark.parametrize(("rank0", "rank1"), SPLITS)
def test_merge_of_two_ranks_equals_the_state_over_the_union(rank0, rank1, as_tensors):
    merged = fill(declared(), rank0, as_tensors).merge(fill(declared(), rank1, as_tensors))
    close(merged.state_dict(), fill(declared(), rank0 + rank1, as_tensors).state_dict())


@pytest.mark.parametrize("seed", range(5))
def test_loss_sums_merge_equals_the_union_including_non_finite_losses(seed):
    rng = random.Random(seed)
    losses = [rng.choice([math.nan, math.inf, rng.uniform(0.1, 5.0)]) for _ in range(rng.randint(1, 20))]
    cut = rng.randint(0, len(losses))
    parts = [LossSums(baseline_steps=100), LossSums(baseline_steps=100)]
    union = LossSums(baseline_steps=100)
    for i, loss in enumerate(losses):
        parts[i >= cut].add(torch.tensor(loss))
        union.add(torch.tensor(loss))
    merged = parts[0].merge(parts[1]).state_dict()
    # the step-to-step differences are each rank's own: the pair across the cut is in the union only
    noise = {name for name in union.specs if name.endswith(("_dsq", "_dn"))}
    close({k: v for k, v in merged.items() if k not in noise},
          {name: value for name, value in union.state_dict().items() if name in union.specs and name not in noise})
    assert 0 <= union.state_dict()["epoch_dn"] - merged["epoch_dn"] <= 1
    finite = [v for v in losses if math.isfinite(v)]
    expected = sum(finite) / len(finite) if finite else math.nan
    assert LossSums.mean(merged, "epoch") == pytest.approx(expected, nan_ok=True)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shares_of_a_restored_state_merge_back_to_it(world_size):
    whole = fill(declared(), [3.0, -1.0, 8.0], as_tensors=False)
    shares = [whole.share(world_size, rank) for rank in range(world_size)]
    merged = shares[0]
    for share in shares[1:]:
        merged = merged.merge(share)
    close(merged.state_dict(), whole.state_dict())


class _TwoRankStrategy:
    """What `trainer.strategy` does on rank 0 of two, the other rank holding `other`'s values."""

    def __init__(self, other):
        self.other = other
        self.root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op):
        names = [n for n, spec in self.other.specs.items() if spec.reduction.value == reduce_op]
        theirs = torch.tensor([float(self.other[n]) for n in names], dtype=tensor.dtype)
        return {"sum": tensor + theirs, "min": torch.minimum(tensor, theirs), "max": torch.maximum(tensor, theirs)}[
            reduce_op
        ]

    def all_gather(self, tensor):
        if tensor.numel() == 1 and tensor.dtype == torch.long:  # the lengths
            return torch.stack([tensor, torch.tensor([len(self.other["seen"])])])
        theirs = torch.zeros_like(tensor)
        theirs[: len(self.other["seen"])] = torch.tensor(self.other["seen"], dtype=tensor.dtype)
        return torch.stack([tensor, theirs])


@pytest.mark.parametrize(("rank0", "rank1"), SPLITS)
def test_ddp_adapter_reduces_by_the_declaration(rank0, rank1):
    mine, theirs = fill(declared(), rank0, True), fill(declared(), rank1, False)
    trainer = SimpleNamespace(world_size=2, strategy=_TwoRankStrategy(theirs))
    close(reduce_state(trainer, mine), mine.merge(theirs).state_dict())
    single = SimpleNamespace(world_size=1, strategy=_TwoRankStrategy(theirs))
    close(reduce_state(single, mine, ["total", "seen"]), {k: mine.state_dict()[k] for k in ("total", "seen")})


class _ThreadRank:
    """`trainer.strategy` of one of several ranks run as threads: each collective exchanges the ranks' tensors (the
    shapes must agree, as under DDP) and is noted in :attr:`calls`."""

    def __init__(self, rank, slots, barrier):
        self.rank, self.slots, self.barrier = rank, slots, barrier
        self.root_device = torch.device("cpu")
        self.calls = []

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        return self._exchange(tensor)

    def reduce(self, tensor, reduce_op):
        self.calls.append(reduce_op)
        stacked = self._exchange(tensor)
        return {"sum": stacked.sum(0), "min": stacked.min(0).values, "max": stacked.max(0).values}[reduce_op]

    def _exchange(self, tensor):
        self.slots[self.rank] = tensor.clone()
        self.barrier.wait()
        shapes = {t.shape for t in self.slots}
        stacked = torch.stack(self.slots)
        self.barrier.wait()
        assert len(shapes) == 1, shapes
        return stacked


def _ranks_reduce(states_of_rank):
    """`reduce_states` on each rank's states at once (threads), and each rank's collectives."""
    slots = [None] * len(states_of_rank)
    barrier = threading.Barrier(len(states_of_rank), timeout=30)
    strategies = [_ThreadRank(rank, slots, barrier) for rank in range(len(states_of_rank))]
    trainers = [SimpleNamespace(world_size=len(states_of_rank), strategy=s) for s in strategies]
    with ThreadPoolExecutor(len(states_of_rank)) as pool:
        futures = [
            pool.submit(reduce_states, trainer, [(state, None) for state in states])
            for trainer, states in zip(trainers, states_of_rank, strict=True)
        ]
        results = [future.result() for future in futures]
    return results, [s.calls for s in strategies]


@pytest.mark.parametrize("as_tensors", [False, True])
def test_several_states_reduce_in_one_collective_per_kind(as_tensors):
    """The checkpoint's reduction of every callback's state: each state merged over the ranks as alone, with one
    reduce per kind and one gather of the lengths and one of the values for all the CAT values together."""
    values = [
        [([0.25, 4.0], [7.0]), ([], [-2.0, 3.0]), ([1.5], [])],
        [([1e-8], []), ([], []), ([5.0, 6.0, 7.0], [8.0])],
    ]
    states_of_rank = [[fill(declared(), part[rank], as_tensors) for part in values[0]] for rank in (0, 1)]
    results, calls = _ranks_reduce(states_of_rank)
    for rank in (0, 1):
        for index in range(3):
            merged = states_of_rank[0][index].merge(states_of_rank[1][index]).state_dict()
            close(results[rank][index], merged)
        assert sorted(calls[rank]) == ["all_gather", "all_gather", "max", "min", "sum"]
    # no CAT value anywhere: the lengths tell every rank, and no value is gathered
    empty = [[fill(declared(), part[rank], as_tensors) for part in values[1]] for rank in (0, 1)]
    for states in empty:
        for state in states:
            state["seen"] = []
    results, calls = _ranks_reduce(empty)
    assert all(result["seen"] == [] for result in results[0])
    assert sorted(calls[0]) == ["all_gather", "max", "min", "sum"]


def test_declaration_errors_name_the_state():
    state = declared()
    with pytest.raises(ValueError, match="`total` is declared twice"):
        state.add_state("total", 0.0, Reduction.SUM)
    with pytest.raises(ValueError, match="identity of sum"):
        state.add_state("count", 1.0, Reduction.SUM)
    with pytest.raises(ValueError, match="identity of min"):
        state.add_state("first", 0, Reduction.MIN)
    with pytest.raises(KeyError, match="not declared"):
        state["nope"] = 1.0
    other = ReducedState()
    other.add_state("total", 0.0, Reduction.SUM)
    with pytest.raises(ValueError, match="different declarations"):
        state.merge(other)
    with pytest.raises(KeyError, match=r"\['low', 'high', 'seen'\]"):
        state.load_state_dict({"total": 1.0})
    state.load_state_dict({"total": 2.0}, strict=False)
    assert state.state_dict()["total"] == 2.0 and state.state_dict()["low"] == math.inf


@pytest.mark.parametrize("seed", range(4))
def test_loss_sums_held_and_folded_equal_the_plain_sums_at_every_read(seed):
    """The sums hold losses as references and fold them every FOLD_EVERY batches: any read, at any point
    (before, at and past a fold boundary), sees every loss added so far, the baseline and the last finite one."""
    from lightning_diag.stats.loss_sums import FOLD_EVERY

    rng = random.Random(seed)
    n = FOLD_EVERY * 2 + rng.randint(1, FOLD_EVERY)
    losses = [rng.choice([math.nan, -math.inf, rng.uniform(0.1, 5.0), rng.uniform(0.1, 5.0)]) for _ in range(n)]
    baseline = rng.randint(1, FOLD_EVERY + 10)
    sums = LossSums(baseline_steps=baseline)
    reads = sorted([*rng.sample(range(1, n + 1), 5), FOLD_EVERY, FOLD_EVERY + 1])
    for i, loss in enumerate(losses, start=1):
        sums.add(torch.tensor(loss))
        if i not in reads:
            continue
        seen = [v for v in losses[:i] if math.isfinite(v)]
        first = [v for v in losses[: min(i, baseline)] if math.isfinite(v)]
        state = sums.state_dict()
        assert state["epoch_count"] == len(seen) and state["window_count"] == len(seen)
        assert state["epoch_sum"] == pytest.approx(sum(seen), rel=1e-5)
        assert state["initial_count"] == len(first)
        assert state["initial_sum"] == pytest.approx(sum(first), rel=1e-5)
        assert float(sums.last_finite) == pytest.approx(seen[-1] if seen else math.nan, nan_ok=True)


def test_loss_sums_reset_folds_first_and_load_drops_what_is_held():
    sums = LossSums(baseline_steps=0)
    for v in (1.0, 2.0):
        sums.add(torch.tensor(v))
    sums.reset(LossSums.names("window"))  # the held losses belonged to the window that closes
    sums.add(torch.tensor(4.0))
    state = sums.state_dict()
    assert (state["window_sum"], state["window_count"]) == (4.0, 1.0)
    assert (state["epoch_sum"], state["epoch_count"]) == (7.0, 3.0)
    restored = dict(state)
    sums.add(torch.tensor(100.0))  # a step a rollback undoes: restoring the earlier sums forgets it
    sums.load_state_dict(restored)
    assert sums.state_dict()["epoch_sum"] == 7.0
    sums.last_finite = 3.5
    assert sums.last_finite == 3.5


def test_loss_sums_keep_a_copy_not_the_callers_tensor():
    """A compiled model's output memory can be overwritten by its next call (CUDA graphs): what was added stays."""
    sums = LossSums(baseline_steps=1)
    loss = torch.tensor(2.0)
    sums.add(loss)
    loss.fill_(99.0)  # the memory is reused
    assert sums.state_dict()["epoch_sum"] == 2.0 and float(sums.last_finite) == 2.0
