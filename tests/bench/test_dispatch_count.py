"""edgc_probes.dispatch_count: the kernel-launching dispatches of a compressed step, counted on the CPU."""

import json
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # distributed_harness

from distributed_harness import run_distributed  # noqa: E402

from edgc import EDGCConfig  # noqa: E402
from edgc.device.graphs import GraphRegion  # noqa: E402
from edgc_bench.engine_cost import matrix_byte_floors  # noqa: E402
from edgc_probes.capture_check import passing_regions  # noqa: E402
from edgc_probes.dispatch_count import (  # noqa: E402
    GRAPH_LAUNCH,
    DispatchCounter,
    count_engine_call,
    count_gpt2_step,
    count_hook_step,
)
from edgc_probes.gpt2_layout import GPT2Layout, gpt2_parameters  # noqa: E402
from edgc_probes.stand_ins import ddp_buckets, ready_order  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = json.loads((ROOT / "docs" / "gpu" / "count" / "count.json").read_text())
COST = json.loads((ROOT / "docs" / "engine" / "cost.json").read_text())


def test_views_metadata_and_allocations_are_not_counted():
    x = torch.ones(4, 4)
    with DispatchCounter() as counter:
        y = torch.empty(4, 4)  # allocation only
        torch.empty_like(y)
        y.zero_()  # 1
        z = x.view(16).view(4, 4).t()  # views
        z.t_()  # an in-place view op
        torch.mm(x, z)  # 1
        y.add_(x.detach())  # 1 (detach is a view)
        x.reshape(2, 8).clone()  # 1: a contiguous reshape is a view, the clone is not
    assert counter.by_op == {"zero_": 1, "mm": 1, "add_": 1, "clone": 1}
    assert counter.total == 4


def test_bytes_are_each_input_read_and_each_output_written_once():
    x, y = torch.ones(4, 4), torch.ones(4, 4, dtype=torch.bfloat16)
    with DispatchCounter() as counter:
        x.add_(y)  # reads x (64 B) and y (32 B), writes x (64 B)
        torch.mm(x, x)  # reads two operands, writes a new 64 B
        x.copy_(y)  # reads y, overwrites x without reading it
        torch._foreach_add_([x, x], [y, y])  # mixed dtypes: PyTorch's per-tensor path, two kernels
    assert counter.bytes_by_op == {"add_": 160, "mm": 192, "copy_": 96, "_foreach_add_": 320}
    assert counter.by_op["_foreach_add_"] == 2 and counter.total_bytes == 768


def test_live_storages_count_what_is_allocated_under_them_while_it_lives():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgc_probes.live_memory import LiveStorages

    with FakeTensorMode():
        before = torch.empty(1000)  # allocated before: never counted
        with LiveStorages() as live:
            kept = torch.empty(100)  # 400 B
            temporary = before * 2  # 4,000 B, freed below
            before.view(10, 100).add_(1)  # a view and an in-place op: nothing new
            del temporary
            assert live.live_bytes() == 400
            live.reset_peak()
            torch.cat([kept, kept])  # 800 B alive for a moment
    assert kept.numel() == 100 and live.peak_bytes == 1200


def test_fake_tensors_count_what_real_tensors_do():
    fake = count_engine_call((48, 80), 2, rank=4)
    real = count_engine_call((48, 80), 2, rank=4, fake=False)
    assert fake.by_op == real.by_op and fake.dispatches == real.dispatches > 0
    assert fake.compressed == real.compressed == 2


def test_the_counted_step_is_a_steady_compressed_step():
    named = gpt2_parameters("tiny")
    once, twice = (count_hook_step(named, bucket_cap_mb=0.25, rank=8, settle_steps=n) for n in (1, 2))
    assert once.phase == "compress" and once.rank == 8
    assert once.by_op == twice.by_op
    assert once.host_reads == 1
    assert once.matrices == sum(len(shape) >= 2 for _, shape in named) == once.compressed
    # the accelerator's fusion gathers this small model's buckets into one job, started by the last
    # bucket: all of the step follows its entry
    assert once.buckets > 1 and once.extra["after_last_bucket"] == once.dispatches


