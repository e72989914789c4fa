import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgc import EDGCConfig, EntropySampler, gaussian_entropy, histogram_entropy


class Ops(TorchDispatchMode):
    """The names of the operators run under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_uniform_sample_has_log_bins_entropy():
    x = torch.rand(2_000_000, generator=torch.Generator().manual_seed(0))
    assert histogram_entropy(x, bins=1000) == pytest.approx(math.log(1000), abs=2e-3)


def test_gaussian_histogram_entropy_matches_differential_minus_log_bin_width():
    sigma = 0.01
    x = torch.randn(2_000_000, generator=torch.Generator().manual_seed(1)) * sigma
    bins = 1000
    width = float(x.max() - x.min()) / bins
    expected = 0.5 * math.log(2 * math.pi * math.e * sigma**2) - math.log(width)
    assert histogram_entropy(x, bins) == pytest.approx(expected, abs=0.01)


def test_gaussian_closed_form():
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(2)) * 3.0
    assert gaussian_entropy(x) == pytest.approx(0.5 * math.log(2 * math.pi * math.e * 9.0), abs=2e-3)


def test_histogram_entropy_is_scale_invariant_and_zero_for_constants():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    assert histogram_entropy(x * 1e-4) == pytest.approx(histogram_entropy(x), abs=1e-3)
    assert histogram_entropy(torch.full((100,), 0.5)) == 0.0


def histc_samples():
    """Finite samples whose values sit on bin edges (multiples of 0.1, a linspace), at the range's
    ends (two values), or anywhere (normal, tiny, fp16 at GradScaler scale)."""
    generator = torch.Generator().manual_seed(5)
    return [
        torch.randn(20_000, generator=generator),
        torch.randint(-50, 50, (5000,), generator=generator).float() * 0.1,
        torch.linspace(-1.0, 1.0, 3001),
        torch.tensor([-2.0, 3.0]),
        torch.randn(4000, generator=generator) * 1e-30,
        (torch.randn(4000, generator=generator) * 8192).half().float(),
    ]


@pytest.mark.parametrize("bins", [2, 7, 10, 1000])
def test_histogram_counts_are_those_of_histc_on_cpu(bins):
    from edgc.control.histogram import histogram_counts

    for sample in histc_samples():
        low, high = torch.aminmax(sample)
        expected = torch.histc(sample, bins=bins, min=float(low), max=float(high))
        counts = histogram_counts(sample, bins)
        assert counts.dtype == torch.int64 and torch.equal(counts, expected.long())
        # The entropy from them: the same up to the order of the fp32 sum.
        p = expected[expected > 0] / expected.sum()
        assert histogram_entropy(sample, bins) == pytest.approx(float(-(p * p.log()).sum()), rel=1e-6, abs=1e-7)
    constant = histogram_counts(torch.full((100,), 0.5), bins)
    assert constant[0] == 100 and constant.sum() == 100


def test_histogram_entropy_is_deterministic_and_reads_the_host_once():
    """histc on CUDA raises under deterministic algorithms; a range read to the host syncs a GPU."""
    from edgc_probes.host_reads import counted_host_reads

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for sample in histc_samples() + [torch.full((100,), 0.5)]:
            with Ops() as ops, counted_host_reads() as host:
                value = histogram_entropy(sample, 1000)
            assert math.isfinite(value) and value >= 0.0
            assert host.reads == 1  # the result, read once (`edgc.device.timing.to_host`)
            assert "_local_scalar_dense.default" not in ops.names, ops.names
            assert not {"histc.default", "bincount.default", "nonzero.default"} & set(ops.names), ops.names
    finally:
        torch.use_deterministic_algorithms(before)


def test_sampler_samples_every_kth_step_and_element_and_counts_nonfinite():
    sampler = EntropySampler(EDGCConfig(iteration_sample_ratio=0.5, gradient_sample_ratio=0.25, entropy_bins=10))
    grad = torch.arange(16.0)
    grad[4] = float("inf")  # element 4 is sampled (stride 4), element 5 is not
    grad[5] = float("nan")
    values = []
    for step in range(4):
        sampler.begin(step)
        sampler.add([grad])
        values.append(sampler.finish())
    assert values[1] is None and values[3] is None
    expected = histogram_entropy(torch.tensor([0.0, 8.0, 12.0]), bins=10)  # 4 → inf dropped
    assert values[0] == pytest.approx(expected) and values[2] == pytest.approx(expected)
    assert sampler.nonfinite_total == 2
    assert [s for s, _ in sampler.history] == [0, 2]
    assert sampler.calls == 2 and sampler.seconds_total > 0


def test_a_sampled_step_gathers_each_job_with_one_cat_and_estimates_without_atomics_or_reads():
    """A job's tensors (a bucket's, or several fused) are gathered with one cat of strided views, straight
    into the step's one vector once the step's size is known (no copy per tensor, no join at the end);
    the estimate counts into private rows (no index-add over shared bins) and reaches the host in one
    read at the step's end (`edgc.device.totals.StepTotals`)."""
    from edgc.device.totals import StepTotals
    from edgc_probes.host_reads import counted_host_reads

    sampler = EntropySampler(EDGCConfig(iteration_sample_ratio=1.0, gradient_sample_ratio=0.5, entropy_bins=10))
    generator = torch.Generator().manual_seed(6)
    sizes = [[101, 63], [50]]
    flats = [torch.randn(sum(bucket), generator=generator) for bucket in sizes]
    buckets = [list(flat.split(bucket)) for flat, bucket in zip(flats, sizes)]
    buckets[0][1] = buckets[0][1].view(7, 9)
    values = []
    for step in range(2):
        totals = StepTotals()
        with Ops() as ops, counted_host_reads() as host:
            sampler.begin(step)
            for bucket in buckets:
                sampler.add(bucket)
            sampler.close(totals)
            totals.send(torch.device("cpu"))
            totals.read()
            values.append(sampler.settle(totals))
        assert host.reads == 1
    joined = torch.cat([t.reshape(-1)[::2] for bucket in buckets for t in bucket])
    assert values == [pytest.approx(histogram_entropy(joined, bins=10))] * 2
    # one cat per bucket's job straight into the step's vector (the first step: a part each), no join at the end
    assert ops.names.count("cat.out") == 2 and "index_select.out" not in ops.names, ops.names
    assert "cat.default" not in ops.names, ops.names
    assert not any(name.startswith(("index_add", "histc", "bincount")) for name in ops.names), ops.names


