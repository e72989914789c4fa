"""Settings that must agree across ranks are compared before anything is sent (`edgc.distributed.agreement`), on 2
gloo processes (one start-up): every `EDGCConfig` field, every argument of every registered sync
method, a value "auto" resolves to, DiLoCo's ``sync_every`` and fragments, the method itself, each
varied on rank 1 alone, ends in the same one line on both ranks, naming the setting and both values,
with the gradients still each rank's own and no step counted. The issue's two scripts: ``r_max`` 4
and 8 under DDP (gloo aborted at step 2), ``rank_budget`` 4 and 8 (rank 0's governed in silence).
"""

import inspect

import pytest
import torch
from distributed_harness import run_distributed
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from edgc import AllReduceState, EDGCConfig, EDGCState, LowRankConfig, edgc_hook
from edgc.config import dotted_fields
from edgc.distributed.agreement import SettingsDiffer
from edgc.integrations.diloco import DiLoCo
from edgc.sync.sync_methods import sync_method, sync_method_names

BASE = dict(r_max=8, r_min=2, total_steps=100)
# field (the engine's: engine.NAME) → another valid value beside BASE (and the defaults)
ALTERNATIVES = {
    "r_max": 16,
    "r_min": 4,
    "rank_step": 2,
    "rank_granularity": 1,
    "window": 500,
    "adaptive": False,
    "rank_mapping": "cqm",
    "cqm_exponent": 1.0,
    "cqm_mc_samples": 2,
    "iteration_sample_ratio": 0.2,
    "gradient_sample_ratio": 0.5,
    "entropy_sample_cap": 1 << 20,
    "entropy_bins": 500,
    "entropy_estimator": "gaussian",
    "total_steps": 200,
    "warmup_fraction": 0.2,
    "warmup_error_test": False,
    "min_warmup_steps": 3,
    "profile_max_rank": 64,
    "profile_steps_per_rank": 3,
    "entropy_significance": 2.0,
    "max_warmup_fraction": 0.4,
    "error_band": (0.05, 0.2),
    "rank_budget": 4.0,
    "budget_signal": "gradnorm",
    "front_load": 3.0,
    "rank_schedule": ((0, 4),),
    "rank_split": "tokens",
    "fusion_mb": 1.0,
    "engine.min_compression_rate": 1.0,
    "engine.error_feedback": False,
    "engine.error_feedback_dtype": "gradient",
    "engine.communication_dtype": "bfloat16",
    "engine.orthogonalization_epsilon": 1e-10,
    "engine.orthonormalization": "cholesky2-fp64",
    "engine.seed": 715,
    "engine.rank_change": "truncate",
    "engine.cuda_graphs": True,
}
# a registered sync method's class → its constructor's arguments, each with two valid values (rank 1
# takes the one its name does not fix, or the first: so the first must differ from the default)
METHOD_ALTERNATIVES = {
    "CastState": {"dtype": ("bfloat16", "float16")},
    "TopKState": {"ratio": (0.02, 0.03), "error_feedback": (False, True)},
    "RandomKState": {
        "ratio": (0.02, 0.03),
        "error_feedback": (False, True),
        "rescale": (True, False),
        "seed": (715, 716),
    },
    "QSGDState": {"chunk": (512, 256), "error_feedback": (False, True), "seed": (715, 716)},
    "QuantizedState": {"bits": (4, 5), "chunk": (128, 64), "error_feedback": (False, True)},
    "AllocatedQuantState": {"bits": (4.0, 5.0), "chunk": (128, 64), "error_feedback": (False, True)},
    "SparseQuantState": {
        "density": (64 / 4096, 32 / 4096),
        "chunk": (2048, 1024),
        "groups": (3, 4),
        "error_feedback": (False, True),
        "aggregate": ("senders", "all"),
        "tile": (64, 0),
    },
    "AllocatedSparseState": {
        "density": (64 / 4096, 128 / 4096),
        "chunk": (2048, 1024),
        "groups": (3, 4),
        "error_feedback": (False, True),
    },
    "TwoStageQuantState": {
        "bits": (4, 5),
        "block": (128, 64),
        "bucket_values": (1 << 12, 1 << 13),
        "error_feedback": (False, True),
    },
}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def backward(module: nn.Module, rank: int, step: int = 0) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
    module(x).square().mean().backward()


