"""DeepSpeed (ZeRO-1/2) under the trainer: the engine's settings from the recipe, and its partitioned AdamW
state read and written in the trainer's own checkpoint format.

``accelerate launch`` with a ``distributed_type: DEEPSPEED`` config (``recipes/accelerate/deepspeed_zero2.yaml``
on GPUs, ``deepspeed_zero2_cpu.yaml`` with ``DS_ACCELERATOR=cpu``) makes ``accelerator.prepare`` return
DeepSpeed's engine and a ZeRO optimizer. The trainer then

* refuses another ZeRO stage before the base model loads (``check_stage``: ZeRO-3 would partition the frozen
  base, which never trains and never sits on the accelerator, and gain nothing on the tiny adapter);
* sets the engine's batch from the recipe (``configure``): one sample per micro-batch,
  ``samples_per_step`` micro-batches accumulated per process and step, ``grad_clip`` as DeepSpeed's
  ``gradient_clipping`` (the engine clips and steps inside ``accelerator.backward`` at the last micro-batch);
* saves and restores checkpoints through ``ZeroOptimizerState``: AdamW's moments gathered from the ZeRO
  partitions per parameter (what ``torch.optim.AdamW.state_dict`` holds), so a checkpoint is the same
  safetensors + JSON folder whatever wrote it, and any run (DeepSpeed or not, any process count) resumes it.

DeepSpeed is an optional extra (``pip install 'zoomkv[deepspeed]'``); nothing here imports it before a
DeepSpeed launch asks for it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from zoomkv.errors import ConfigError

log = logging.getLogger(__name__)


def deepspeed_requested() -> bool:
    """True in a process ``accelerate launch`` started with a DEEPSPEED config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def accelerator_kwargs() -> dict[str, Any]:
    """Extra ``Accelerator`` arguments under DeepSpeed. Without CUDA, accelerate finds no backend for a
    DeepSpeed launch and counts one process while DeepSpeed joins them all: naming the CPU accelerator's
    backend (gloo, or ccl with oneCCL) makes both see the same group."""
    if torch.cuda.is_available():
        return {}
    from accelerate.utils import InitProcessGroupKwargs
    from deepspeed.accelerator import get_accelerator

    return {"kwargs_handlers": [InitProcessGroupKwargs(backend=get_accelerator().communication_backend_name())]}


SUPPORTED_STAGES = (1, 2)


def zero_stage(accelerator: Any) -> Any:
    """The ZeRO stage of the DeepSpeed config accelerate built (from the launch flags or a config file)."""
    return accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)


def check_stage(accelerator: Any) -> None:
    """Refuse a ZeRO stage the trainer cannot use, before the base model loads: under ZeRO-3 transformers
    would load it partitioned (0 parameters on each process) and fail later, far from the cause."""
    stage = zero_stage(accelerator)
    if stage in SUPPORTED_STAGES:
        return
    if stage == 3:
        raise ConfigError(
            "DeepSpeed ZeRO stage 3 is not supported by the trainer: it partitions the model's parameters over "
            "the processes, but the frozen base model never trains and never sits on the accelerator (the main "
            "process runs it once, in host memory, to cache the teacher signals) and the adapter is far too "
            "small to gain from partitioning; use ZeRO stage 2 (--zero_stage 2, or "
            "--config_file recipes/accelerate/deepspeed_zero2.yaml), which partitions the adapter's gradients "
            "and optimiser moments")
    raise ConfigError(f"DeepSpeed ZeRO stage {stage} is not supported by the trainer (stages 1 and 2 are: their "
                      "optimiser state is what the trainer's checkpoints save and resume); use --zero_stage 2")


