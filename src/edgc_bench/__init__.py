"""`edgc bench`: every compressor side by side on emulated hosts joined by rate-limited links (docs/bench.md).
What it counts on the CPU (dispatches, bytes, memory, host reads, stream order) it counts with `edgc_probes`.

Modules:
    cli.py          `edgc bench` flags → `BenchSettings` → `run_bench`
    flags.py        its flags, one function per group
    run.py          each method trained in turn on the emulated network (torchrun per host)
    bench_folder.py the bench folder's layout (one run folder per method) and `read_run`
    table.py        the comparison table, its checks and plots, from the run folders
    targets.py      each method's time to the target loss, where it went, whether EDGC wins its cost back
    repeats.py      repeated benches side by side: each ratio's range, how often each target held
    rounds.py       `--rounds N`: the rounds (order reversed on even ones) side by side, their mean ratios
    netns.py        emulated hosts: network namespaces, a bridge, tbf rate-limited veth links
    delay_line.py   the hosts' switch with a delay on every path (latency where the kernel has no netem)
    link_calibration.py the link sweep: all-reduce time vs message size on the emulated network
    stages.py       do pipeline stages finish their sync closer together with DAC?
    torchft_bench.py `edgc bench --torchft`: a replica group killed mid-run, torchft vs elastic restart
    torchft_train.py one replica group's worker of that bench (torchft DDP, torchft + EDGC, plain DDP)
    torchft_table.py its bench.md: the table and the acceptance checks
    torchtitan_bench.py `edgc bench --torchtitan`: torchtitan's own trainer, native HSDP against EDGC
    diloco_bench.py `edgc bench --diloco`: DDP, DDP + EDGC, DiLoCo, DiLoCo + EDGC, Streaming DiLoCo per link
    diloco_cli.py   its flags and their checks
    diloco_train.py one replica group's worker of that bench (torchft DDP / DiLoCo, with or without EDGC)
    diloco_table.py its bench.md: measures from the workers' logs, the tables, the acceptance checks
    diloco_scaling.py  `--diloco --scaling`: the wire per process and the outer step at each number of groups
    outer_memory.py what one DiLoCo outer step allocates per parameter (resident and live), plain and torchft
    gpu.py          `python -m edgc_bench.gpu`: the CUDA path measured on one GPU (docs/gpu.md), part by part,
                    each in a process of its own with its own time limit, within a budget
    gpu_parts.py    the run's parts, one registry: what each measures, its limit, its function
    gpu_record.py   a part's result file, written as it goes
    gpu_summary.py  the run's closing summary: each part's status and headline figures
    gpu_hook.py     parts hook and sampled: EDGC's hook at XL rank 32, eager and with CUDA graphs, the drain;
                    a sampled step against a static one
    gpu_checks.py   parts tests and ncu: tests/gpu plain and under the CUDA sanitizer; Nsight Compute's bytes
    gpu_extras.py   the parts beside the default: the device profile, the CPU's count, overlap, engine, orth
    gpu_engine.py   EDGC's hook against powerSGD_hook at GPT-2 sizes: in a step, and each hook alone
    gpu_overlap.py  does backward wait for the collectives? (a delay injected into NCCL's all-reduces)
    gpu_outer.py    one DiLoCo outer step at XL and the largest model that fits: time, dispatches, memory
    gpu_hbm.py      HBM bytes of one hook call, from Nsight Compute's DRAM counters
    gpu_support.py  the model, device timing, kernel counts and process groups the parts share
    gpu_trace.py    a profiled step's device work per stream, and its picture
    engine_cost.py  a GPT-2 step's bytes and memory per compressed element, beside their floors
    (docs/concepts/engine.md)
    step_kinds.py   every kind of compressed step counted: kernels, bytes, memory (docs/concepts/engine.md)
    engine_launches.py the simulator's dispatches per job term, fitted to the engine's counts
    orthonormalization.py  the engine's orthonormalisation against batched Householder QR (also a GPU part)
    warm_start.py   the warm start's orthonormalisation passes, measured by what the engine sends
    mixed_precision.py  bf16 training against fp32 through the hook: loss and bytes (docs/integrations.md)
"""