def refused(module: nn.Module, state, call) -> dict:
    """The one line ``call`` ends in, and whether nothing was sent: each gradient still this rank's own,
    no step counted."""
    local = [p.grad.clone() for p in module.parameters()]
    try:
        call()
        line = ""
    except SettingsDiffer as error:
        line = str(error)
    untouched = all(torch.equal(a, p.grad) for a, p in zip(local, module.parameters()))
    return {"line": line, "untouched": untouched and state.step == 0}


def plain(rank: int, module: nn.Module, state) -> dict:
    return refused(module, state, lambda: state.synchronize(module.named_parameters()))


def config_with(field: str, value) -> EDGCConfig:
    """BASE with ``field`` (``engine.NAME``: the engine's) set to ``value``."""
    table, _, name = field.rpartition(".")
    return EDGCConfig(**BASE, engine=LowRankConfig(**{name: value})) if table else EDGCConfig(**{**BASE, field: value})


def config_fields(rank: int) -> dict:
    module = mlp()
    backward(module, rank)
    out = {}
    for field, other in ALTERNATIVES.items():
        config = config_with(field, other) if rank == 1 else EDGCConfig(**BASE)
        out[field] = plain(rank, module, EDGCState(None, config, model=module))
    engine = LowRankConfig(force_accelerator_kernels=rank == 1)  # "auto" resolves to an accelerator's method
    state = EDGCState(None, EDGCConfig(**BASE, engine=engine), model=module)
    out["resolved"] = plain(rank, module, state)
    out["method"] = plain(rank, module, (AllReduceState if rank else EDGCState)(None, model=module))
    return out


def method_arguments(rank: int) -> dict:
    module = mlp()
    backward(module, rank)
    out = {}
    for name in sync_method_names():
        method = sync_method(name)
        for argument, (first, second) in METHOD_ALTERNATIVES[method.reducer.__name__].items():
            other = second if method.options.get(argument) == first else first
            given = {**method.options, **({argument: other} if rank == 1 else {})}
            out[name, argument] = plain(rank, module, method.reducer(None, model=module, **given))
    return out


def ddp_runs(rank: int) -> dict:
    """The issue's scripts under DDP: r_max 4 and 8, then rank_budget 4 and 8, compressing from step 2."""
    out = {}
    for field, values in (("r_max", (4, 8)), ("rank_budget", (4.0, 6.0))):
        config = dict(r_max=8, r_min=2, total_steps=20, min_warmup_steps=2, warmup_error_test=False)
        config[field] = values[rank]
        module = mlp()
        model = DDP(module)
        state = EDGCState(None, EDGCConfig(**config), model=model)
        model.register_comm_hook(state, edgc_hook)
        try:
            for step in range(4):
                model.zero_grad()
                backward(model, rank, step)
            out[field] = {"line": "", "step": state.step}
        except RuntimeError as error:  # raised in DDP's hook: backward passes its message on
            out[field] = {"line": str(error), "step": state.step}
    return out


def diloco_runs(rank: int) -> dict:
    """DiLoCo with another sync_every, or other fragments, on rank 1: refused at the first outer sync."""
    out = {}
    for case in ("sync_every", "fragments"):
        module = mlp()
        fragments = [module] if case == "sync_every" or rank == 0 else [module[0], module[2]]
        inner = torch.optim.SGD(module.parameters(), lr=0.1)
        outer = torch.optim.SGD(module.parameters(), lr=0.7)
        sync_every = 4 if case == "sync_every" and rank == 1 else 2
        try:
            with DiLoCo(None, fragments, inner, outer, sync_every=sync_every, sync_method="quant3"):
                for step in range(8):
                    inner.zero_grad()
                    backward(module, rank, step)
                    inner.step()
            out[case] = ""
        except SettingsDiffer as error:
            out[case] = str(error)
    return out


def worker(rank: int, world_size: int) -> dict:
    return {
        "config": config_fields(rank),
        "methods": method_arguments(rank),
        "ddp": ddp_runs(rank),
        "diloco": diloco_runs(rank),
    }