def test_sampler_copies_the_sample_before_the_gradient_is_overwritten():
    sampler = EntropySampler(EDGCConfig(iteration_sample_ratio=1.0, gradient_sample_ratio=1.0))
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    expected = histogram_entropy(grad)
    sampler.begin(0)
    sampler.add([grad])
    grad.zero_()  # what an all-reduce does to the bucket afterwards
    assert sampler.finish() == pytest.approx(expected)


def test_sampler_state_round_trip():
    config = EDGCConfig(iteration_sample_ratio=1.0)
    sampler = EntropySampler(config)
    for step in range(3):
        sampler.begin(step)
        sampler.add([torch.randn(100)])
        sampler.finish()
    restored = EntropySampler(config)
    restored.load_state_dict(sampler.state_dict())
    assert restored.history == sampler.history


def test_samples_are_taken_once_per_window_when_no_decision_reads_them():
    from edgc import EDGCConfig
    from edgc.control.entropy import EntropySampler

    reads = EDGCConfig(
        total_steps=400, window=20, iteration_sample_ratio=0.2, rank_budget=4, r_max=8, budget_signal="entropy"
    )
    fixed = EDGCConfig(total_steps=400, window=20, iteration_sample_ratio=0.2, rank_budget=4, r_max=8)
    assert reads.decisions_read_samples and not fixed.decisions_read_samples
    assert [s for s in range(40) if EntropySampler(reads).due(s)] == [0, 5, 10, 15, 20, 25, 30, 35]
    assert [s for s in range(40) if EntropySampler(fixed).due(s)] == [0, 20]  # the report's one per window
    assert EDGCConfig(total_steps=400, window=20).decisions_read_samples  # the paper's rules read entropy


def test_report_only_estimates_thin_a_large_sample_and_decision_samples_do_not():
    from edgc.control.entropy import REPORT_SAMPLE_CAP, EntropySampler, histogram_entropy

    reads = EDGCConfig(
        total_steps=400, window=20, rank_budget=4, r_max=8, budget_signal="entropy", gradient_sample_ratio=0.5
    )
    fixed = EDGCConfig(total_steps=400, window=20, rank_budget=4, r_max=8, gradient_sample_ratio=0.5)
    grad = torch.randn(3 * REPORT_SAMPLE_CAP) ** 3  # heavy tails: thinning shows in the estimate
    sample = grad[::2]
    values = {}
    for name, config in (("reads", reads), ("fixed", fixed)):
        sampler = EntropySampler(config)
        sampler.begin(0)
        sampler.add([grad])
        values[name] = sampler.finish()
    assert values["reads"] == pytest.approx(histogram_entropy(sample))
    assert values["fixed"] == pytest.approx(histogram_entropy(sample[::2]))  # 1.5·cap elements → every 2nd
    assert values["fixed"] != values["reads"]


