"""EDGC in torchtitan from a config registry of one's own: torchtitan's llama3 debug model, its replica
all-reduce compressed, EDGC's settings given in code (each can still be changed with ``--edgc.FIELD``).

    torchrun --nproc_per_node 4 examples/torchtitan_llama3.py \\
        --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2

which is torchtitan's own trainer with this file as its config module, as in
``torchrun … -m torchtitan.train --module examples.torchtitan_llama3 --config llama3_debugmodel_edgc``.
Without a registry of one's own, one flag does it: ``--module edgc.integrations.torchtitan --config
llama3_debugmodel --edgc.rank_budget 4`` (docs/guides/torchtitan.md). torchtitan's wheel ships no
tokenizer or data: give them with ``--hf_assets_path`` and ``--dataloader.dataset_path``. On a CPU
machine torchtitan needs a few patches (`edgc_train.torchtitan_cpu`, which tests/integrations/
test_torchtitan.py runs this config with).
"""

import sys

from torchtitan.models.llama3.config_registry import llama3_debugmodel

from edgc import EDGCConfig
from edgc.integrations.torchtitan import EDGCTrainer, with_edgc


def llama3_debugmodel_edgc() -> EDGCTrainer.Config:
    """torchtitan's llama3 debug model trained by EDGCTrainer: static rank 4 after 2 uncompressed steps."""
    edgc = EDGCConfig.static(4, min_warmup_steps=2, warmup_fraction=0.0)
    config = with_edgc(llama3_debugmodel(), edgc)
    config.parallelism.spmd_backend = "partial_dtensor"  # EDGC's FSDP mesh (docs/guides/torchtitan.md)
    return config


if __name__ == "__main__":
    from torchtitan.train import main

    # this file as torchtitan's config module, then the command line's own flags
    sys.argv[1:1] = ["--module", "torchtitan_llama3", "--config", "llama3_debugmodel_edgc"]
    main()
