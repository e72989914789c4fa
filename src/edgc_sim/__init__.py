"""Paper-scale simulator of EDGC training (`edgc simulate`).

An analytic cost model of one Megatron-style TP x PP x DP iteration (1F1B pipeline, DP gradient sync
after the flush, ring all-reduces under an alpha-beta model) and of a whole run whose per-stage
PowerSGD ranks follow a method's schedule (uncompressed, static PowerSGD, Optimus-CC-style selective
stages, EDGC with DAC alignment). Pure Python + numpy; no GPU needed.

Modules:
    cli.py                 `edgc simulate`: project onto a cluster, or calibrate against runs
    presets.py             model shapes, parallel layouts, the paper's training presets
    hardware.py            links, devices and clusters, each number with its source
    cost_model.py          FLOPs, alpha-beta collectives, the 1F1B timeline, PowerSGD cost
    engine_model.py        our engine's jobs, kernel launches and compress time (host and device)
    engine_launches.py     a job's dispatches per term of its layout, fitted to the engine's own counts
    shapes.py              the gradient tensors one pipeline stage's DP buffer holds
    collectives.py         the collectives one training step of each method issues
    iteration.py           one training iteration: 1F1B compute + per-stage DP sync
    interstage_model.py    inter-stage traffic: activations forward, activation gradients back
    dac.py                 EDGC's rank ceiling and DAC per-stage alignment on the cost model
    rank_schedule.py       EDGC's stage-0 rank over a whole run, from an entropy series
    methods.py             the compared methods as per-stage rank schedules
    report.py              text table and time-breakdown plot of simulated runs
    tbf.py                 the emulated links' token-bucket burst (shared with edgc_bench.netns)
    host.py                quick measurements of this machine (FLOP/s, local link)
    host_ops.py            the host's cost per op class on a GPU, read from a profiler trace, and a step priced with it
    host_report.py         that model against the measured GPU hook, and its prediction for an engine on a preset
    calibrate.py           the fit against `edgc train` runs: predicted vs measured step and comm
    bench_link.py          the bench's link fitted from its calibration sweep (`BenchLink`)
    step_model.py          the model of one measured bench step: payloads, timeline, wire, compress
    calibrate_bench.py     the fit against `edgc bench` folders, per (run, rank)
    calibrate_pipeline.py  the fit of the inter-stage model against a TP × PP bench
    calibration_tables.py  the calibrations as markdown tables
    diloco.py              DiLoCo at many replica groups: outer step, utilisation, failures, per collective kind
    diloco_report.py       its tables (`--diloco`) and its fit to the bench's scaling runs (`--diloco-bench`)
"""