def ddp_layout_worker(rank, world_size, caps):
    """Per cap and dtype: the parameters of each bucket DDP hands to the hook in a compressed step
    (GPT2Layout, EDGC at rank 8), and the collectives that step issued."""
    from edgc import EDGCConfig, EDGCState, edgc_hook

    seen = {}
    for dtype in (torch.float32, torch.bfloat16):
        for cap in caps:
            torch.manual_seed(0)
            model = GPT2Layout("tiny").to(dtype)
            index = {id(p): i for i, p in enumerate(model.parameters())}
            ddp = DDP(model, bucket_cap_mb=cap)
            state = EDGCState(None, EDGCConfig.static(8, total_steps=1000, warmup_fraction=0.0), model=ddp)
            buckets = []

            def recording_hook(state, bucket):
                buckets.append([index[id(p)] for p in bucket.parameters()])
                return edgc_hook(state, bucket)

            ddp.register_comm_hook(state, recording_hook)
            tokens = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(1))
            for _ in range(4):  # the warm-up's 2 steps (DDP rebuilds its buckets), Q's creation, a steady step
                buckets.clear()
                ddp(input_ids=tokens, labels=tokens).loss.backward()
            seen[str(dtype), cap] = (buckets, state.last_step_metrics["phase"], state.last_step_metrics["collectives"])
    return seen


def test_buckets_and_collectives_are_those_of_ddp():
    named = gpt2_parameters("tiny")
    names, shapes = [n for n, _ in named], [s for _, s in named]
    (seen,) = run_distributed(ddp_layout_worker, 1, (None, 0.25))
    for (dtype, cap), (buckets, phase, _) in seen.items():
        dtype = getattr(torch, dtype.removeprefix("torch."))
        assert buckets == ddp_buckets(shapes, ready_order(names), dtype, cap), (dtype, cap)
        assert phase == "compress"
    assert len(seen[str(torch.float32), None][0]) == 2  # DDP's default: a first bucket of 1 MiB, then 25 MiB
    assert len(seen[str(torch.float32), 0.25][0]) > 4
    # what a step in a process group issues (the CPU's setting: each bucket its own job)
    config = EDGCConfig.static(8, total_steps=100_000, warmup_fraction=0.0, fusion_mb=0)
    counted = count_hook_step(named, bucket_cap_mb=0.25, rank=8, dtype=torch.float32, config=config)
    assert counted.collectives == seen[str(torch.float32), 0.25][2]


def test_gpt2_xl_steps_launch_few_kernels_at_ddps_buckets_and_fewer_at_200_mb():
    """The GPU path (buckets fused into 256 MB jobs, M and Ĝ gathered per job), counted at GPT-2 XL's
    shapes, rank 32, bf16. Before the engine was batched by shape: 6,049 and 2,968."""
    default, large = count_gpt2_step("xl"), count_gpt2_step("xl", 200)
    assert default.dispatches <= 2000 and large.dispatches <= 1000, (default.dispatches, large.dispatches)
    # The docs state these figures from docs/gpu/count/count.json: it must be this engine's count
    # (python -m edgc_bench.gpu --count-only --out docs/gpu/count; python scripts/to_docs.py dispatch-count).
    committed = {(row["model"], float(row["bucket_cap_mb"])): row["dispatches"] for row in COMMITTED["hook"]}
    assert (committed["xl", 25.0], committed["xl", 200.0]) == (default.dispatches, large.dispatches)
    assert default.compressed == large.compressed == 194  # every matrix compressed
    assert default.by_op.get("linalg_qr", 0) == 0  # no per-matrix library call
    assert default.linalg < default.matrices and large.linalg < large.matrices
    # The same step's bytes and memory per compressed element (docs/concepts/engine.md states them from
    # docs/engine/cost.json: python -m edgc_bench.engine_cost --out docs/engine/cost.json).
    per_element = default.per_compressed_element
    assert (COST["dispatches"], COST["bytes"], COST["memory"]["float32"]) == (
        default.dispatches,
        round(per_element(default.bytes), 3),
        round(per_element(default.peak_state_bytes), 3),
    )
    # no gathered copy of the gradients: beyond them, the fp32 error feedback (4 B) and at most 10 %
    assert per_element(default.peak_state_bytes) <= 1.1 * 4
    # the passes over M, G, e and Ĝ (the rank-independent bytes) at PyTorch's floor
    half_rank = count_gpt2_step("xl", rank=16)
    matrix_bytes = 2 * per_element(half_rank.bytes) - per_element(default.bytes)
    assert matrix_bytes <= matrix_byte_floors(2, 4)["stock"] + 0.01 and round(matrix_bytes, 2) == COST["matrix_bytes"]


def test_the_engine_page_shows_the_committed_cost(load_producer):
    script = load_producer("engine-cost")
    page = (ROOT / "docs" / "concepts" / "engine.md").read_text()
    assert script.block(COST, json.loads(script.BEFORE.read_text())) in page