def test_report_only_samples_fold_the_cap_into_the_stride_once_the_step_size_is_known():
    """After one step the report's thinning is part of the stride (every 2·2-th element of each
    tensor here), so the full β sample is never gathered; the count survives a checkpoint, so a
    resumed run samples the same elements; decision samples keep the plain β stride."""
    from edgc.control.entropy import REPORT_SAMPLE_CAP, EntropySampler, histogram_entropy

    fixed = EDGCConfig(
        total_steps=400, window=20, rank_budget=4, r_max=8, gradient_sample_ratio=0.5, iteration_sample_ratio=1.0
    )
    reads = EDGCConfig(
        total_steps=400,
        window=20,
        rank_budget=4,
        r_max=8,
        gradient_sample_ratio=0.5,
        iteration_sample_ratio=1.0,
        budget_signal="entropy",
    )
    grads = [torch.randn(2 * REPORT_SAMPLE_CAP + 1) ** 3, torch.randn(REPORT_SAMPLE_CAP - 1) ** 3]  # odd sizes
    thinned = torch.cat([g[::4] for g in grads])  # 3·cap elements, β-sample 1.5·cap → every 2nd of it
    after_gathering = torch.cat([g[::2] for g in grads])[::2]  # the first step's: one bucket, no count yet
    assert not torch.equal(thinned, after_gathering)

    def step(sampler, number, buckets):  # the report's samples: one per window of 20 steps
        sampler.begin(number)
        for bucket in buckets:
            sampler.add(bucket)
        return sampler.finish()

    one_bucket, two_buckets = [grads], [[g] for g in grads]

    sampler = EntropySampler(fixed)
    assert step(sampler, 0, one_bucket) == pytest.approx(histogram_entropy(after_gathering))
    assert step(sampler, 20, one_bucket) == pytest.approx(histogram_entropy(thinned))
    assert step(EntropySampler(fixed), 0, two_buckets) == pytest.approx(histogram_entropy(thinned))  # per bucket
    assert sampler.elements_per_step == sum(g.numel() for g in grads)

    resumed = EntropySampler(fixed)
    resumed.load_state_dict(sampler.state_dict())
    assert step(resumed, 40, one_bucket) == pytest.approx(histogram_entropy(thinned))
    old_checkpoint = {k: v for k, v in sampler.state_dict().items() if k != "elements_per_step"}
    resumed.load_state_dict(old_checkpoint)  # an earlier version's: one step gathers, then thins
    assert step(resumed, 60, one_bucket) == pytest.approx(histogram_entropy(after_gathering))

    deciding = EntropySampler(reads)
    for number in range(2):
        assert step(deciding, number, one_bucket) == pytest.approx(
            histogram_entropy(torch.cat([g[::2] for g in grads]))
        )


def test_decision_samples_are_capped_by_entropy_sample_cap_and_uncapped_with_none():
    """A decision's sample holds about ``entropy_sample_cap`` elements at most: thinned after
    gathering on the first step, by the stride once the step's size is known; None keeps every
    β-th element."""
    from edgc.control.entropy import EntropySampler, histogram_entropy

    settings = dict(
        total_steps=400, window=20, r_max=8, gradient_sample_ratio=0.5, iteration_sample_ratio=1.0, entropy_bins=100
    )
    grads = [torch.randn(40_001) ** 3, torch.randn(23_999) ** 3]
    sampler = EntropySampler(EDGCConfig(entropy_sample_cap=8_000, **settings))
    uncapped = EntropySampler(EDGCConfig(entropy_sample_cap=None, **settings))
    full = histogram_entropy(torch.cat([g[::2] for g in grads]), bins=100)
    for number in range(2):
        for each in (sampler, uncapped):
            each.begin(number)
            each.add(grads)
        assert uncapped.finish() == pytest.approx(full)
        thinned = sampler.finish()
        # the first step gathers 32,001 elements (one bucket) and keeps every ⌈32,001 / 8,000⌉ = 5th;
        # then the stride is 2·⌈64,000 / 2 / 8,000⌉ = 8
        expected = torch.cat([g[::2] for g in grads])[::5] if number == 0 else torch.cat([g[::8] for g in grads])
        assert expected.numel() <= 8_000 + len(grads)  # each tensor's stride starts at its element 0
        assert thinned == pytest.approx(histogram_entropy(expected, bins=100))
    with pytest.raises(ValueError, match="entropy_sample_cap"):
        EDGCConfig(entropy_sample_cap=10, entropy_bins=1000)


def test_a_state_given_its_model_thins_even_its_first_report_sample():
    """With ``model=`` the element count is known before any step, so the very first report sample
    (step 0, before any count) is taken by the wide stride too."""
    from edgc import EDGCState

    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    state = EDGCState(None, EDGCConfig(total_steps=400, window=20, rank_budget=4, r_max=8), model=model)
    assert state.sampler.elements_per_step == sum(p.numel() for p in model.parameters())
    assert (
        EDGCState(None, EDGCConfig(total_steps=400, window=20, rank_budget=4, r_max=8)).sampler.elements_per_step
        is None
    )
