"""Experts in one process (`edgc.distributed.experts`, `expert_sync`, `expert_tokens`, `scaling`,
`edgc.policies.rank_split`): which parameters are experts without a mark (and never from a shape alone),
the scale's two conventions, the split's arithmetic (same bytes, bounds, proportions, ranks capped by
tokens), a dead expert's zeros out of the entropy sample, the token counter read and never written, and
a resume at another ep (continued where the checkpoint holds this rank's experts, refused in one line
where it does not).
"""

import math

import pytest
import torch
from torch import nn

from edgc import EDGCConfig, EDGCState, EntropySampler
from edgc.distributed.expert_sync import Experts
from edgc.distributed.expert_tokens import ExpertTokens
from edgc.distributed.experts import dense_parameters, expert_marks, expert_parameters, mark_experts
from edgc.distributed.scaling import SUM, GradientScale
from edgc.policies.rank_split import TokenSplit, largest_rank, share_ranks


class GroupedExperts(nn.Module):
    """Named as torchtitan's and the harness's experts module: found by its class name."""

    def __init__(self, count: int, num_experts: int | None = None):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(count, 6, 4))
        self.w2 = nn.Parameter(torch.randn(count, 4, 6))
        if num_experts is not None:
            self.num_experts = num_experts


class Block(nn.Module):
    """Attention's fused QKV ([3, h, d]: one dense parameter), a shared expert every token uses, routed experts."""

    def __init__(self, count: int = 4, num_experts: int | None = 4):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(3, 4, 4))
        self.moe = nn.Module()
        self.moe.shared_experts = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
        self.moe.experts = GroupedExperts(count, num_experts)
        self.moe.register_buffer("tokens_per_expert", torch.zeros(count))


# ---------------------------------------------------------------------------- which parameters are experts
def test_experts_are_found_by_their_modules_class_never_by_a_shape_alone():
    block = Block()
    marks = expert_marks(block)
    assert set(marks) == {"moe.experts.w1", "moe.experts.w2"}  # not qkv, not the shared expert
    assert all(m.ep == 1 and m.first == 0 and m.ranks is None and m.unknown is None for m in marks.values())
    assert marks["moe.experts.w1"].tokens is block.moe.tokens_per_expert  # the counter two modules up
    shared = [name for name, _ in block.named_parameters() if name.startswith("moe.shared_experts")]
    assert [name for name, _ in dense_parameters(block)] == ["qkv", *shared]  # a shared expert is dense
    assert [name for name, _ in expert_parameters(block)] == ["moe.experts.w1", "moe.experts.w2"]
    plain = nn.Module()
    plain.qkv = nn.Parameter(torch.randn(3, 4, 4))  # a stack of 3 on dim 0 in any other module: dense
    assert expert_marks(plain) == {}


def test_experts_holding_fewer_than_their_module_says_are_marked_unknown_and_a_mark_overrides():
    block = Block(count=2, num_experts=4)  # 2 of 4 experts as plain tensors: split over ranks no one named
    (mark,) = set(expert_marks(block).values())
    assert "holds 2 of its module's 4 experts" in mark.unknown
    mark_experts(block.moe.experts, None, first=2, ep=2, tokens=block.moe.tokens_per_expert)
    (mark,) = set(expert_marks(block).values())
    assert (mark.first, mark.ep, mark.unknown) == (2, 2, None)


def test_a_mark_that_cannot_be_experts_is_refused_in_one_line():
    module = nn.Linear(4, 4)
    for call, words in (
        (lambda: mark_experts(module, None, first=0, ep=1), "stacks its experts on dim 0"),
        (lambda: mark_experts(nn.Module(), None, first=0, ep=1), "has no parameters"),
        (lambda: mark_experts(GroupedExperts(2), None, first=0, ep=0), "ep must be an integer"),
        (lambda: mark_experts(GroupedExperts(2), None, first=0, ep=2, tokens=torch.zeros(3)), "tokens must"),
    ):
        with pytest.raises(ValueError, match=words) as error:
            call()
        assert "\n" not in str(error.value)


