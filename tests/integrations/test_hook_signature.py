"""`edgc_hook` passes DDP's registration check (its module uses postponed, string annotations)."""

import inspect

import torch
import torch.distributed as dist

from edgc import edgc_hook


def test_hook_annotations_are_the_classes_ddp_checks_for():
    # The same comparisons as DistributedDataParallel._check_comm_hook (torch 2.13).
    signature = inspect.signature(edgc_hook)
    assert signature.parameters["bucket"].annotation == dist.GradBucket
    assert signature.return_annotation == torch.futures.Future[torch.Tensor]
