"""`edgc experiment NAME`: each of EDGC's claims as one command that leaves plots, a summary and a number.

Modules:
    change_cost.py  what one rank change costs the compression (never-resized twin power iterations)
    cli.py          `edgc experiment` flags and the experiment registry
    common.py       output folders, the single-process training run, shared plotting
    cqm.py          how conservative is the Marchenko–Pastur error model?
    diloco.py       does compressed DiLoCo hold against torchft's DiLoCo across models? (paired seeds)
    diloco_families.py the model families of diloco: GPT-2 tiny, a char GRU, a causal char CNN, a LLaMA
    diloco_frontier.py diloco's frontier: each method's bytes and where it holds within 1 %, the plot
    diloco_regime.py diloco --regime frontier: 4 replicas, H = 15, 120 outer steps, each method tuned
    diloco_regime_summary.py its summary: Δ % at 20, 60, 120 outer steps, what a stopped run lacks
    diloco_regime_plots.py its pictures: the frontier (payload against Δ %) and Δ % against the outer steps
    diloco_runs.py  the replica processes of diloco: torchft's DiLoCo or edgc's, one arm after another
    diloco_pairs.py DiLoCo at the same bytes: sync often at a low rank or rarely at a high one? (paired seeds)
    diloco_train.py the two-process DiLoCo (or per-step EDGC) runs of diloco-pairs
    entropy_trend.py does gradient entropy fall and stabilise?
    moe.py          a mixture of experts, EP × DP: EDGC on both groups, ranks routed by tokens (paired seeds)
    pareto.py       at the same bytes, does a moving rank beat static PowerSGD? (paired seeds)
    pareto_arms.py  its arms: the byte budgets, what every arm shares, each arm's rank schedule
    pareto_runs.py  its runs: keyed by setting, seed and config, earlier ones reused, the pool
    pareto_summary.py  its summary: the paired Δ per budget and arm, a rank change's cost, the plot
    pareto_train.py one in-process training run of the pareto instrument
    pure_dp.py      EDGC on pure data parallelism, on the emulated network
    rank_sweep.py   which static ranks are safe and which pay?
    sampling.py     does GDS keep the entropy trend at a fraction of the cost?
    window.py       how long should the rank window be?
"""
