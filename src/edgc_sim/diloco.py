"""DiLoCo across many replica groups: the time of an outer step, the utilisation, the time to a token
count, for torchft's DiLoCo, its FP8 path (from its algorithm) and edgc's outer syncs.

One replica group is ``gpus`` H100-class accelerators at one site (FSDP/HSDP inside it), joined to
the others by the site's link (``link_bits_per_s`` each way; every GPU's share of an outer sync
leaves through it). An outer step is H inner steps of ``tokens_per_step`` tokens per group
(6 · parameters FLOPs a token at the device's matmul rate × MFU) followed by the outer sync, not
overlapped (DiLoCo's default; Streaming DiLoCo's overlap is not modelled). Per group and outer
sync, for P parameters and N groups (`OUTER_SYNCS`: the bytes a value each sends, and the
registry's collective kind, `edgc.sync.sync_methods`):

* ring all-reduce (torchft's DiLoCo, fp32): 2 (N − 1)/N × 4P bytes on the wire, 2 (N − 1) latencies;
* two-stage (torchft's FP8 ``allreduce_quantized``: 1 byte a value; edgc's ``quant3-2s``: 3 bits and
  a scale per 256): 2 (N − 1)/N × the encoded bytes, an all-to-all (one latency: its N − 1 messages
  go at once) and a ring all-gather (N − 1 latencies);
* all-gather through torchft's manager (edgc's one-stage ``quant3``: an all-reduce of one slot per
  group): 2 (N − 1) × the encoded bytes, 2 (N − 1) latencies: it grows with N.

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

The link model's rate, its fixed cost per outer step and the CPU codec's rate are calibrated on the
bench's 3- and 6-host runs (`edgc_sim.diloco_report.calibrate_on_bench`); internet latency
(``latency_s``), the device and the failure rate are assumptions, and everything beyond 12 groups,
beyond this machine's links and on an H100 is extrapolation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALL_REDUCE, TWO_STAGE, SLOTS = "all-reduce", "two-stage", "all-gather (slots)"


@dataclass(frozen=True)
class OuterSync:
    """One outer sync as the model prices it."""

    label: str  #: name in the tables
    bytes_per_value: float  #: payload per parameter, bytes (> 0)
    kind: str  #: ALL_REDUCE, TWO_STAGE or SLOTS
    codec: bool = True  #: encodes and decodes its messages (see `codec_passes`)
    edgc: bool = True  #: keeps a discarded step's pseudo-gradient (error feedback); torchft's DiLoCo does not


def _quant_bytes(bits: int, block: int = 256) -> float:
    return bits / 8 + 4 / block


OUTER_SYNCS = {
    "torchft": OuterSync("torchft's DiLoCo (fp32 ring)", 4.0, ALL_REDUCE, codec=False, edgc=False),
    "torchft-fp8": OuterSync("torchft's FP8 path (two-stage)", 1.0 + 4 / 2048, TWO_STAGE, edgc=False),
    "quant3": OuterSync("edgc quant3 (one-stage, slots)", _quant_bytes(3), SLOTS),
    "quant3-2s": OuterSync("edgc quant3-2s (two-stage)", _quant_bytes(3), TWO_STAGE),
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
    latency_s: float = 0.03  #: one message's latency between sites, seconds (≥ 0; assumed, not calibrated)
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
        for name in ("latency_s", "step_overhead_s", "detect_s", "heal_bytes_per_param"):
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


def latencies(sync: OuterSync, groups: int) -> int:
    """Message latencies one outer sync waits for in sequence."""
    if groups <= 1:
        return 0
    return groups if sync.kind == TWO_STAGE else 2 * (groups - 1)


@dataclass(frozen=True)
class Link:
    """What one outer sync pays besides its codec: the rate, a latency per message, a fixed cost."""

    bytes_per_s: float  #: each way, per group, > 0
    latency_s: float = 0.0  #: per message in sequence, ≥ 0
    overhead_s: float = 0.0  #: per outer step, ≥ 0


def sync_seconds(sync: OuterSync, params: float, groups: int, link: Link, codec_s_per_value: float) -> float:
    """One outer sync, not overlapped with the inner steps."""
    return (
        link.overhead_s
        + latencies(sync, groups) * link.latency_s
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


def outer_step(sync: OuterSync, params: float, groups: int, site: Site) -> OuterStep:
    """The model of the module docstring for one outer sync at ``params`` parameters and ``groups`` groups."""
    inner = site.inner_s(params)
    link = Link(site.link_bits_per_s / 8, site.latency_s, site.step_overhead_s)
    sync_s = sync_seconds(sync, params, groups, link, site.codec_s_per_value())
    outer = site.sync_every * inner + sync_s
    lost_work = sync_s if sync.edgc else outer
    cost = site.detect_s + site.heal_bytes_per_param * params / link.bytes_per_s + lost_work
    rate = 0.0 if math.isinf(site.hours_between_losses) else 1 / (3600 * site.hours_between_losses)
    return OuterStep(inner, sync_s, outer, site.sync_every * inner / outer, cost, 1 - rate * cost)


def crossover(method: str, params: float, site: Site, reference: str = "torchft", top: int = 1024) -> int | None:
    """The fewest groups (2…``top``) at which ``method``'s outer step is slower than ``reference``'s, or None."""
    for groups in range(2, top + 1):
        mine = outer_step(OUTER_SYNCS[method], params, groups, site).outer_s
        theirs = outer_step(OUTER_SYNCS[reference], params, groups, site).outer_s
        if mine > theirs:
            return groups
    return None
