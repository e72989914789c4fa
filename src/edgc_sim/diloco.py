"""DiLoCo across many replica groups: the time of an outer step, the utilisation, the time to a token
count, for torchft's DiLoCo, its FP8 path (from its algorithm) and edgc's outer syncs.

One replica group is ``gpus`` H100-class accelerators at one site (FSDP/HSDP inside it), joined to
the others by the site's link (``link_bits_per_s`` each way; every GPU's share of an outer sync
leaves through it). An outer step is H inner steps of ``tokens_per_step`` tokens per group
(6 · parameters FLOPs a token at the device's matmul rate × MFU) followed by the outer sync, not
overlapped (DiLoCo's default; Streaming DiLoCo's overlap is not modelled). Per group and outer
sync, for P parameters and N groups (`OUTER_SYNCS`: the bytes a value each sends, and the
registry's collective kind, `edgc.sync.sync_methods`):

* ring all-reduce (torchft's DiLoCo, fp32): 2 (N − 1)/N × 4P bytes on the wire;
* two-stage (torchft's FP8 ``allreduce_quantized``: 1 byte a value; edgc's ``quant3-2s``: 3 bits and
  a scale per 256): 2 (N − 1)/N × the encoded bytes, per bucket an all-to-all and a ring all-gather;
* all-gather through torchft's manager (edgc's one-stage ``quant3``: an all-reduce of one slot per
  group): 2 (N − 1) × the encoded bytes: it grows with N.

Latency is charged per collective: each waits for its rounds in sequence (a ring all-reduce
2 (N − 1), a ring all-gather N − 1, an all-to-all one: its N − 1 messages go at once), and a round
waits for its neighbour's message, which left when the round began: one way between sites, half the
round trip (``round_trip_s``), not a request and its answer. A sync issues one collective of its kind per
bucket (`buckets`: the two-stage sync two, an all-to-all and an all-gather). The buckets are each
method's own: torchft's DiLoCo all-reduces its fragment tensor by tensor (``use_bucketization`` off,
its default: `torchft.local_sgd`), its FP8 path likewise; edgc's two-stage sync cuts the values it
syncs into buckets as its reducer does (`edgc.sync.flat_buffers.bucket_plan`: sized from the run,
about sixteen, unless the method fixes ``bucket_values``); the one-stage sync sends the fragment as
one message.
A process group that runs several collectives at once (``Link.in_flight``: gloo's worker threads)
overlaps their rounds as each sync's issue order allows (`latencies`); the internet tables assume
one at a time, as NCCL's one stream runs them.

Plus a fixed cost per outer step (the quorum and the commit vote) and the codec's passes over the
values (`codec_passes`: 1 + N for the one-stage sync, which decodes every group's message; 3 + 1/N
for a two-stage one), each ``ACCELERATOR_BYTES_PER_PASS`` of memory traffic a value at the device's
bandwidth, the values spread over the group's GPUs.

Failures: a group is lost every ``hours_between_losses`` (somewhere in the job); each loss costs the
survivors the detection (``detect_s``), the heal of its replacement (the model, θ_global, the outer
momentum and Adam's two moments, 20 bytes a parameter, over one site link: with a synchronous
quorum, which DiLoCo needs, the survivors' next sync waits for it), and what the outer step in
flight loses: torchft's DiLoCo restores θ_global and loses its H inner steps, edgc keeps the
pseudo-gradient in its error feedback and loses only the sync. Time to a token count then grows by
1 / (1 − losses per second × cost per loss); where that is ≤ 0, the job never gets there.

The link model's rate, its fixed cost per outer step, a round's own cost and the CPU codec's rate are
calibrated on the bench's 3- and 6-host runs, and the latency's accounting is checked on the same
runs with a delay added between the emulated hosts (`edgc_sim.diloco_report.calibrate_on_bench`);
the internet's round trip (``round_trip_s``), the device and the failure rate are assumptions, and
everything beyond the bench's groups, beyond this machine's links and on an H100 is extrapolation.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

ALL_REDUCE, TWO_STAGE, SLOTS = "all-reduce", "two-stage", "all-gather (slots)"


PER_TENSOR = 0  # bucket_values of a sync that issues one collective per parameter tensor
FROM_RUN = None  # bucket_values of a sync whose buckets are sized from the run, as edgc's reducer sizes them


@dataclass(frozen=True)
class OuterSync:
    """One outer sync as the model prices it."""

    label: str  #: name in the tables
    bytes_per_value: float  #: payload per parameter, bytes (> 0)
    kind: str  #: ALL_REDUCE, TWO_STAGE or SLOTS
    codec: bool = True  #: encodes and decodes its messages (see `codec_passes`)
    edgc: bool = True  #: keeps a discarded step's pseudo-gradient (error feedback); torchft's DiLoCo does not
    #: values per bucket, one collective of the kind each (> 0; inf: the whole fragment at once;
    #: PER_TENSOR: one per parameter tensor; FROM_RUN: `edgc.sync.flat_buffers.bucket_plan`'s)
    bucket_values: float | None = math.inf
    row_multiple: int = 1  #: the codec's row: a bucket sized from the run is N of its multiples (≥ 1)


def _quant_bytes(bits: int, block: int = 256) -> float:
    return bits / 8 + 4 / block


def configured_buckets(method: str) -> tuple[int | None, int]:
    """(values per bucket, the codec's row multiple) of a registered edgc sync method: its name's option,
    else its constructor's default; None (FROM_RUN) where its reducer sizes the buckets from the run."""
    from edgc.sync.sync_methods import sync_method

    spec = sync_method(method)
    value = spec.options.get("bucket_values", inspect.signature(spec.reducer).parameters["bucket_values"].default)
    if not (value is FROM_RUN or (isinstance(value, int) and value >= 1)):
        raise ValueError(
            f"{method}: bucket_values {value!r} is neither None (sized from the run) nor a count of values"
        )
    return value, getattr(spec.build().codec, "row_multiple", 1)


OUTER_SYNCS = {
    "torchft": OuterSync(
        "torchft's DiLoCo (fp32 ring)", 4.0, ALL_REDUCE, codec=False, edgc=False, bucket_values=PER_TENSOR
    ),
    "torchft-fp8": OuterSync(
        "torchft's FP8 path (two-stage)", 1.0 + 4 / 2048, TWO_STAGE, edgc=False, bucket_values=PER_TENSOR
    ),
    "quant3": OuterSync("edgc quant3 (one-stage, slots)", _quant_bytes(3), SLOTS),
    "quant3-2s": OuterSync(
        "edgc quant3-2s (two-stage)",
        _quant_bytes(3),
        TWO_STAGE,
        **dict(zip(("bucket_values", "row_multiple"), configured_buckets("quant3-2s"))),
    ),
}
# An accelerator's memory traffic per value and codec pass: read the values (and the error feedback),
# write the codes, read them back, write the result: about 16 bytes.
ACCELERATOR_BYTES_PER_PASS = 16.0


def codec_passes(sync: OuterSync, groups: int) -> float:
    """Passes over the P values a process's codec makes per outer sync: one-stage encodes its own and
    decodes every group's (1 + N); two-stage encodes, decodes its chunk's N messages (P values in all),
    re-encodes its chunk and decodes the gathered ones (3 + 1/N)."""
    if not sync.codec:
        return 0.0
    return 1.0 + groups if sync.kind == SLOTS else 3.0 + 1.0 / groups


@dataclass(frozen=True)
class Site:
    """A replica group and its link, and the job around it (see the module docstring)."""

    gpus: int = 8  #: accelerators per replica group (≥ 1)
    flops_per_s: float = 989e12 * 0.4  #: achieved matmul FLOP/s per accelerator (H100 bf16 at 40 % MFU), > 0
    mem_bytes_per_s: float = 2.92e12  #: memory bandwidth per accelerator, bytes/s (> 0)
    link_bits_per_s: float = 1e9  #: the site's link, each way, bits/s (> 0)
    round_trip_s: float = 0.03  #: between sites, seconds; a collective's round waits half of it (≥ 0; assumed)
    step_overhead_s: float = 0.5  #: fixed cost of an outer step: quorum and commit vote, seconds (≥ 0)
    tokens_per_step: int = 2**20  #: tokens per inner step per group (> 0)
    sync_every: int = 100  #: H: inner steps per outer step (≥ 1)
    hours_between_losses: float = 3.0  #: a group is lost this often somewhere in the job, hours (> 0; inf: never)
    detect_s: float = 10.0  #: the survivors' wait to notice a lost group, seconds (≥ 0)
    heal_bytes_per_param: float = 20.0  #: what a replacement group receives per parameter, bytes (≥ 0)

    def __post_init__(self):
        for name in ("gpus", "flops_per_s", "mem_bytes_per_s", "link_bits_per_s", "tokens_per_step", "sync_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Site.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("round_trip_s", "step_overhead_s", "detect_s", "heal_bytes_per_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"Site.{name} must be ≥ 0, got {getattr(self, name)!r}")
        if not self.hours_between_losses > 0:
            raise ValueError(f"Site.hours_between_losses must be > 0, got {self.hours_between_losses!r}")

    def inner_s(self, params: float) -> float:
        """One inner step: 6 FLOPs a parameter and token over the group's accelerators."""
        return 6 * params * self.tokens_per_step / (self.gpus * self.flops_per_s)

    def codec_s_per_value(self) -> float:
        """One codec pass over one value, the group's accelerators sharing the values."""
        return ACCELERATOR_BYTES_PER_PASS / (self.gpus * self.mem_bytes_per_s)


def wire_bytes(sync: OuterSync, params: float, groups: int) -> float:
    """Bytes each group sends (and receives) per outer sync."""
    if groups <= 1:
        return 0.0
    payload = sync.bytes_per_value * params
    if sync.kind == SLOTS:
        return 2 * (groups - 1) * payload
    return 2 * (groups - 1) / groups * payload


def buckets(sync: OuterSync, params: float, tensors: int, groups: int) -> int:
    """Buckets of one outer sync over a fragment of ``params`` values in ``tensors`` tensors at ``groups``
    groups (a bucket sized from the run is a multiple of the groups times the codec's row)."""
    if sync.bucket_values is FROM_RUN:
        from edgc.sync.flat_buffers import bucket_plan

        return bucket_plan(math.ceil(params), max(groups, 1), None, sync.row_multiple)[1]
    if sync.bucket_values == PER_TENSOR:
        return tensors
    return 1 if math.isinf(sync.bucket_values) else math.ceil(params / sync.bucket_values)


def collectives(sync: OuterSync, params: float, tensors: int, groups: int) -> int:
    """Collectives one outer sync issues: one a bucket, two for a two-stage sync (all-to-all, all-gather)."""
    return buckets(sync, params, tensors, groups) * (2 if sync.kind == TWO_STAGE else 1)


def rounds(sync: OuterSync, groups: int) -> tuple[int, ...]:
    """Rounds of each collective one bucket issues: a ring all-reduce 2 (N − 1); a two-stage bucket's
    all-to-all one (its N − 1 messages go at once), then its ring all-gather N − 1."""
    return (1, groups - 1) if sync.kind == TWO_STAGE else (2 * (groups - 1),)


def latencies(sync: OuterSync, groups: int, params: float, tensors: int, in_flight: int = 1) -> float:
    """Rounds one outer sync waits for in sequence, its collectives run by a process group that runs
    ``in_flight`` at once, each taken up in issue order. One at a time (NCCL's one stream): every
    bucket's rounds add up. More (gloo's worker threads): a sync that issues every bucket at once
    (torchft's all-reduces tensor by tensor) waits for ⌈buckets / in_flight⌉ of them; the two-stage
    sync issues bucket t's all-to-all while t − 1's is reduced and t − 2's all-gather is decoded
    (`edgc.sync.two_stage`), which `pipelined_rounds` plays out."""
    if groups <= 1:
        return 0
    count, per_bucket = buckets(sync, params, tensors, groups), rounds(sync, groups)
    if in_flight <= 1:
        return count * sum(per_bucket)
    if sync.kind == TWO_STAGE:
        return pipelined_rounds(count, *per_bucket, in_flight=in_flight)
    return math.ceil(count / in_flight) * sum(per_bucket)


def pipelined_rounds(count: int, scatter: int, gather: int, in_flight: int) -> float:
    """The two-stage sync's issue and wait order over ``count`` buckets (scatter t, wait scatter t − 1
    and issue its gather, wait gather t − 2), collectives taken up in issue order by ``in_flight``
    workers: when the last result is there, in rounds."""
    free, started, host, done = [0.0] * in_flight, 0.0, 0.0, {}

    def issue(key, length):
        nonlocal started
        worker = min(range(in_flight), key=free.__getitem__)
        started = max(host, free[worker], started)
        free[worker] = done[key] = started + length

    for t in range(count):
        issue(("scatter", t), scatter)
        if t >= 1:
            host = max(host, done[("scatter", t - 1)])
            issue(("gather", t - 1), gather)
        if t >= 2:
            host = max(host, done[("gather", t - 2)])
    host = max(host, done[("scatter", count - 1)])
    issue(("gather", count - 1), gather)
    return max(done.values())


@dataclass(frozen=True)
class Link:
    """What one outer sync pays besides its codec: the rate, a cost per round of a collective, a fixed cost."""

    bytes_per_s: float  #: each way, per group, > 0
    round_s: float = 0.0  #: a round's own cost on the link, without distance (fitted on the bench), seconds, ≥ 0
    overhead_s: float = 0.0  #: per outer step, ≥ 0
    in_flight: int = 1  #: collectives the process group runs at once (gloo: its worker threads; NCCL: one), ≥ 1
    round_trip_s: float = 0.0  #: between sites, seconds, ≥ 0; a round waits one way of it (its neighbour's message)

    @property
    def per_round_s(self) -> float:
        """What each round of a collective waits: its own cost and the message's way across, half a round trip."""
        return self.round_s + self.round_trip_s / 2


def sync_seconds(
    sync: OuterSync, params: float, groups: int, link: Link, codec_s_per_value: float, tensors: int
) -> float:
    """One outer sync of ``params`` values in ``tensors`` tensors, not overlapped with the inner steps."""
    return (
        link.overhead_s
        + latencies(sync, groups, params, tensors, link.in_flight) * link.per_round_s
        + wire_bytes(sync, params, groups) / link.bytes_per_s
        + codec_passes(sync, groups) * params * codec_s_per_value
    )


@dataclass(frozen=True)
class OuterStep:
    """One method at one point: seconds and fractions."""

    inner_s: float  #: one inner step
    sync_s: float  #: the outer sync, not overlapped
    outer_s: float  #: H inner steps and the sync
    utilisation: float  #: the inner steps' share of the outer step, failures aside
    loss_cost_s: float  #: what one lost group costs the job, seconds
    goodput: float  #: the share of wall time that advances training, failures included (≤ 0: never)

    def days_to(self, tokens: float, site: Site, groups: int) -> float:
        """Days until ``tokens`` tokens have been trained (inf where failures leave no progress)."""
        if self.goodput <= 0:
            return math.inf
        outer_steps = tokens / (groups * site.tokens_per_step * site.sync_every)
        return outer_steps * self.outer_s / self.goodput / 86400


@dataclass(frozen=True)
class ModelSize:
    """A model as an outer sync sees it: its values and the tensors they lie in."""

    label: str  #: name in the tables
    params: float  #: parameters (> 0)
    tensors: int  #: parameter tensors (≥ 1)


# LLaMA 3's layout at each size: 9 tensors a layer (4 attention, 3 MLP, 2 norms), the embedding and
# the final norm, and an untied head from 8B on; 16, 32 and 80 layers.
MODELS = (ModelSize("1B", 1e9, 9 * 16 + 2), ModelSize("8B", 8e9, 9 * 32 + 3), ModelSize("70B", 70e9, 9 * 80 + 3))


def outer_step(sync: OuterSync, model: ModelSize, groups: int, site: Site) -> OuterStep:
    """The model of the module docstring for one outer sync of ``model`` at ``groups`` groups."""
    params = model.params
    inner = site.inner_s(params)
    link = Link(site.link_bits_per_s / 8, overhead_s=site.step_overhead_s, round_trip_s=site.round_trip_s)
    sync_s = sync_seconds(sync, params, groups, link, site.codec_s_per_value(), model.tensors)
    outer = site.sync_every * inner + sync_s
    lost_work = sync_s if sync.edgc else outer
    cost = site.detect_s + site.heal_bytes_per_param * params / link.bytes_per_s + lost_work
    rate = 0.0 if math.isinf(site.hours_between_losses) else 1 / (3600 * site.hours_between_losses)
    return OuterStep(inner, sync_s, outer, site.sync_every * inner / outer, cost, 1 - rate * cost)


def crossover(method: str, model: ModelSize, site: Site, reference: str = "torchft", top: int = 1024) -> int | None:
    """The fewest groups (2…``top``) at which ``method``'s outer step is slower than ``reference``'s, or None."""
    for groups in range(2, top + 1):
        mine = outer_step(OUTER_SYNCS[method], model, groups, site).outer_s
        theirs = outer_step(OUTER_SYNCS[reference], model, groups, site).outer_s
        if mine > theirs:
            return groups
    return None
