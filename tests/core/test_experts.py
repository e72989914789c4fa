"""Mixture of experts (`edgc.distributed.experts`, `edgc.policies.rank_split`): dense gradients over the
whole data-parallel group, stacked experts over their expert-data-parallel group, each expert its own matrix.

Single process: the split's arithmetic (same bytes, bounds, proportions), the split of a stacked
gradient into views, the one-line refusals of a bad mark. On 4 gloo processes, EP 2 × DP 2 (one call
each): with synchronize, the warm-up's averages are the exact means of their groups, every compressed
step keeps each expert identical on its replicas and conserves Ĝ + mean(e) = mean(G + e), ranks split
by tokens are agreed and cost the uniform bytes, a resumed pair of states continues bit for bit, and an
expert handed to the dense state, or experts marked with the wrong group, are refused in one line
before anything is sent; with FSDP2/HSDP, experts sharded on their own mesh take a state of their own.
"""

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn

from edgc import EDGCConfig, EDGCState
from edgc.distributed.agreement import SettingsDiffer
from edgc.distributed.experts import Experts, dense_parameters, expert_parameters, mark_experts
from edgc.policies.rank_split import TokenSplit, largest_rank, share_ranks

EXPERTS, LOCAL, D, H = 4, 2, 12, 24
COMPRESS = dict(
    r_max=2, r_min=2, adaptive=False, window=2, total_steps=40, warmup_fraction=0.0, min_warmup_steps=1,
    warmup_error_test=False, rank_split="tokens",
)  # fmt: skip


class Model(nn.Module):
    """A dense layer and this EP rank's ``LOCAL`` of ``EXPERTS`` stacked experts (``[LOCAL, H, D]``), each
    expert counting the rows routed to it (row i goes to local expert i % LOCAL, the first one twice)."""

    def __init__(self, ep_rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(D, D)
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(EXPERTS, H, D)[ep_rank * LOCAL : (ep_rank + 1) * LOCAL].clone())
        self.register_buffer("tokens", torch.zeros(LOCAL))

    def forward(self, x):
        h = self.dense(x)
        route = torch.tensor([0, 0, 1] * (len(x) // 3))
        self.tokens += torch.bincount(route, minlength=LOCAL).float()
        out = torch.stack([self.experts.w[e] @ row for e, row in zip(route, h)])
        return out.square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, D, generator=torch.Generator().manual_seed(1000 * step + rank))


# ---------------------------------------------------------------------------- one process
def test_shares_sum_to_the_budget_within_bounds_in_proportion():
    assert share_ranks(16, [1, 2, 3, 10], cap=64) == [1, 2, 3, 10]
    assert share_ranks(8, [1, 1, 1, 1], cap=64) == [2, 2, 2, 2]
    capped = share_ranks(16, [0, 0, 1, 100], cap=6)  # the heavy one capped, the rest refilled
    assert sum(capped) == 16 and max(capped) == 6 and min(capped) >= 1
    for weights in ([3, 1], [0.5, 0.25, 0.25], [7, 0, 0, 1, 2]):
        ranks = share_ranks(4 * len(weights), weights, cap=12)
        assert sum(ranks) == 4 * len(weights) and all(1 <= r <= 12 for r in ranks)


def test_the_token_split_keeps_each_stacked_parameters_bytes():
    def compressed(shape, rank):
        m, n = shape
        return min(rank, m, n) if (m + n) * min(rank, m, n) * 2 < m * n else 0

    groups = {"w": [(f"w[{i}]", (24, 12)) for i in range(4)]}
    assert TokenSplit().ranks(2, groups, {}, compressed) == {}  # uncounted: every expert at the rank
    ranks = TokenSplit().ranks(2, groups, {"w[0]": 10.0, "w[1]": 2.0, "w[2]": 2.0, "w[3]": 2.0}, compressed)
    full = {f"w[{i}]": ranks.get(f"w[{i}]", 2) for i in range(4)}
    assert sum(full.values()) == 4 * 2  # the bytes of rank 2 for all four (their shapes are one)
    assert full["w[0]"] == largest_rank((24, 12), compressed) == 3  # the heavy one at its cap
    assert sorted(full[f"w[{i}]"] for i in (1, 2, 3)) == [1, 2, 2]  # the rest share what is left


def test_a_stacked_gradient_splits_into_views_named_by_global_expert():
    grad = torch.zeros(2, 3, 4)
    experts = Experts({}, {})
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(2, 3, 4))
    mark_experts(model, None, first=6)
    experts = Experts({"w": model._edgc_experts}, {"w": (2, 3, 4)})
    names, views = experts.expand(["bias", "w"], [torch.zeros(3), grad])
    assert names == ["bias", "w[6]", "w[7]"]
    views[2].fill_(1.0)
    assert grad[1].eq(1).all() and grad[0].eq(0).all()
    assert experts.matrix_shapes({"w": (2, 3, 4)})["w[7]"] == (3, 4)