def test_ignore_experts_refuses_a_model_already_wrapped(monkeypatch):
    from edgc.distributed.experts import ignore_experts

    class Wrapped(nn.parallel.DistributedDataParallel):
        def __init__(self):  # no process group needed to be refused
            nn.Module.__init__(self)

    with pytest.raises(ValueError, match="before wrapping") as error:
        ignore_experts(Wrapped())
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------- the one scale
def test_the_scale_is_one_over_ep_for_experts_when_averaging_and_the_group_size_when_summing():
    scale = GradientScale()
    assert (scale.factor(4, 1), scale.factor(2, 2), scale.factor(2, 4)) == (1.0, 0.5, 0.25)
    grads = [torch.ones(2), torch.ones(2, 3)]
    scale.apply(["dense", "w"], grads, 2, {"w": 2})
    assert grads[0].eq(1).all() and grads[1].eq(0.5).all()
    scale.use(SUM, "state")
    assert (scale.factor(4, 1), scale.factor(4, 2)) == (4.0, 4.0)  # the user's loss scaling counts every token
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        scale.use("avg", "state")


# ---------------------------------------------------------------------------- the split
def test_shares_sum_to_the_budget_within_bounds_in_proportion():
    assert share_ranks(16, [1, 2, 3, 10], cap=64) == [1, 2, 3, 10]
    assert share_ranks(8, [1, 1, 1, 1], cap=64) == [2, 2, 2, 2]
    capped = share_ranks(16, [0, 0, 1, 100], cap=6)  # the heavy one capped, the rest refilled
    assert sum(capped) == 16 and max(capped) == 6 and min(capped) >= 1
    for weights in ([3, 1], [0.5, 0.25, 0.25], [7, 0, 0, 1, 2]):
        ranks = share_ranks(4 * len(weights), weights, cap=12)
        assert sum(ranks) == 4 * len(weights) and all(1 <= r <= 12 for r in ranks)
    assert share_ranks(12, [5, 5, 0], cap=[2, 8, 1]) == [2, 8, 1]  # each entry's own cap; the total clipped to 11


def compressed(shape, rank):
    m, n = shape
    return min(rank, m, n) if (m + n) * min(rank, m, n) * 2 < m * n else 0


def test_the_token_split_keeps_each_stacked_parameters_bytes():
    groups = {"w": [(f"w[{i}]", (24, 12)) for i in range(4)]}
    assert TokenSplit().ranks(2, groups, {}, compressed) == {}  # uncounted: every expert at the rank
    ranks = TokenSplit().ranks(2, groups, {"w[0]": 10.0, "w[1]": 2.0, "w[2]": 2.0, "w[3]": 2.0}, compressed)
    full = {f"w[{i}]": ranks.get(f"w[{i}]", 2) for i in range(4)}
    assert sum(full.values()) == 4 * 2  # the bytes of rank 2 for all four (their shapes are one)
    assert full["w[0]"] == largest_rank((24, 12), compressed) == 3  # the heavy one at its cap
    assert sorted(full[f"w[{i}]"] for i in (1, 2, 3)) == [1, 2, 2]  # the rest share what is left


def test_a_dead_expert_gets_rank_one_and_an_expert_no_more_than_its_tokens_per_step():
    groups = {"w": [(f"w[{i}]", (48, 40)) for i in range(3)]}
    ranks = TokenSplit().ranks(4, groups, {"w[0]": 0.0, "w[1]": 2.0, "w[2]": 30.0}, compressed)
    assert ranks == {"w[0]": 1, "w[1]": 1, "w[2]": 10}  # a dead expert: 1; the budget of 3 × 4 kept
    ranks = TokenSplit().ranks(4, groups, {"w[0]": 1.0, "w[1]": 2.0, "w[2]": 2.5}, compressed)
    assert ranks == {"w[0]": 1, "w[1]": 2, "w[2]": 3}  # each at most its tokens per step: fewer bytes than 3 × 4