def configure(accelerator: Any, samples_per_step: int, grad_clip: float, n_params: int) -> None:
    """Write the recipe's batch into the DeepSpeed plugin's config before ``accelerator.prepare``: the
    trainer has no dataloader, so accelerate cannot infer ``train_micro_batch_size_per_gpu`` itself.
    ZeRO's gradient buckets default to 5e8 elements, allocated at every step (4.5 s of a 9 s tiny run on a
    CPU): unless the config names them, they are sized to the adapter (``n_params``), one bucket for all."""
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": samples_per_step,
              "train_batch_size": samples_per_step * accelerator.num_processes, "gradient_clipping": float(grad_clip)}
    for key, value in wanted.items():
        given = config.get(key)
        if given not in (None, "auto", value) and key != "train_batch_size":
            log.warning("DeepSpeed %s: the recipe's %s replaces the accelerate config's %s", key, value, given)
        config[key] = value
    zero = config.setdefault("zero_optimization", {})
    bucket = -(-max(n_params, 1) // 2**20) * 2**20  # whole MiB-elements: aligned however DeepSpeed pads
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if zero.get(key) in (None, "auto"):
            zero[key] = bucket
    log.debug("DeepSpeed config: %s", config)
    accelerator.gradient_accumulation_steps = samples_per_step


def global_grad_norm(engine: Any) -> torch.Tensor | None:
    """The gradient norm the engine computed in its last step (before clipping), None if it kept none."""
    norm = engine.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(float(norm))


class ZeroOptimizerState:
    """``state_dict`` / ``load_state_dict`` of a ZeRO-1/2 optimizer in ``torch.optim`` terms (parameters
    numbered across ``param_lists`` in order, each with its own moments), as the trainer checkpoints it.
    Both are collective: every process must call them."""

    def __init__(self, engine: Any, param_lists: list[list[torch.nn.Parameter]]):
        self.zero = engine.optimizer  # DeepSpeedZeroOptimizer
        if not hasattr(self.zero, "single_partition_of_fp32_groups"):
            raise ConfigError(f"unsupported DeepSpeed optimizer {type(self.zero).__name__} (ZeRO stage 1 or 2 needed)")
        self.base = self.zero.optimizer  # the AdamW built by the trainer, now over flat fp32 partitions
        self.param_lists = param_lists

    def state_dict(self) -> dict[str, Any]:
        from deepspeed.utils import safe_get_full_optimizer_state
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for i, params in enumerate(self.param_lists):
            flat = self.zero.single_partition_of_fp32_groups[i]
            flat_state = self.base.state.get(flat, {})
            full = [k for k, v in flat_state.items() if torch.is_tensor(v) and v.shape == flat.shape]
            if flat_state:
                # Link each parameter to its slice of the moments again: DeepSpeed links every group once,
                # right after the first group's first step, so the other groups' parameters miss theirs.
                lazy_init_hp_params_optimizer_state(self.zero.bit16_groups[i], flat, self.base.state)
            first = index
            for p in params:
                if flat_state:  # no state before the first step, as torch.optim
                    entry = {k: safe_get_full_optimizer_state(p, k).detach().cpu().clone() for k in full}
                    entry.update({k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                                  for k, v in flat_state.items() if k not in full})
                    state[index] = entry
                index += 1
            group = {k: v for k, v in self.base.param_groups[i].items() if k != "params"}
            groups.append({**group, "params": list(range(first, index))})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore the moments, and the fp32 master weights from the module's parameters (already loaded)."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
        from deepspeed.utils.mixed_precision_linkage import lazy_init_hp_params_optimizer_state

        if len(saved["param_groups"]) != len(self.param_lists):
            raise ConfigError(f"the checkpoint has {len(saved['param_groups'])} optimizer groups, "
                              f"the adapter {len(self.param_lists)}")
        for i, (params, group) in enumerate(zip(self.param_lists, saved["param_groups"], strict=True)):
            if len(group["params"]) != len(params):
                raise ConfigError(f"optimizer group {i}: the checkpoint has {len(group['params'])} parameters, "
                                  f"the adapter {len(params)}")
            self.base.param_groups[i].update({k: v for k, v in group.items() if k != "params"})
            for p in params:
                safe_set_full_fp32_param(p, p.detach())
            entries = [saved["state"].get(j) for j in group["params"]]
            known = next((e for e in entries if e), None)
            if known is None:
                continue
            flat = self.zero.single_partition_of_fp32_groups[i]
            full = [k for k, v in known.items() if torch.is_tensor(v) and v.dim() > 0]
            flat_state: dict[str, Any] = {k: torch.zeros_like(flat) for k in full}
            for k, v in known.items():
                if k not in full:
                    flat_state[k] = v.detach().clone().to(flat.device) if torch.is_tensor(v) else v
            self.base.state[flat] = flat_state
            lazy_init_hp_params_optimizer_state(self.zero.bit16_groups[i], flat, self.base.state)
            for p, entry in zip(params, entries, strict=True):
                for k in full:
                    if entry and k in entry:
                        safe_set_full_optimizer_state(p, entry[k].to(flat.device, flat.dtype), k)
