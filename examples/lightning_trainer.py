"""A Lightning ``Trainer`` with EDGC: ``strategy=EDGCDDPStrategy(config)``.

    OMP_NUM_THREADS=1 python examples/lightning_trainer.py

Lightning starts the second process itself (``devices=2``). Its own
``DDPStrategy(ddp_comm_hook=...)`` registers the hook only on CUDA and silently trains
uncompressed elsewhere; ``EDGCDDPStrategy`` registers it on every device.
"""

import os

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from edgc import EDGCConfig, barrier_before_exit
from edgc.integrations.lightning import EDGCDDPStrategy

STEPS = int(os.environ.get("STEPS", 12))


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))

    def training_step(self, batch, _):
        inputs, targets = batch
        loss = nn.functional.cross_entropy(self.net(inputs), targets)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main():
    torch.manual_seed(0)
    x = torch.randn(STEPS * 16 * 2, 64)
    data = DataLoader(TensorDataset(x, x[:, :8].argmax(dim=1)), batch_size=16)
    # short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    strategy = EDGCDDPStrategy(
        EDGCConfig(r_max=8, window=4, total_steps=STEPS, warmup_error_test=False), process_group_backend="gloo"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), data)
    m = strategy.comm_state.last_step_metrics
    print(
        f"[rank {trainer.global_rank}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes"
    )
    barrier_before_exit()  # EDGC: not optional on gloo, also under Lightning (see its docstring)


if __name__ == "__main__":
    main()