def test_a_mark_that_cannot_be_experts_is_refused_in_one_line():
    module = nn.Linear(4, 4)
    for call, words in (
        (lambda: mark_experts(module, None, first=0), "stacks its experts on dim 0"),
        (lambda: mark_experts(nn.Module(), None, first=0), "has no parameters"),
    ):
        with pytest.raises(ValueError, match=words) as error:
            call()
        assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------- EP 2 × DP 2, synchronize
def gathered(tensor: torch.Tensor, group=None) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def steps(model, dense, experts, rank: int, first: int, last: int) -> list[dict]:
    """Steps ``first`` … ``last − 1``: each rank's gradients, what the states made of them."""
    records = []
    for step in range(first, last):
        model.zero_grad()
        model(batch(rank, step)).backward()
        local = {name: p.grad.clone() for name, p in model.named_parameters()}
        before = {name: e.clone() for name, e in experts.compressor.error.items()}
        dense.synchronize(dense_parameters(model))
        experts.synchronize(expert_parameters(model))
        records.append(
            {
                "local": local,
                "error_before": before,
                "error_after": {name: e.clone() for name, e in experts.compressor.error.items()},
                "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
                "ranks": dict(experts.last_step_metrics["ranks"]),
                "phase": experts.last_step_metrics["phase"],
            }
        )
    return records


def ddp_style(rank: int, world: int) -> dict:
    from edgc.distributed.mesh import init_parallel_mesh

    mesh = init_parallel_mesh("cpu", ep=2)
    edp, ep_rank = mesh["dp_replicate"], mesh["ep"].get_local_rank()
    out = {"ep_rank": ep_rank}

    def build():
        model = Model(ep_rank)
        mark_experts(model.experts, edp, first=ep_rank * LOCAL, tokens=model.tokens)
        config = EDGCConfig(**COMPRESS)
        return model, EDGCState(None, config, model=model), EDGCState(edp, config, model=model)

    model, dense, experts = build()
    records = steps(model, dense, experts, rank, 0, 6)
    out["records"] = records
    out["gathered"] = [{name: gathered(grad) for name, grad in record["local"].items()} for record in records[:1]] + [
        {name: gathered(grad) for name, grad in record["grads"].items()} for record in records
    ]
    out["errors"] = [
        {name: (gathered(r["error_before"].get(name, torch.zeros(H, D))), gathered(e, edp.get_group()))
         for name, e in r["error_after"].items()}
        for r in records
    ]  # fmt: skip

    # resumed after step 3: new states load both states' checkpoints, the model's counters as they are
    model, dense, experts = build()
    steps(model, dense, experts, rank, 0, 3)
    saved = dense.state_dict(), experts.state_dict()
    tokens = model.tokens.clone()
    model, dense, experts = build()
    model.tokens.copy_(tokens)
    dense.load_state_dict(saved[0])
    experts.load_state_dict(saved[1])
    out["resumed"] = steps(model, dense, experts, rank, 3, 6)
    out["refusals"] = refusals(rank, edp, mesh["ep"], ep_rank)
    return out


