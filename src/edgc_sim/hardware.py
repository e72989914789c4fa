"""Hardware presets: links, devices and clusters, each number with its source.

Spec-sheet numbers are peaks; every place where the simulator needs an *achieved* number uses a
separate efficiency factor marked "assumed". Bandwidths are bytes/s per direction, times are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
TERA = 1e12


def _positive(obj, *names: str) -> None:
    for name in names:
        if not getattr(obj, name) > 0:
            raise ValueError(f"{name} must be > 0, got {getattr(obj, name)!r}")


def _fraction(obj, *names: str) -> None:
    for name in names:
        if not 0 < getattr(obj, name) <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {getattr(obj, name)!r}")


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point path as one ring step sees it (alpha-beta model)."""

    name: str  #: preset key
    peak_bytes_per_s: float  #: line rate per direction, bytes/s (> 0)
    efficiency: float  #: achieved fraction of the line rate for large messages, (0, 1]
    latency_s: float  #: alpha: fixed cost of one ring step (message), seconds (>= 0)
    source: str = ""  #: where the numbers come from

    def __post_init__(self):
        _positive(self, "peak_bytes_per_s")
        _fraction(self, "efficiency")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s!r}")

    @property
    def bytes_per_s(self) -> float:
        """beta^-1: achieved bandwidth, bytes/s."""
        return self.peak_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or this host's CPU, see edgc_sim.host)."""

    name: str  #: preset key
    matmul_flops: dict  #: precision ("fp32", "tf32", "fp16") -> peak dense matmul FLOP/s (> 0)
    mfu: float  #: achieved fraction of matmul peak in training GEMMs, (0, 1]
    mem_bytes_per_s: float  #: memory bandwidth, bytes/s (> 0); elementwise ops are bound by it
    launch_s: float  #: per-kernel launch + framework dispatch overhead, seconds (>= 0)
    source: str = ""  #: where the numbers come from
    alloc_bytes_per_s: float = 0.0  #: first touch of freshly allocated memory (page faults, zeroing), bytes/s; 0 = free
    # How the device runs our engine (edgc_sim.host measures them); 0 = not measured: see engine_model.EngineRates
    #: our engine's product GEMMs stream M at this rate beyond their FLOPs, bytes/s
    skinny_read_bytes_per_s: float = 0.0
    #: our engine's decompression GEMM writes G_hat at this rate beyond its FLOPs, bytes/s
    skinny_write_bytes_per_s: float = 0.0
    #: our engine's orthonormalisation (engine_model.orth_flops: CholeskyQR2 on an accelerator, Householder on a
    #: CPU) per second; 0 = the matmul rate
    orth_flops_per_s: float = 0.0
    hook_gemm_flops_per_s: float = 0.0  #: PyTorch's powerSGD_hook's bmm forms (M Q, M^T P, P Q^T), FLOP/s
    #: a GPU (our engine gathers M and G_hat per job and fuses buckets into jobs); False: a CPU
    accelerator: bool = False
    #: the float32 matmul rate the skinny rates were separated at; 0 = matmul_flops["fp32"]
    skinny_flops_per_s: float = 0.0

    def __post_init__(self):
        _fraction(self, "mfu")
        _positive(self, "mem_bytes_per_s")
        if not self.matmul_flops or any(v <= 0 for v in self.matmul_flops.values()):
            raise ValueError("matmul_flops must map each precision to a value > 0")
        if self.launch_s < 0:
            raise ValueError(f"launch_s must be >= 0, got {self.launch_s!r}")
        if self.alloc_bytes_per_s < 0:
            raise ValueError(f"alloc_bytes_per_s must be >= 0 (0 = free), got {self.alloc_bytes_per_s!r}")
        for name in (
            "skinny_read_bytes_per_s",
            "skinny_write_bytes_per_s",
            "orth_flops_per_s",
            "hook_gemm_flops_per_s",
            "skinny_flops_per_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = not measured), got {getattr(self, name)!r}")

    def skinny_rates(self):
        """engine_model.EngineRates of this device, None where its skinny GEMM rates were not measured."""
        from .engine_model import EngineRates

        if not (self.skinny_read_bytes_per_s and self.skinny_write_bytes_per_s):
            return None
        return EngineRates(
            self.skinny_read_bytes_per_s,
            self.skinny_write_bytes_per_s,
            self.orth_flops_per_s,
            self.accelerator,
            self.skinny_flops_per_s or self.matmul_flops.get("fp32", 0.0),
        )

    def alloc_s(self, nbytes: float) -> float:
        """Extra time of writing `nbytes` into memory allocated just before (0 when not measured)."""
        return nbytes / self.alloc_bytes_per_s if self.alloc_bytes_per_s else 0.0

    def flops_per_s(self, precision: str) -> float:
        """Achieved matmul FLOP/s at `precision`."""
        if precision not in self.matmul_flops:
            raise ValueError(f"precision {precision!r} not in {sorted(self.matmul_flops)} for {self.name}")
        return self.matmul_flops[precision] * self.mfu


