"""Mixture of experts (`edgc.distributed.experts`, `edgc.policies.rank_split`): dense gradients over the
whole data-parallel group, stacked experts over their expert-data-parallel group, each expert its own matrix.

Single process: the split of a stacked gradient into views (the rest: test_experts_found.py). On 4 gloo
processes, EP 2 × DP 2 (one call): with synchronize, the warm-up's averages are the exact means of their
groups (the experts' scaled by 1/ep), every compressed step keeps each expert identical on its replicas
and conserves Ĝ + mean(e) = mean(G/ep + e), ranks split by tokens are agreed and cost the uniform bytes,
a resumed pair of states continues bit for bit, and an expert handed to the dense state, or experts marked
with the wrong group, are refused in one line before anything is sent. Without marks: a torchtitan-style
DTensor sharded on the EP dimension is synced as experts by the state on its group (as if marked) and
refused in one line by the dense state; a ``GroupedExperts`` holding 2 of 4 experts as plain tensors is
refused. DDP: a DDP built after ``ignore_experts`` leaves the experts to their state; a DDP whose buckets
hold experts (ep 1, found by class) splits them into matrices. torchtitan's load balancing (an optimizer
pre-hook that reads and zeroes a per-global-expert counter) sees every count with a split by tokens on,
and an expert that gets no token for several steps is given rank 1.
"""

import expert_cases
import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