def test_the_gpu_page_shows_the_committed_count(load_producer):
    script = load_producer("dispatch-count")
    page = (ROOT / "docs" / "gpu.md").read_text()
    assert script.block(COMMITTED, json.loads(script.BEFORE.read_text())) in page


def test_an_engine_call_grows_with_its_shapes_and_by_two_kernels_per_matrix():
    """Everything batches by shape except what touches the gradients, which lie in DDP's buckets:
    M = G + e (bf16 G, fp32 e: PyTorch's _foreach_add_ runs it tensor by tensor) and Ĝ's product."""
    one, two, eight = (count_engine_call((1600, 6400), k).dispatches for k in (1, 2, 8))
    assert two - one == 2 and eight - one == 2 * 7, (one, two, eight)
    same_dtype = [count_engine_call((1600, 6400), k, dtype=torch.float32).by_op for k in (1, 8)]
    assert same_dtype[1]["_foreach_add_"] == same_dtype[0]["_foreach_add_"] == 1  # one multi-tensor kernel
    assert same_dtype[1]["mm"] - same_dtype[0]["mm"] == 7
    mixed = count_engine_call((1600, 6400), 2, other_shape=(1600, 4800))
    assert mixed.dispatches > one  # a second shape adds its products


def launches(fn) -> DispatchCounter:
    with DispatchCounter() as counter:
        fn()
    return counter


def test_a_cat_counts_the_copies_cuda_launches_for_it():
    """CUDA batches a cat's copies when every input has the output's dtype (128 inputs a launch, 64 when
    one is strided) and copies input by input otherwise: a gather of strided bf16 views into fp32, as the
    entropy sample is taken, is one copy per tensor."""
    from edgc.control.entropy import strided_copy

    def cat(n: int, stride: int = 1, dtype=torch.float32, out_dtype=None, dims: int = 1):
        inputs = [torch.empty((2,) * (dims - 1) + (8,), dtype=dtype)[..., ::stride] for _ in range(n)]
        out = None if out_dtype is None else torch.empty(n * 8 // stride, dtype=out_dtype)
        return launches(lambda: torch.cat(inputs, out=out) if out is not None else torch.cat(inputs)).by_op["cat"]

    assert [cat(1), cat(128), cat(129), cat(200)] == [1, 1, 2, 2]  # contiguous: 128 a launch
    assert [cat(64, stride=2), cat(65, stride=2)] == [1, 2]  # strided: 64 a launch
    assert cat(30, stride=2, dtype=torch.bfloat16, out_dtype=torch.float32) == 30  # casts: one copy each
    assert cat(7, dims=5) == 7  # more than 4 dimensions: one copy each
    grads = [torch.empty(64, 48, dtype=torch.bfloat16) for _ in range(12)]
    assert launches(lambda: strided_copy(grads, 5)).by_op["cat"] == 12
    assert launches(lambda: torch.stack([torch.empty(4, 4) for _ in range(3)])).total == 1


class Regions:
    """Two graph regions over kept buffers; ``host_read`` plants a host read in the second."""

    def __init__(self, host_read: bool, graphs: bool = True):
        self.x, self.y = torch.ones(8), torch.zeros(8)
        self.first = GraphRegion("first", graphs=graphs)
        self.second = GraphRegion("second", graphs=graphs)
        self.host_read = host_read

    def step(self):
        self.first(lambda: self.y.copy_(self.x.mul(2).add_(1)), self.x, self.y)  # 3 launches
        self.second(self._second, self.x, self.y)  # 2 launches, + the read's

    def _second(self):
        self.x.add_(self.y).mul_(0.5)
        if self.host_read:
            self.x.sum().item()


def test_a_region_the_capture_checker_passes_counts_one_launch_per_call():
    regions = Regions(host_read=True)
    passed = passing_regions(regions.step)
    assert passed == {"first"}  # the second reads the host: its operators count one by one
    with DispatchCounter(passed) as counter:
        regions.step()
        regions.step()
    assert counter.by_op[GRAPH_LAUNCH] == 2 and counter.in_graphs == {"mul": 2, "add_": 2, "copy_": 2}
    assert counter.by_op["add_"] == counter.by_op["mul_"] == 2 and counter.by_op["sum"] == 2
    assert counter.total == 2 + 2 * 4  # two replays, the second region's four launches per step
    eager = Regions(host_read=False, graphs=False)  # a region that asks for no graphs runs its operators
    with DispatchCounter({"first", "second"}) as counter:
        eager.step()
    assert GRAPH_LAUNCH not in counter.by_op and counter.total == 5