@dataclass(frozen=True)
class ClusterSpec:
    """Identical nodes; ranks are placed Megatron-style (TP fastest, then DP, then PP)."""

    name: str  #: preset key
    device: DeviceSpec  #: accelerator in every slot
    nodes: int  #: number of nodes (>= 1)
    gpus_per_node: int  #: accelerators per node (>= 1)
    intra: LinkSpec  #: link between accelerators of one node
    inter: LinkSpec  #: one node NIC's link to the network
    nics_per_node: int = 1  #: NICs per node; inter-node flows of a node share them (>= 1)
    source: str = ""  #: where the layout comes from

    def __post_init__(self):
        _positive(self, "nodes", "gpus_per_node", "nics_per_node")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


# --- links ---------------------------------------------------------------------------------------
LINKS = {
    link.name: link
    for link in (
        # V100 SXM2 datasheet: NVLink 300 GB/s (bidirectional aggregate, 6 links) -> 150 GB/s/direction.
        # assumed efficiency 0.5: a ring uses only the links to its two neighbours in a 4-GPU hybrid
        # cube-mesh, about half of the six. assumed alpha 5 us (NCCL small-message step).
        LinkSpec("nvlink2", 150 * GB, 0.5, 5e-6, "V100 SXM2 datasheet NVLink 300 GB/s bidir; eff/alpha assumed"),
        # H100 SXM5 datasheet: NVLink 4 900 GB/s bidirectional -> 450 GB/s/direction (NVSwitch: all links
        # usable). assumed efficiency 0.8 (nccl-tests bus bandwidth ~360 GB/s on HGX H100). alpha assumed.
        LinkSpec("nvlink4", 450 * GB, 0.8, 5e-6, "H100 SXM5 datasheet NVLink 900 GB/s bidir; eff/alpha assumed"),
        # PCIe 3.0 x16: 8 GT/s x 16 lanes x 128b/130b = 15.75 GB/s per direction (PCI-SIG spec).
        LinkSpec("pcie3", 15.75 * GB, 0.8, 10e-6, "PCIe 3.0 spec x16 15.75 GB/s; eff/alpha assumed"),
        # PCIe 5.0 x16: 32 GT/s x 16 x 128b/130b = 63 GB/s per direction (PCI-SIG spec).
        LinkSpec("pcie5", 63 * GB, 0.8, 10e-6, "PCIe 5.0 spec x16 63 GB/s; eff/alpha assumed"),
        # Ethernet line rates (IEEE 802.3). TCP sockets (NCCL socket transport): assumed efficiency 0.9
        # (a shaped link carries 91-95% of its nominal rate, measured on this project's machines) and alpha 30 us
        # (kernel TCP step, assumed).
        LinkSpec("eth10g", 10e9 / 8, 0.9, 30e-6, "IEEE 802.3 10GBASE; eff/alpha assumed (TCP)"),
        LinkSpec("eth25g", 25e9 / 8, 0.9, 30e-6, "IEEE 802.3 25GBASE; eff/alpha assumed (TCP)"),
        # RDMA (RoCE / InfiniBand) through NCCL's IB transport: assumed efficiency 0.9, alpha 5 us.
        LinkSpec("roce100g", 100e9 / 8, 0.9, 5e-6, "100 GbE RoCE NIC line rate; eff/alpha assumed"),
        LinkSpec("ib_hdr200", 200e9 / 8, 0.9, 5e-6, "InfiniBand HDR 200 Gb/s (ConnectX-6); eff/alpha assumed"),
        LinkSpec("ib_ndr400", 400e9 / 8, 0.9, 5e-6, "InfiniBand NDR 400 Gb/s (ConnectX-7); eff/alpha assumed"),
    )
}

