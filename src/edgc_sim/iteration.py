"""One training iteration of a preset on a cluster: 1F1B compute + per-stage DP sync after the flush.

Placement follows Megatron: global rank = stage * (DP*TP) + replica * TP + tp_rank, nodes filled in
rank order. All GPUs of a stage that sit on one node sync at the same moment and share its NICs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import cost_model as cm
from .hardware import ClusterSpec
from .interstage_model import InterStage, compress_s, gradient_bytes, gradient_ranks, step_bytes, transfer_s
from .presets import Preset
from .shapes import StageParams, stage_params

# Adam in fp32 reads param, grad, m, v (16 B) and writes param, m, v (12 B) per parameter.
ADAM_BYTES_PER_PARAM = 28

BREAKDOWN_KEYS = ("compute", "TP comm", "bubble+p2p", "DP compress", "DP comm", "embedding sync", "wait", "optimizer")


@dataclass(frozen=True)
class SyncCost:
    """One stage's DP gradient sync in one iteration."""

    compute_s: float  #: PowerSGD compress + decompress time, seconds (0 when uncompressed)
    comm_s: float  #: all-reduce time, seconds
    values_sent: int  #: values each rank all-reduces (payload, before the ring's 2(n-1)/n factor)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass(frozen=True)
class IterationResult:
    """Timing of one iteration with fixed per-stage ranks."""

    ranks: tuple  #: per-stage PowerSGD rank, None = uncompressed
    iteration_s: float  #: wall time of the iteration, seconds
    flush_end_s: tuple  #: per stage: end of its last backward, seconds from iteration start
    sync: tuple  #: per-stage SyncCost
    breakdown: dict  #: BREAKDOWN_KEYS -> seconds along stage 0 (sums to iteration_s)

    @property
    def dp_sync_mean_s(self) -> float:
        """DP gradient-sync latency averaged over stages (what a per-rank all-reduce timer logs)."""
        return sum(s.total_s for s in self.sync) / len(self.sync)


def _span(ranks: Sequence[int], gpus_per_node: int) -> tuple:
    """(nodes touched, ranks per node) of a process group."""
    per_node: dict = {}
    for r in ranks:
        per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
    return len(per_node), max(per_node.values())


