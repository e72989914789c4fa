"""A Hugging Face ``Trainer`` with EDGC: a callback registers the hook on the DDP model it built.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 examples/hf_trainer.py

The ``Trainer`` wraps the model in DDP (through Accelerate) inside ``train()``; by the time
``on_train_begin`` runs, ``trainer.model_wrapped`` is that DDP model and no forward has run, so the
EDGC change is the callback. The model is built from a GPT2Config (nothing is downloaded); the data
is a random token walk (each token the previous one plus 1 or 2, modulo 16), so the loss falls.
"""

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from edgc import EDGCConfig, barrier_before_exit
from edgc.integrations import register_edgc


class EDGCCallback(TrainerCallback):
    """Registers EDGC on the DDP model the Trainer built, when training begins."""

    def __init__(self, trainer, config):
        self.trainer, self.config, self.state = trainer, config, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = register_edgc(self.trainer.model_wrapped, self.config)


class Walks(torch.utils.data.Dataset):
    """Random walks over 16 tokens (+1 or +2 each step): learnable in a few steps."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        start = torch.randint(0, 16, (1,), generator=g)
        tokens = torch.cat([start, start + torch.randint(1, 3, (31,), generator=g).cumsum(0)]) % 16
        return {"input_ids": tokens, "labels": tokens}


def main():
    steps = int(os.environ.get("STEPS", 16))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="edgc-hf-trainer-"),
        max_steps=steps,
        per_device_train_batch_size=8,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_steps=4,
        learning_rate=3e-3,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Walks())
    # short-demo settings; a real run keeps the defaults (window=1000, r_max profiled)
    callback = EDGCCallback(trainer, EDGCConfig(r_max=8, window=4, total_steps=steps, warmup_error_test=False))
    trainer.add_callback(callback)
    trainer.train()
    m = callback.state.last_step_metrics
    print(
        f"[rank {trainer.args.process_index}] edgc: step {m['step']} phase {m['phase']} rank {m['rank']} "
        f"sent {m['bytes_sent']} of {m['bytes_raw']} bytes",
        flush=True,
    )
    barrier_before_exit()  # EDGC: not optional on gloo (see its docstring)


if __name__ == "__main__":
    main()
