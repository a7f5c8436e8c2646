"""What keeps a run honest across steps and processes: a non-finite loss, gradient or update stops it
before anything of that step is saved; gradients are averaged over processes; the processes must end with
one adapter; a launch that started fewer processes than it was asked for is said."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zoomkv.errors import ZoomKVError
from zoomkv.train.checkpoints import latest_checkpoint

log = logging.getLogger(__name__)


class NonFiniteTrainingError(ZoomKVError):
    """A step's loss, gradient norm or updated weights are NaN or infinite (too high an lr, bad data): the
    run stops before saving anything from that step on."""


def gradient_norm(adapter: torch.nn.Module) -> torch.Tensor:
    """The norm of the adapter's gradients, where they are (read by the guard with the step's other numbers)."""
    params = list(adapter.parameters())
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return torch.stack(grads).norm() if grads else torch.zeros((), device=params[0].device if params else None)


def stop_unless_finite(accelerator: Any, step: int, run_dir: Path, *, loss: torch.Tensor | None = None,
                       grad_norm: torch.Tensor | None = None, adapter: torch.nn.Module | None = None) -> None:
    """Raise ``NonFiniteTrainingError`` (one line, exit 2) when the step's loss, gradient norm or the updated
    adapter is not finite, on every process at once (they decide together, so none waits for the others).
    Every check is one flag on the device, all read back at once: a GPU waits once here, not once a tensor."""
    checked = [x for x in (loss, grad_norm) if x is not None]
    checked += list(adapter.parameters()) if adapter is not None else []
    if not checked:
        return
    device = accelerator.device
    bad = torch.stack([(~torch.isfinite(x.detach())).any().to(device) for x in checked]).any().float().reshape(1)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    if not bad.item():
        return
    problems = []  # (a stopped run reads the numbers it names)
    if loss is not None and not torch.isfinite(loss).all():
        problems.append(f"the loss is {float(loss):g}")
    if grad_norm is not None and not torch.isfinite(grad_norm).all():
        problems.append(f"the gradient norm is {float(grad_norm):g}")
    if adapter is not None and not all(bool(torch.isfinite(p).all()) for p in adapter.parameters()):
        problems.append("the update made the adapter's weights non-finite")
    last = latest_checkpoint(run_dir)
    kept = f"the last checkpoint, {last}, is finite" if last else "no checkpoint was written"
    raise NonFiniteTrainingError(
        f"step {step}: {' and '.join(problems) or 'another process saw a non-finite loss'}; training stopped "
        f"and nothing of this step was saved ({kept}); lower lr (or grad_clip), or check the data"
    )


def average_gradients(accelerator: Any, prepared: Any, adapter: torch.nn.Module) -> None:
    """Mean of the gradients over processes. The loss calls the adapter's methods, not its forward, so
    DDP's hooks never fire: without this every process would train its own copy."""
    if accelerator.num_processes == 1 or not isinstance(prepared, torch.nn.parallel.DistributedDataParallel):
        return  # one process, or an engine (DeepSpeed) that reduces gradients itself
    for p in adapter.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every process must join every all-reduce
        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.SUM)
        p.grad.div_(accelerator.num_processes)


def check_processes_agree(accelerator: Any, adapter: torch.nn.Module) -> None:
    """Every process must end with the same adapter (same init, same averaged steps); say so or fail."""
    if accelerator.num_processes == 1:
        return
    mine = torch.cat([p.detach().flatten() for p in adapter.parameters()])[None]
    every = accelerator.gather(mine)
    if not torch.equal(every.amin(0), every.amax(0)):
        raise RuntimeError("the training processes ended with different adapters (gradients not synchronised)")
    log.info("all %d processes hold the same adapter", accelerator.num_processes)


# What launchers set in each process they start: the number of processes they started.
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def launch_mismatch(num_processes: int, env: Mapping[str, str]) -> str | None:
    """The warning when the launcher asked for more processes than this run has, or None. torchrun and MPI
    say how many they started; ``accelerate launch --cpu --num_processes N`` starts one process and says
    only, by a rendezvous address, that it was asked for several."""
    asked = max((int(env[k]) for k in WORLD_SIZE_VARIABLES if env.get(k, "").isdigit()), default=None)
    if asked is not None and asked > num_processes:
        return (f"the launcher started {asked} processes but this run has {num_processes}: each trains on "
                "its own; launch with --config_file recipes/accelerate/multi_cpu.yaml (CPU) or --multi_gpu")
    cpu_launch = env.get("ACCELERATE_USE_CPU", "").lower() in ("true", "1", "yes")
    if asked is None and num_processes == 1 and cpu_launch and "MASTER_ADDR" in env:
        return ("accelerate launch was asked for more than one process, but with --cpu (use_cpu) it starts "
                "one: this run trains in 1 process; for several CPU processes launch with --config_file "
                "recipes/accelerate/multi_cpu.yaml, or --multi_gpu without --cpu (the trainer joins them over "
                "gloo when there is no GPU)")
    return None
