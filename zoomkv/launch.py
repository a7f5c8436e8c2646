"""The end of a launch of several processes (``accelerate launch``, ``torchrun``), shared by training, evaluation
and calibration."""

from __future__ import annotations


def end_process_group() -> None:
    """Every process of the launch reaches this point, then the group is shut down in all of them together.

    A group freed after a peer has exited can block forever, and gloo's threads left running at exit can abort a
    process after its work is written (``terminate called without an active exception``). Without a group (one
    process), nothing happens."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