from edgc import EDGCConfig, EDGCState
from edgc.distributed.agreement import SettingsDiffer
from edgc.distributed.expert_sync import Experts
from edgc.distributed.experts import dense_parameters, expert_parameters, mark_experts

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
        route = self.route(len(x))
        self.tokens += torch.bincount(route, minlength=LOCAL).float()
        w = self.experts.w.to_local() if isinstance(self.experts.w, DTensor) else self.experts.w
        out = torch.stack([w[e] @ row for e, row in zip(route, h)])
        return out.square().mean()

    def route(self, rows: int) -> torch.Tensor:
        return torch.tensor([0, 0, 1] * (rows // 3))


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(6, D, generator=torch.Generator().manual_seed(1000 * step + rank))


# ---------------------------------------------------------------------------- one process
def test_a_stacked_gradient_splits_into_views_named_by_global_expert():
    grad = torch.zeros(2, 3, 4)
    experts = Experts({}, {})
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(2, 3, 4))
    mark_experts(model, None, first=6, ep=1)
    experts = Experts({"w": model._edgc_experts}, {"w": (2, 3, 4)})
    names, views = experts.expand(["bias", "w"], [torch.zeros(3), grad])
    assert names == ["bias", "w[6]", "w[7]"]
    views[2].fill_(1.0)
    assert grad[1].eq(1).all() and grad[0].eq(0).all()
    assert experts.matrix_shapes({"w": (2, 3, 4)})["w[7]"] == (3, 4)


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
        mark_experts(model.experts, edp, first=ep_rank * LOCAL, ep=2, tokens=model.tokens)
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
    out["unmarked"] = expert_cases.unmarked(Model, rank, mesh, ep_rank, COMPRESS, batch, 2)
    out["ddp"] = expert_cases.ddp_paths(Model, rank, mesh, ep_rank, COMPRESS, batch)
    out["balancing"] = expert_cases.load_balancing(Model, rank, mesh, ep_rank, COMPRESS, batch, 4)
    out["dead"] = expert_cases.dead_expert(Model, rank, mesh, ep_rank, COMPRESS, batch, 4)
    return out


def refusals(rank: int, edp, ep, ep_rank: int) -> dict:
    """An expert handed to the dense state; experts marked with their EP group, whose ranks hold others."""
    out = {}
    for case, group in (("dense state", None), ("wrong group", ep)):
        model = Model(ep_rank)
        mark_experts(model.experts, edp if group is None else group, first=ep_rank * LOCAL, ep=2)
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
        assert torch.allclose(synced["experts.w"], mean / 2, atol=1e-6)  # scaled by 1/ep (edgc.distributed.scaling)
        assert not torch.allclose(mean, sum(local["experts.w"]) / 4)  # the whole group's would be wrong


def test_compressed_steps_keep_replicas_identical_and_conserve_the_mean(ddp_runs):
    for out in ddp_runs:
        assert [r["phase"] for r in out["records"]] == ["warmup"] + ["compress"] * 5
        for step, record in enumerate(out["records"][1:], start=1):
            everyone = out["gathered"][step + 1]
            assert all(torch.equal(g, everyone["dense.weight"][0]) for g in everyone["dense.weight"])
            replicas = [r for r in range(4) if ddp_runs[r]["ep_rank"] == out["ep_rank"]]
            assert torch.equal(everyone["experts.w"][replicas[0]], everyone["experts.w"][replicas[1]])
            for i in range(LOCAL):  # Ĝ + mean(e) = mean(G/ep + e) for each expert's own matrix
                name = f"experts.w[{out['ep_rank'] * LOCAL + i}]"
                before, after = out["errors"][step][name]
                m = sum(ddp_runs[r]["records"][step]["local"]["experts.w"][i] / 2 + before[r] for r in replicas) / 2
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


# ---------------------------------------------------------------------------- without marks, DDP, counters
def test_a_torchtitan_style_expert_dtensor_without_marks_is_synced_as_experts_over_its_group(ddp_runs):
    for out in ddp_runs:
        first = out["ep_rank"] * LOCAL
        for found, marked in zip(out["unmarked"]["found"], out["records"]):  # the same steps as marked
            assert {f"experts.w[{first}]", f"experts.w[{first + 1}]"} <= set(found["ranks"])
            for name, grad in marked["grads"].items():
                assert torch.equal(found["grads"][name], grad), name


@pytest.mark.parametrize(
    "case, words",
    [
        ("dense state", ("experts.w holds experts split over the expert-parallel ranks", "a state on its")),
        ("split unnamed", ("experts.w holds 2 of its module's 4 experts", "mark_experts(module, group")),
    ],
)
def test_an_unmarked_expert_a_state_cannot_average_is_refused_in_one_line_naming_it(ddp_runs, case, words):
    lines = [out["unmarked"][case]["line"] for out in ddp_runs]
    assert all(line and "\n" not in line for line in lines), lines
    assert all(word in lines[0] for word in words), lines[0]
    assert all(out["unmarked"][case]["step"] == 0 for out in ddp_runs)


def test_a_ddp_built_after_ignore_experts_leaves_the_experts_to_their_state(ddp_runs):
    warmup = [out["ddp"]["ignored"][0] for out in ddp_runs]
    for out in ddp_runs:
        record = out["ddp"]["ignored"][0]
        assert record["phase"] == "warmup"
        local_dense = [r["grads"]["dense.weight"] for r in warmup]
        assert all(torch.equal(g, local_dense[0]) for g in local_dense)  # DDP averaged the dense part
        replicas = [r for r in range(4) if ddp_runs[r]["ep_rank"] == out["ep_rank"]]
        mean = sum(warmup[r]["local"] for r in replicas) / 2  # what DDP left: each rank's own experts
        assert torch.allclose(record["grads"]["experts.w"], mean / 2, atol=1e-6)
        assert "before wrapping it" in out["ddp"]["wrapped"] and "\n" not in out["ddp"]["wrapped"]


def test_a_ddp_bucket_holding_experts_splits_them_into_matrices(ddp_runs):
    for out in ddp_runs:
        warmup, compressed = out["ddp"]["in buckets"]
        assert {f"experts.w[{i}]" for i in range(2 * LOCAL)} <= set(compressed["ranks"])
        for record in (warmup, compressed):
            for name, grad in record["grads"].items():
                assert torch.equal(grad, ddp_runs[0]["ddp"]["in buckets"][0 if record is warmup else 1]["grads"][name])


def test_torchtitan_style_load_balancing_still_sees_its_counts_with_a_split_by_tokens(ddp_runs):
    for out in ddp_runs:
        balancing, first = out["balancing"], out["ep_rank"] * LOCAL
        assert all(torch.equal(s, c) for s, c in zip(balancing["seen"], balancing["counted"]))  # untouched
        assert balancing["bias"].abs().sum() > 0
        # the split's weights: this rank's experts' rows, summed over their replicas, per step
        assert balancing["weights"][1] == {f"experts.w[{first}]": 8.0, f"experts.w[{first + 1}]": 4.0}


def test_an_expert_that_gets_no_token_for_several_steps_is_given_rank_one(ddp_runs):
    for out in ddp_runs:
        first = out["ep_rank"] * LOCAL
        for record in out["dead"][2:]:  # after the first window's count
            assert record["ranks"][f"experts.w[{first + 1}]"] == 1
            assert record["ranks"][f"experts.w[{first}]"] > COMPRESS["r_max"]  # its share goes to the live one
            assert record["grad"][1].eq(0).all()