def refusals(rank: int, edp, ep, ep_rank: int) -> dict:
    """An expert handed to the dense state; experts marked with their EP group, whose ranks hold others."""
    out = {}
    for case, group in (("dense state", None), ("wrong group", ep)):
        model = Model(ep_rank)
        mark_experts(model.experts, edp if group is None else group, first=ep_rank * LOCAL)
        state = EDGCState(group, EDGCConfig(**COMPRESS), model=model)
        model(batch(rank, 0)).backward()
        local = [p.grad.clone() for p in model.parameters()]
        try:
            state.synchronize(model.named_parameters() if group is None else expert_parameters(model))
            line = ""
        except (RuntimeError, SettingsDiffer) as error:
            line = str(error)
        untouched = all(torch.equal(a, p.grad) for a, p in zip(local, model.parameters()))
        out[case] = {"line": line, "untouched": untouched and state.step == 0}
    return out


@pytest.fixture(scope="module")
def ddp_runs():
    return run_distributed(ddp_style, 4)


def test_the_warm_up_averages_dense_over_all_ranks_and_experts_over_their_replicas(ddp_runs):
    for _rank, out in enumerate(ddp_runs):
        local, synced = out["gathered"][0], out["records"][0]["grads"]
        assert out["records"][0]["phase"] == "warmup"
        assert torch.allclose(synced["dense.weight"], sum(local["dense.weight"]) / 4, atol=1e-6)
        replicas = [r for r in range(4) if ddp_runs[r]["ep_rank"] == out["ep_rank"]]
        mean = sum(local["experts.w"][r] for r in replicas) / 2
        assert torch.allclose(synced["experts.w"], mean, atol=1e-6)
        assert not torch.allclose(mean, sum(local["experts.w"]) / 4)  # the whole group's would be wrong


def test_compressed_steps_keep_replicas_identical_and_conserve_the_mean(ddp_runs):
    for out in ddp_runs:
        assert [r["phase"] for r in out["records"]] == ["warmup"] + ["compress"] * 5
        for step, record in enumerate(out["records"][1:], start=1):
            everyone = out["gathered"][step + 1]
            assert all(torch.equal(g, everyone["dense.weight"][0]) for g in everyone["dense.weight"])
            replicas = [r for r in range(4) if ddp_runs[r]["ep_rank"] == out["ep_rank"]]
            assert torch.equal(everyone["experts.w"][replicas[0]], everyone["experts.w"][replicas[1]])
            for i in range(LOCAL):  # Ĝ + mean(e) = mean(G + e) for each expert's own matrix
                name = f"experts.w[{out['ep_rank'] * LOCAL + i}]"
                before, after = out["errors"][step][name]
                m = sum(ddp_runs[r]["records"][step]["local"]["experts.w"][i] + before[r] for r in replicas) / 2
                assert torch.allclose(record["grads"]["experts.w"][i] + sum(after) / 2, m, atol=1e-5), name


def test_ranks_split_by_tokens_are_agreed_and_cost_the_uniform_bytes(ddp_runs):
    for out in ddp_runs:
        last = out["records"][-1]["ranks"]
        first = out["ep_rank"] * LOCAL
        heavy, light = last[f"experts.w[{first}]"], last[f"experts.w[{first + 1}]"]
        assert heavy > light >= 1 and heavy + light == 2 * COMPRESS["r_max"]  # twice the tokens, the same bytes
        replicas = [r for r in range(4) if ddp_runs[r]["ep_rank"] == out["ep_rank"]]
        assert all(ddp_runs[r]["records"][-1]["ranks"] == last for r in replicas)


def test_a_resumed_pair_of_states_continues_bit_for_bit(ddp_runs):
    for out in ddp_runs:
        for resumed, uninterrupted in zip(out["resumed"], out["records"][3:]):
            for name, grad in uninterrupted["grads"].items():
                assert torch.equal(resumed["grads"][name], grad), name
            assert resumed["ranks"] == uninterrupted["ranks"]


@pytest.mark.parametrize(
    "case, words",
    [
        ("dense state", ("experts.w holds experts", "global ranks [", "a state of their own")),
        ("wrong group", ("setting experts held differs",)),
    ],
)
def test_experts_on_the_wrong_group_are_refused_in_one_line_before_anything_is_sent(ddp_runs, case, words):
    lines = [out["refusals"][case]["line"] for out in ddp_runs]
    assert all(line and "\n" not in line for line in lines), lines
    assert all(word in lines[0] for word in words), lines[0]
    assert all(out["refusals"][case]["untouched"] for out in ddp_runs)
