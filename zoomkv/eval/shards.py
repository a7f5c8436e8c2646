"""An evaluation (or a calibration) split across processes: ``accelerate launch --num_processes N -m zoomkv eval ...`` or
``torchrun --nproc_per_node N -m zoomkv eval ...`` (several machines: the launchers' own ``--num_machines`` /
``--nnodes``).

The launcher's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) says a process is one of several;
Accelerate's ``PartialState`` then joins them into one group (NCCL on GPUs, each process on its own GPU;
gloo on CPUs). The prompt batches are dealt out round robin (batch i to process i mod N), each process
appends its rows to its own ``rows.part-RANK.jsonl``, and after a barrier the main process merges them into
``rows.jsonl`` in the order one process writes them, then writes the summary and plots. A killed run
resumes per shard: every process reads every row file, so only batches nobody finished are run again
(with any number of processes).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from zoomkv.eval.tasks import SYNTHETIC_TASKS
from zoomkv.launch import end_process_group

log = logging.getLogger(__name__)


def launched_processes() -> int:
    """How many processes the launcher started (1 without one)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def is_main_process() -> bool:
    """Whether this process writes the merged outputs and prints them (rank 0, or the only process)."""
    return os.environ.get("RANK", "0") in ("", "0") or launched_processes() == 1


@dataclass
class Processes:
    """This process's place among the evaluation's processes."""

    rank: int = 0
    world: int = 1
    device: Any = None  # the device this process evaluates on (None: the --device setting as given)
    state: Any = None  # accelerate's PartialState when there are several

    @property
    def main(self) -> bool:
        return self.rank == 0

    def wait(self) -> None:
        """Every process reaches this point before any goes on."""
        if self.world > 1:
            self.state.wait_for_everyone()

    def close(self) -> None:
        """Every process done: the group shut down together (``zoomkv.launch.end_process_group``)."""
        if self.world > 1:
            end_process_group()

    def mine(self, index: int) -> bool:
        """Whether prompt batch ``index`` (in the plan's order) is this process's."""
        return index % self.world == self.rank

    def sum(self, tensor: Any) -> Any:
        """``tensor`` summed over the processes (each holding its share, zeros elsewhere: the sum is exact)."""
        if self.world == 1:
            return tensor
        import torch.distributed as dist

        total = tensor.to(self.state.device)  # NCCL reduces on the GPU, gloo on the CPU
        dist.all_reduce(total)
        return total.to(tensor.device)


def join_processes(device: str = "auto") -> Processes:
    """This process's ``Processes``: one process without a launcher; otherwise the group the launcher
    started, each process on its own device (``--device auto`` or ``cuda``: its GPU; ``cpu``: the CPU)."""
    world = launched_processes()
    if world == 1:
        return Processes()
    import torch
    from accelerate import PartialState

    # cpu=True without CUDA: processes torchrun started join over gloo (MULTI_CPU) rather than each alone
    state = PartialState(cpu=not torch.cuda.is_available() or device == "cpu")
    chosen = state.device if device in ("auto", "cuda") or device.startswith("cuda") else None
    if state.process_index != 0:
        logging.getLogger("zoomkv").setLevel(logging.WARNING)  # the main process says what all of them do
    log.info("%d processes share the prompts (this one: rank %d on %s)", state.num_processes,
             state.process_index, chosen or device)
    return Processes(rank=state.process_index, world=state.num_processes, device=chosen, state=state)


def batch_of(row: dict[str, Any]) -> tuple[str, int, float | None, int]:
    """The prompt a row answers: (task, length, grid depth, sample); a multi-turn task's ``TASK.TURN`` rows
    answer the prompt of ``TASK``."""
    task = row["task"]
    base, _, turn = task.rpartition(".")
    if base and turn.isdigit() and base in SYNTHETIC_TASKS and SYNTHETIC_TASKS[base].turns > 1:
        task = base
    depth = row.get("depth") if row["task"] == "niah_grid" else None
    return (task, int(row["length"]), None if depth is None else round(float(depth), 4), int(row["sample"]))