@pytest.fixture(scope="module")
def results():
    return run_distributed(worker, 2)


def one_line_on_both(lines: list[str], *words: str) -> None:
    assert lines[0] == lines[1], lines  # the same line on every rank
    assert "\n" not in lines[0] and all(word in lines[0] for word in words), lines[0]


def test_the_table_holds_every_config_field_and_every_methods_argument():
    assert set(ALTERNATIVES) == set(dotted_fields(EDGCConfig().to_dict()))
    for name in sync_method_names():
        reducer = sync_method(name).reducer
        arguments = set(inspect.signature(reducer).parameters) - {"process_group", "model"}
        assert arguments == set(METHOD_ALTERNATIVES[reducer.__name__]), reducer


@pytest.mark.parametrize("field", sorted(ALTERNATIVES))
def test_every_config_field_that_differs_is_refused_before_anything_is_sent(results, field):
    got = [out["config"][field] for out in results]
    base = dotted_fields(EDGCConfig(**BASE).to_dict())[field]
    other = dotted_fields(config_with(field, ALTERNATIVES[field]).to_dict())[field]
    one_line_on_both(
        [g["line"] for g in got], f"setting EDGCConfig.{field} differs", f"{base!r} on rank 0", f"{other!r} on rank 1"
    )
    assert all(g["untouched"] for g in got)


def test_a_value_auto_resolves_to_is_compared_and_so_is_the_method(results):
    resolved = [out["config"]["resolved"] for out in results]
    one_line_on_both([r["line"] for r in resolved], "orthonormalization in use", "'householder' on rank 0")
    method = [out["config"]["method"] for out in results]
    one_line_on_both([m["line"] for m in method], "setting method differs", "'AllReduceState' on rank 1")
    assert all(r["untouched"] for r in resolved + method)


@pytest.mark.parametrize(
    "case", [(n, a) for n in sync_method_names() for a in sorted(METHOD_ALTERNATIVES[sync_method(n).reducer.__name__])]
)
def test_every_argument_of_every_sync_method_is_compared(results, case):
    got = [out["methods"][case] for out in results]
    one_line_on_both([g["line"] for g in got], "differs across its group", "on rank 0", "on rank 1")
    assert all(g["untouched"] for g in got)


def test_the_issues_ddp_scripts_end_in_one_line_at_the_first_step(results):
    for field, words in (
        ("r_max", ("EDGCConfig.r_max", "4 on rank 0", "8 on rank 1")),
        ("rank_budget", ("EDGCConfig.rank_budget", "4.0 on rank 0", "6.0 on rank 1")),
    ):
        got = [out["ddp"][field] for out in results]
        one_line_on_both([g["line"] for g in got], *words)
        assert [g["step"] for g in got] == [0, 0]


def test_diloco_settings_are_compared_at_the_first_outer_sync(results):
    one_line_on_both(
        [out["diloco"]["sync_every"] for out in results], "DiLoCo.sync_every", "2 on rank 0", "4 on rank 1"
    )
    one_line_on_both(
        [out["diloco"]["fragments"] for out in results], "DiLoCo.fragments", "[4] on rank 0", "[2, 2] on rank 1"
    )


# DiLoCo's arguments each replica may set for itself: where θ_global is kept, its optimizers (their
# settings are the caller's), the model (its fragments are agreed by their sizes), the EDGC config and
# power_iterations (the state's own settings)
DILOCO_LOCAL = {"self", "process_group", "model_fragments", "inner_optimizer", "outer_optimizer", "config"}
DILOCO_LOCAL |= {"backup_device", "pin_memory", "power_iterations"}


def test_every_diloco_argument_that_shapes_its_outer_sync_is_agreed():
    module = mlp()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    diloco = DiLoCo(None, [module], optimizer, optimizer, sync_every=2)
    agreed = diloco.state.agreed_settings(torch.device("cpu"))
    arguments = set(inspect.signature(DiLoCo.__init__).parameters) - DILOCO_LOCAL
    assert {f"DiLoCo.{name}" for name in arguments} <= set(agreed), sorted(agreed)
    assert "DiLoCo.fragments" in agreed and "power_iterations" in EDGCState(None).agreed_settings(torch.device("cpu"))