# --- devices -------------------------------------------------------------------------------------
# mfu 0.4 is assumed for all GPUs: Megatron-LM reaches 44-52% of peak on A100 for 1.7B-1T GPT models
# (Narayanan et al., SC'21, Table 1); the paper's stage shards are small (hidden/TP <= 896 columns),
# so a little less. matmul_flops stay datasheet peaks (what the field means; mfu is the achieved
# share in training): an isolated 8192^3 GEMM on an H100 reaches 78% (bf16), 81% (tf32) and 76% (fp32)
# of them (docs/gpu/before/device.json), an upper bound on what training GEMMs reach.
DEVICES = {
    dev.name: dev
    for dev in (
        # V100 SXM2 datasheet: FP32 15.7 TFLOP/s, FP16 tensor 125 TFLOP/s, HBM2 900 GB/s. No TF32.
        # launch_s 5 us assumed: a CUDA kernel launch costs ~3-7 us.
        DeviceSpec(
            "v100",
            {"fp32": 15.7 * TERA, "fp16": 125 * TERA},
            0.4,
            900 * GB,
            5e-6,
            "NVIDIA V100 SXM2 datasheet; mfu/launch assumed",
            accelerator=True,
        ),
        # H100 SXM5 datasheet (dense, i.e. half the 'with sparsity' figures): FP32 67 TFLOP/s,
        # TF32 tensor 494.7 TFLOP/s, FP16/BF16 tensor 989 TFLOP/s. Measured on one H100 by
        # edgc_sim.host.measure_cuda (docs/gpu/before/device.json), where it is the model's quantity:
        # - mem_bytes_per_s: a 1 GB copy's bytes read + written per second, 2.92 TB/s (the datasheet's
        #   3.35 TB/s is the HBM3 peak; the model charges every read and write of an elementwise pass);
        # - launch_s: a tiny eager op issued from Python, 10.2 us (launch + dispatch: what each of our
        #   engine's eager ops costs; an upper bound for the paper reducer's TorchScript Gram-Schmidt,
        #   which skips Python's share of the dispatch);
        # - skinny_read/write_bytes_per_s: the engine's rank-32 product and decompression GEMMs on
        #   fp32 1600 x 6400 matrices beyond their FLOPs, 1.25 and 1.88 TB/s, separated at the measured
        #   fp32 matmul rate, 50.7 TFLOP/s (skinny_flops_per_s: the engine's GEMMs run in fp32, so the
        #   model charges their FLOPs at it, whatever the training precision);
        # - orth_flops_per_s: not measured (that run timed torch.linalg.qr, which the engine no longer
        #   runs): 0, the matmul rate. At GPT-2 XL's shapes a 256 MB job's two orthonormalisations are
        #   ~0.3 GFLOP, tens of us even in float64, against ~24 launches of 10 us: the launches carry
        #   most of their cost.
        DeviceSpec(
            "h100",
            {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "fp16": 989 * TERA},
            0.4,
            2.92 * TERA,
            10.2e-6,
            "NVIDIA H100 SXM5 datasheet (dense) matmul peaks, mfu assumed; memory, per-op cost "
            "and skinny GEMM rates measured on an H100 (docs/gpu/before/device.json); "
            "orthonormalisation rate not measured",
            skinny_read_bytes_per_s=1.25 * TERA,
            skinny_write_bytes_per_s=1.88 * TERA,
            skinny_flops_per_s=50.7 * TERA,
            accelerator=True,
        ),
        # H200 SXM: the H100 SXM5's matmul peaks (same GH100 compute; datasheet, dense), 141 GB of
        # HBM3e. Measured on one H200 by edgc_sim.host.measure_cuda (docs/gpu/h200-2026-11-27/device.json),
        # each the quantity the h100 preset's comment describes: copy 4.14 TB/s, per-op cost 10.4 us,
        # skinny GEMMs 1.28 / 1.96 TB/s beyond their FLOPs at the measured fp32 rate 50.4 TFLOP/s, the
        # engine's CholeskyQR2 of a (13, 32, 1600) block at 368 GFLOP/s (its launches taken out).
        # The host's cost per op class (edgc_sim.host_ops) is read from that run's trace.
        DeviceSpec(
            "h200",
            {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "fp16": 989 * TERA},
            0.4,
            4.14 * TERA,
            10.4e-6,
            "NVIDIA H200 SXM datasheet (dense) matmul peaks, mfu assumed; memory, per-op cost, skinny "
            "GEMM and orthonormalisation rates measured on an H200 (docs/gpu/h200-2026-11-27/device.json)",
            skinny_read_bytes_per_s=1.28 * TERA,
            skinny_write_bytes_per_s=1.96 * TERA,
            orth_flops_per_s=368 * GB,
            skinny_flops_per_s=50.4 * TERA,
            accelerator=True,
        ),
    )
}

# --- clusters ------------------------------------------------------------------------------------
# The paper (the paper, §3.1) gives only GPU counts and 4 GPUs/node; the interconnect was not recovered.
# The inter-node links below are assumptions typical of each generation; `--inter-link` changes them.
CLUSTERS = {
    c.name: c
    for c in (
        ClusterSpec(
            "v100x32",
            DEVICES["v100"],
            8,
            4,
            LINKS["nvlink2"],
            LINKS["eth25g"],
            1,
            "paper §3.1: 32 V100 = 8 nodes x 4; inter-node 25 GbE assumed",
        ),
        ClusterSpec(
            "h100x64",
            DEVICES["h100"],
            16,
            4,
            LINKS["nvlink4"],
            LINKS["roce100g"],
            1,
            "paper §3.1: 64 H100 = 16 nodes x 4; inter-node 100 Gb/s RoCE assumed",
        ),
        ClusterSpec(
            "v100x16",
            DEVICES["v100"],
            8,
            2,
            LINKS["nvlink2"],
            LINKS["eth25g"],
            1,
            "paper §3.2 GPT2-345M: 16 GPUs = 8 nodes x 2; V100 and links assumed",
        ),
    )
}


def cluster_with_inter_link(cluster: ClusterSpec, link_name: str) -> ClusterSpec:
    """The same cluster with another inter-node link preset."""
    if link_name not in LINKS:
        raise ValueError(f"inter link {link_name!r} not in {sorted(LINKS)}")
    return replace(cluster, inter=LINKS[link_name], name=f"{cluster.name}+{link_name}")