@dataclass(frozen=True)
class Links:
    """Where a preset's ranks sit on the cluster's nodes (Megatron's placement) and the links their
    groups use: the spans (nodes touched, ranks per node) of each stage's DP group, of a TP group and
    of the embedding group, and which stage boundaries cross a node."""

    intra: cm.AlphaBeta
    inter: cm.AlphaBeta
    dp_span: list
    tp_span: tuple
    emb_span: tuple
    p2p_inter: list

    @classmethod
    def place(cls, P: int, D: int, T: int, cluster: ClusterSpec) -> Links:
        c, gpn = cluster, cluster.gpus_per_node

        def rank(stage: int, replica: int, tp_rank: int) -> int:
            return stage * D * T + replica * T + tp_rank

        # GPUs of one stage on one node move data across the NIC at the same time (DP sync, p2p)
        stage_gpus_on_node = _span([rank(0, d, t) for d in range(D) for t in range(T)], gpn)[1]
        return cls(
            intra=cm.AlphaBeta(c.intra.latency_s, c.intra.bytes_per_s),
            inter=cm.AlphaBeta(c.inter.latency_s, c.inter.bytes_per_s * c.nics_per_node / stage_gpus_on_node),
            dp_span=[_span([rank(p, d, 0) for d in range(D)], gpn) for p in range(P)],
            tp_span=_span([rank(0, 0, t) for t in range(T)], gpn),
            emb_span=_span([rank(0, 0, 0), rank(P - 1, 0, 0)], gpn),
            p2p_inter=[rank(p, 0, 0) // gpn != rank(p + 1, 0, 0) // gpn for p in range(P - 1)],
        )

    def allreduce(self, span: tuple, nbytes: float) -> float:
        return cm.hierarchical_allreduce_time(span[0], span[1], nbytes, self.intra, self.inter)

    def boundaries(self) -> list:
        """The link each stage boundary's point-to-point traffic crosses."""
        return [self.inter if inter else self.intra for inter in self.p2p_inter]


@dataclass(frozen=True)
class StageTimes:
    """Per stage, one micro-batch's forward and backward compute and their TP all-reduces, and per
    boundary the activation's point-to-point time (Megatron's scatter-gather)."""

    compute_fwd: list
    compute_bwd: list
    tp_fwd: list
    tp_bwd: list
    p2p: list

    @property
    def t_fwd(self) -> list:
        return [c + t for c, t in zip(self.compute_fwd, self.tp_fwd)]

    @property
    def t_bwd(self) -> list:
        return [c + t for c, t in zip(self.compute_bwd, self.tp_bwd)]


@dataclass(frozen=True)
class InterstageCosts:
    """The activation gradients' backward traffic (edgc_sim.interstage_model): the rank of each micro-batch's,
    the p2p time per boundary and micro-batch (raw ones cost what an activation does; compressed ones
    each TP rank's factors), the sender's compress + decompress added to its backward, and the bytes
    one TP rank of a replica sends (sent, raw), as `edgc train` logs them."""

    gradient_ranks: list
    p2p_bwd: list
    compress_s: float  #: per sending stage and iteration
    t_bwd_per_micro: list
    step_bytes: tuple


class IterationModel:
    """Precomputes per-stage costs of a (preset, cluster) pair; `iteration(ranks)` is then cheap."""

    def __init__(self, preset: Preset, cluster: ClusterSpec, interstage: InterStage = InterStage()):
        par, model = preset.parallel, preset.model
        if par.world_size > cluster.world_size:
            raise ValueError(
                f"preset {preset.name} needs {par.world_size} GPUs, cluster {cluster.name} has {cluster.world_size}"
            )
        self.preset, self.cluster, self.interstage = preset, cluster, interstage
        self.bytes = preset.bytes_per_value
        self.flops_per_s = cluster.device.flops_per_s(preset.precision)
        # our engine's rates where the run used it (None: the paper's reducer, see cost_model)
        self.engine = cluster.device.skinny_rates() if preset.reducer == "edgc" else None
        self.stages = [stage_params(model, par.tp, par.pp, p) for p in range(par.pp)]
        self.links = Links.place(self.P, self.D, self.T, cluster)
        self.times = self._stage_times()
        rows, cols = par.micro_batch * model.seq_len, model.hidden
        self.gradients = self._interstage(rows, cols)
        self.timeline = cm.one_f_one_b_timeline(
            self.times.t_fwd, self.gradients.t_bwd_per_micro, self.m, self.times.p2p, self.gradients.p2p_bwd
        )
        self.optimizer_s = max(st.values for st in self.stages) * ADAM_BYTES_PER_PARAM / cluster.device.mem_bytes_per_s
        self._cache: dict = {}

    # -- the preset's layout -----------------------------------------------------------------------
    @property
    def P(self) -> int:
        return self.preset.parallel.pp

    @property
    def D(self) -> int:
        return self.preset.parallel.dp

    @property
    def T(self) -> int:
        return self.preset.parallel.tp

    @property
    def m(self) -> int:
        return self.preset.parallel.micro_batches

    @property
    def interstage_bytes(self) -> tuple:
        return self.gradients.step_bytes

    @property
    def interstage_compress_s(self) -> float:
        return self.gradients.compress_s

    def allreduce(self, span: tuple, nbytes: float) -> float:
        return self.links.allreduce(span, nbytes)

    # -- compute ---------------------------------------------------------------------------------
    def _stage_times(self) -> StageTimes:
        model, par, dev = self.preset.model, self.preset.parallel, self.cluster.device
        b, s, h, T = par.micro_batch, model.seq_len, model.hidden, self.T
        layers = model.layers // self.P
        act_bytes = b * s * h * self.bytes
        tp_ar = self.allreduce(self.links.tp_span, act_bytes)
        compute_fwd, compute_bwd, tp_fwd, tp_bwd = [], [], [], []
        for p in range(self.P):
            flops = layers * cm.layer_forward_flops(b, s, h)
            mem = layers * cm.layer_forward_elementwise_bytes(b, s, h, model.heads, self.bytes)
            tp_f, tp_b = 2 * layers * tp_ar, 2 * layers * tp_ar
            if p == 0:
                tp_f += tp_ar  # vocab-parallel embedding lookup ends with an all-reduce
            if p == self.P - 1:
                vocab = model.padded_vocab(T)
                flops += cm.logits_forward_flops(b, s, h, vocab)
                mem += cm.logits_elementwise_bytes(b, s, vocab, self.bytes)
                tp_b += tp_ar  # the column-parallel LM head's input gradient is all-reduced
            # TP splits every GEMM and (approximately) the elementwise work T ways; backward = 2x forward
            fwd = flops / T / self.flops_per_s + mem / T / dev.mem_bytes_per_s
            compute_fwd.append(fwd)
            compute_bwd.append(2 * fwd)
            tp_fwd.append(tp_f)
            tp_bwd.append(tp_b)
        # Megatron's scatter-gather p2p: each TP rank sends 1/T of the activation, then an intra all-gather
        gather = cm.ring_reduce_scatter_time(T, act_bytes, self.links.intra)
        p2p = [link.alpha_s + act_bytes / T / link.bytes_per_s + gather for link in self.links.boundaries()]
        return StageTimes(compute_fwd, compute_bwd, tp_fwd, tp_bwd, p2p)

    def _interstage(self, rows: int, cols: int) -> InterstageCosts:
        """Backward p2p per boundary and micro-batch: raw gradients cost what an activation does (scatter-
        gather); compressed ones each TP rank's factors (wire_bytes) plus compress + decompress on the
        sender's backward (edgc_sim.interstage_model)."""
        mode, dev = self.interstage.mode, self.cluster.device
        ranks = gradient_ranks(mode, self.interstage.rank, self.m, self.P, rows, cols)
        p2p_bwd = [
            [raw if not r else transfer_s(gradient_bytes(r, rows, cols, self.bytes), link) for r in ranks]
            for raw, link in zip(self.times.p2p, self.links.boundaries())
        ]
        extra = [
            compress_s(r, rows, cols, self.flops_per_s, dev.mem_bytes_per_s, dev.launch_s, self.bytes, self.engine)
            for r in ranks
        ]
        t_bwd_per_micro = [[t + (e if p > 0 else 0.0) for e in extra] for p, t in enumerate(self.times.t_bwd)]
        sent = step_bytes(mode, [self.interstage.rank] * self.P, self.m, self.P, rows, cols, self.bytes)
        return InterstageCosts(ranks, p2p_bwd, sum(extra), t_bwd_per_micro, sent)

    # -- DP sync ---------------------------------------------------------------------------------
    def sync_cost(self, stage: int, rank: int | None) -> SyncCost:
        """Gradient sync of `stage` at PowerSGD `rank` (None: plain all-reduce of the whole buffer)."""
        key = ("sync", stage, rank)  # DAC asks for the same (stage, rank) many times over a run
        if key not in self._cache:
            self._cache[key] = self._sync_cost(stage, rank)
        return self._cache[key]

    def _sync_cost(self, stage: int, rank: int | None) -> SyncCost:
        st: StageParams = self.stages[stage]
        span = self.links.dp_span[stage]
        if self.D == 1:
            return SyncCost(0.0, 0.0, 0)
        if rank is None:
            return SyncCost(0.0, self.allreduce(span, st.values * self.bytes), st.values)
        dev = self.cluster.device
        p_vals, q_vals = cm.powersgd_values(st.matrices, rank)
        compute = cm.powersgd_compute_time(
            st.matrices, rank, self.flops_per_s, dev.mem_bytes_per_s, dev.launch_s, self.bytes, self.engine
        )
        # the raw 1-D tensors are all-reduced alongside the P all-reduce, sharing its bandwidth
        comm = self.allreduce(span, (p_vals + st.vector_values) * self.bytes) + self.allreduce(
            span, q_vals * self.bytes
        )
        return SyncCost(compute, comm, p_vals + q_vals + st.vector_values)

    def embedding_sync_s(self) -> float:
        """Tied word-embedding gradient all-reduce between the first and last stage (never compressed)."""
        if self.P == 1:
            return 0.0
        return self.allreduce(self.links.emb_span, self.stages[0].embedding_values * self.bytes)

    # -- iteration -------------------------------------------------------------------------------
    def iteration(self, ranks: Sequence[int | None]) -> IterationResult:
        ranks = tuple(ranks)
        if len(ranks) != self.P:
            raise ValueError(f"need one rank per stage ({self.P}), got {len(ranks)}")
        if ranks not in self._cache:
            self._cache[ranks] = self._iteration(ranks)
        return self._cache[ranks]

    def _iteration(self, ranks: tuple) -> IterationResult:
        flush = self.timeline.flush_end
        sync = tuple(self.sync_cost(p, r) for p, r in enumerate(ranks))
        dp_end = [f + s.total_s for f, s in zip(flush, sync)]
        emb_s = self.embedding_sync_s()
        emb_end = max(dp_end[0], dp_end[-1]) + emb_s
        grads_ready = max(max(dp_end), emb_end)
        # the global grad-norm all-reduce before the optimizer step makes every stage wait for the last
        total = grads_ready + self.optimizer_s
        times = self.times
        busy0 = self.m * (times.t_fwd[0] + times.t_bwd[0])
        breakdown = {
            "compute": self.m * (times.compute_fwd[0] + times.compute_bwd[0]),
            "TP comm": self.m * (times.tp_fwd[0] + times.tp_bwd[0]),
            "bubble+p2p": flush[0] - busy0,
            "DP compress": sync[0].compute_s,
            "DP comm": sync[0].comm_s,
            "embedding sync": emb_s,
            "wait": grads_ready - dp_end[0] - emb_s,  # for later stages' sync and the embedding group
            "optimizer": self.optimizer_s,
        }
        return IterationResult(ranks, total, flush, sync, breakdown)

    def backward_micro_batch_s(self, stage: int) -> float:
        """t_b of DAC: one micro-batch backward of `stage`, TP comm included."""
        return self.times.t_bwd[stage]
