"""The GPT-2 training harness behind `edgc train`, `edgc report` and `edgc demo`.

Modules, top to bottom (each imports only modules listed below it, or the library):
    plan.py         several `edgc train` jobs, one after another in the same torchrun workers (tests)
    cli.py          `edgc train` flags and config file → `TrainConfig` → (torchrun) → `train.train`
    demo.py         `edgc demo` (`make run`): uncompressed vs EDGC on the tiny GPT-2, then the report
    report_cli.py   `edgc report RUN_DIR …`
    report.py       the report's markdown: summary table, rank schedules, setups
    report_plots.py the report's plots, one function each
    report_rank_plots.py  its plots of the rank: per step with the bytes sent, per pipeline stage
    report_style.py the plots' shared look: smoothing, colours, the warm-up marked, titles, log axes
    report_runs.py  run folders loaded for the report, their statistics and number formats
    train.py        the training loop: runner → optimizer → resume → steps, logs, evals, checkpoints
    fsdp_runner.py  `--fsdp`: FSDP2 as HSDP, EDGC on the replica all-reduce
    moe_runner.py   `--moe-experts/--ep`: the MoE GPT, dense and expert gradients each over their own group
    moe.py          the MoE feed-forward: top-k routing, experts stored as torchtitan stores them, all-to-all
    pipeline_runner.py `--pp/--tp`: this rank's stage, trained by the pipeline schedule
    schedule.py     one optimizer step of a stage: 1F1B / GPipe over batched point-to-point
    stage_link.py   a stage's point-to-point traffic: the batches, the activation gradients raw or compressed
    stage_sync.py   a stage's gradient sync over its DP group, and the per-stage metrics
    stage.py        one pipeline stage of GPT-2, and the loss
    tensor_parallel.py  `--tp`: torch's DTensor plan (ColwiseParallel / RowwiseParallel) for a block
    linear_gpt2.py  GPT-2 blocks with nn.Linear projections, loaded from HF's Conv1D
    rank_grid.py    this rank's place in the run's DeviceMesh (`--pp/--tp`)
    runner.py       the runner interface and the DDP runner
    run_folder.py   a run folder's files: config.json, metrics.jsonl, comm traces, summary.json
    compressors.py  one DDP hook + state per compressor name
    checkpoint.py   atomic, verified checkpoints
    sampler.py      the token arrays in batches: shuffled blocks per rank, resumable; validation in order
    data.py         corpus → tokenizer → token arrays, cached
    config.py       `TrainConfig`: every knob of `edgc train`
    config_checks.py  its checks: each field's range, the combinations, the model's shape
    model.py        GPT-2 presets, built from a config (no download)
    rendezvous.py   joining the process group under torchrun, across restarts
    torchtitan_cpu.py  torchtitan's own trainer on a CPU under torchrun (CPU-only patches): the tests' and bench's
    torchtitan_assets.py  a tokenizer and a corpus made on the spot for torchtitan's trainer
"""