# ---------------------------------------------------------------------------- a dead expert's zeros
def test_a_dead_experts_zeros_are_left_out_of_the_entropy_sample():
    config = EDGCConfig(iteration_sample_ratio=1.0, gradient_sample_ratio=1.0)
    generator = torch.Generator().manual_seed(0)
    dense, live = torch.randn(300, generator=generator), torch.randn(20, 10, generator=generator)
    dead = torch.zeros(20, 10)
    with_dead, without = EntropySampler(config), EntropySampler(config)
    for sampler, experts in ((with_dead, [live, dead]), (without, [live])):
        sampler.begin(0)
        sampler.add([dense], experts)
    assert with_dead.finish() == without.finish()
    plain = EntropySampler(config)  # the zeros kept, as a dense parameter's are: a lower estimate
    plain.begin(0)
    plain.add([dense, live, dead])
    assert plain.finish() < without.history[0][1]


# ---------------------------------------------------------------------------- the counter, read
def test_the_counter_is_read_at_the_first_forward_of_each_step_and_never_written():
    counter, model = torch.zeros(4), nn.Linear(2, 2)
    tokens = ExpertTokens()
    tokens.watch(model, [counter])
    for step, routed in enumerate(([1, 2, 0, 0], [0, 0, 3, 1], [5, 0, 2, 2])):
        model.eval()
        model(torch.zeros(1, 2))  # an evaluation between steps: no base (it may come before the reset)
        model.train()
        if step == 2:
            counter.zero_()  # the model's own reset between steps (torchtitan's optimizer pre-hook)
        model(torch.zeros(1, 2))  # the step's first training forward
        counter += torch.tensor(routed, dtype=torch.float32)
        model(torch.zeros(1, 2))  # a second micro-batch: no new base
        before = counter.clone()
        tokens.count({"w": (counter, 2, 2)})  # rows 2, 3: this rank's experts of a per-global-expert counter
        assert torch.equal(counter, before)
    assert tokens.counted["w"].tolist() == [5.0, 3.0] and tokens.steps == 3


# ---------------------------------------------------------------------------- a resume at another ep
def held(first: int, count: int) -> Experts:
    model = nn.Module()
    model.experts = GroupedExperts(count)
    mark_experts(model.experts, None, first=first, ep=4 // count)
    return Experts(expert_marks(model), {"experts.w1": (count, 6, 4), "experts.w2": (count, 4, 6)})


def test_a_checkpoint_holding_this_ranks_experts_continues_and_one_lacking_some_is_refused_in_one_line():
    saved = {f"experts.w1[{i}]": torch.ones(4) for i in range(4)}
    restricted = held(2, 2).restricted({"q": saved, "error": {}, "shapes": {}})  # saved at ep 1, resumed at ep 2
    assert sorted(restricted["q"]) == ["experts.w1[2]", "experts.w1[3]"]
    with pytest.raises(ValueError, match=r"holds experts \[2–3\] of experts.w1 and this rank \[0–3\]") as error:
        held(0, 4).restricted({"q": {k: v for k, v in saved.items() if k.endswith(("[2]", "[3]"))}, "error": {}})
    assert "\n" not in str(error.value)


def test_a_state_resumed_at_a_larger_ep_keeps_the_q_of_its_experts():
    config = EDGCConfig(r_max=1, r_min=1, adaptive=False, warmup_fraction=0.0, min_warmup_steps=1,
                        warmup_error_test=False, total_steps=10)  # fmt: skip
    whole = nn.Module()
    whole.experts = GroupedExperts(4)
    state = EDGCState(None, config, model=whole)
    with pytest.warns(UserWarning, match="no process group"):
        for _ in range(2):
            for p in whole.parameters():
                p.grad = torch.randn_like(p)
            state.synchronize(whole.parameters())
    saved = state.state_dict()
    half = nn.Module()
    half.experts = GroupedExperts(2)
    mark_experts(half.experts, None, first=2, ep=2)
    resumed = EDGCState(None, config, model=half)
    resumed.load_state_dict(saved)
    assert sorted(name for name in resumed.compressor.q if name.startswith("experts.w1")) == [
        "experts.w1[2]", "experts.w1[3]"
    ]  # fmt: skip
    assert torch.equal(resumed.compressor.q["experts.w1[3]"], saved["compressor"]["q"]["experts.w1[3]"])
    assert math.isfinite(float(resumed.compressor.q["experts.w1[2]"].sum()))
