"""DeepSpeed's config, view and checkpoint reader, shared by the deepspeed adapter (`deepspeed.initialize`) and the
hf adapter's ZeRO plugins (Accelerate's and the Trainer's DeepSpeed path): both read the same engine the same way.

The view reads everything back by the bare model's names through DeepSpeed's public debugging API
(`deepspeed.utils.safe_get_full_grad` / `safe_get_full_optimizer_state`, `GatheredParameters` at stage 3).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deepspeed_ops import use_environment_cache

use_environment_cache()  # before DeepSpeed is imported: its ops load from the environment's cache

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3  # noqa: E402
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: E402
from deepspeed.utils import groups as ds_groups  # noqa: E402
from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state  # noqa: E402
from torch import nn  # noqa: E402

from ..core.cell import Cell  # noqa: E402
from .base import PRECISION_NAMES, Probe, RunContext, class_among, precision_of  # noqa: E402
from .loop import Saved  # noqa: E402
from .saved_files import load_file  # noqa: E402
from .views import ParamView, all_gather_tensors  # noqa: E402

#: A tiny model needs it: with the default (1e5 elements) stage 3 keeps every param of tiny-gpt whole.
PERSISTENCE_THRESHOLD = 0

@dataclass(frozen=True)
class Plugin:
    stage: int
    offload: bool
    config_optimizer: bool
    bf16: bool = False


def ds_config(cell: Cell, plugin: Plugin, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config a user writes for this cell."""
    h = cell.hyper
    zero: dict[str, Any] = {"stage": plugin.stage, "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD}
    if plugin.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "train_batch_size": h.batch_per_rank * world_size,
        "train_micro_batch_size_per_gpu": h.batch_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": h.max_norm if h.clips else 0.0,
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if plugin.bf16 != (cell.precision == "bf16"):
        raise ValueError(f"plugin {cell.key.plugin} needs precision {'bf16' if plugin.bf16 else 'fp32'}, "
                         f"the cell has {cell.precision} (a matrix rule sets it)")
    if cell.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif cell.precision != "fp32":
        raise ValueError(f"the deepspeed adapter runs fp32 and bf16, not {cell.precision}")
    if plugin.config_optimizer:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": h.lr, "betas": list(h.betas), "eps": h.eps,
                                                           "weight_decay": h.weight_decay}}
    else:
        # A torch optimizer under ZeRO: DeepSpeed asks for this to take one it has not tested...
        config["zero_allow_untested_optimizer"] = True
        if plugin.offload:  # ... and refuses to offload one unless told not to swap in DeepSpeedCPUAdam
            config["zero_force_ds_cpu_optimizer"] = False
    return config


def observe_engine(probe: Probe, engine: Any) -> None:
    """The engine as DeepSpeed built it, read back from it: its class, the ZeRO stage it runs, where its ZeRO optimizer
    keeps the optimizer state, the optimizer it steps (`engine.basic_optimizer`: the client's, or the one it built
    from the config), the precision its module computes in."""
    probe.observed("wrapper", class_among(engine, (DeepSpeedEngine,)))
    probe.observed("zero_stage", engine.zero_optimization_stage())
    probe.observed("offload", offload_of(engine))
    probe.observed("optimizer", type(engine.basic_optimizer).__name__)
    probe.observed("precision", computes_in(engine))


def offload_of(engine: Any) -> str:
    """Where the optimizer state lives: the engine's `offload_optimizer` device ("none" where there is none), held
    against the ZeRO optimizer DeepSpeed built (`cpu_offload` at stages 1-2, `offload_optimizer` at 3; without a ZeRO
    optimizer, as at stage 0 or under bf16's BF16_Optimizer, nothing offloads): where they disagree, both."""
    configured = engine.zero_offload_optimizer()
    device = "none" if configured is None else OffloadDeviceEnum(configured.device).value  # the config keeps a str
    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        offloads = bool(optimizer.cpu_offload)
    elif isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        offloads = bool(optimizer.offload_optimizer)
    else:
        offloads = False
    if offloads == (device != "none"):
        return device
    return f"{device} in the engine's config, but {type(optimizer).__name__} offloads: {offloads}"


def engine_dtype(engine: Any) -> torch.dtype:
    """The dtype the engine's config trains its module in (`bfloat16_enabled()`, `fp16_enabled()`, else fp32)."""
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32


def computes_in(engine: Any) -> str:
    """The dtype of the module's params (`precision_of`), where the engine's own switch (`engine_dtype`) agrees with
    it or is fp32 (the engine casts nothing: a model's own bf16 params stay as it holds them); else both."""
    params = precision_of(engine.module)
    switched = PRECISION_NAMES[engine_dtype(engine)]
    return params if switched in (params, "fp32") else f"{params} (the engine's config: {switched})"


def grad_access(plugin: Plugin) -> str:
    if plugin.stage == 0:
        return "deepspeed.utils.safe_get_full_grad(param) (stage 0: param.grad itself)"
    if plugin.stage in (1, 2):
        return ("deepspeed.utils.safe_get_full_grad(param) (stages 1-2: the fp32 grad partition through "
                "param._hp_mapping, all-reduced; param.grad is not the reduced grad)")
    return ("deepspeed.utils.safe_get_full_grad(param) (stage 3: optimizer.get_fp32_grad_for_param, all-gathered; "
            "param.grad is None); params through deepspeed.zero.GatheredParameters")


class DeepSpeedView(ParamView):
    """The engine's bare module (`engine.module`: no wrapper infix in its names), read through DeepSpeed's API."""

    def __init__(self, engine: Any, plugin: Plugin) -> None:
        super().__init__(engine.module, [])
        self.engine = engine
        self.plugin = plugin
        self.grad_access = grad_access(plugin)

    def _optimizer_params(self) -> list[nn.Parameter]:
        """The model params the engine's optimizer steps: a torch optimizer's groups (stage 0, fp32); the model params
        a wrapper keeps masters for: `bf16_groups` (BF16_Optimizer), `bit16_groups` (ZeRO-1/2: what it flattened
        into its fp32 partitions), `fp16_groups` (ZeRO-3, FP16_Optimizer)."""
        optimizer = self.engine.optimizer
        if optimizer is None:
            return []
        for attribute in ("bf16_groups", "bit16_groups", "fp16_groups"):
            groups = getattr(optimizer, attribute, None)
            if groups is not None:
                return [p for group in groups for p in group]
        return [p for group in optimizer.param_groups for p in group["params"]]

    def tracked_names(self) -> set[str]:
        by_id = {id(p): n for n, p in self.named_parameters().items()}
        return {by_id.get(id(p), f"<not a model param: {tuple(p.shape)}>") for p in self._optimizer_params()}

    @contextlib.contextmanager
    def _gathered(self) -> Iterator[None]:
        """Stage 3: every param gathered, each in a `GatheredParameters` of its own. One context over the whole list
        takes `Init._allgather_params_coalesced`, which in DeepSpeed 0.19.2 launches one async
        all_gather per param and waits on the last handle only (`launch_handles[-1].wait()`): over gloo the handles
        run on independent worker threads, so an earlier param can still be in flight when it is read, and the read
        sees the `torch.empty` buffer (~1e36 garbage, head.weight most often). Fixed upstream by DeepSpeed#8539
        ("Wait for all async all-gathers in coalesced ZeRO-3 parameter gather"; 0.19.8 waits on every handle),
        found here as cells whose statuses varied between runs. A single param takes the blocking
        `_allgather_params_sequential` path instead. This changes how we read, not what DeepSpeed trains; on CUDA
        the coalesced path is safe (one stream), so the race is an artefact of running ZeRO-3 over gloo."""
        if self.plugin.stage != 3:
            yield
            return
        with contextlib.ExitStack() as stack:
            for param in self.module.parameters():
                stack.enter_context(deepspeed.zero.GatheredParameters([param], modifier_rank=None))
            yield

    def full_params(self) -> dict[str, torch.Tensor]:
        whole = self._from_partitions() if self.plugin.stage == 3 else None
        return self.gathered_params() if whole is None else whole

    def gathered_params(self) -> dict[str, torch.Tensor]:
        """Every param whole through `GatheredParameters`, one param at a time."""
        with self._gathered():
            return {n: p.detach().clone().float() for n, p in self.named_parameters().items()}

    def _from_partitions(self) -> dict[str, torch.Tensor] | None:
        """Stage 3: every rank's partitions (`param.ds_tensor`) in one all_gather, each param cut from them as
        `Init._allgather_params_sequential` rebuilds it (the ranks' partitions in order, its first `ds_numel`
        elements, `ds_shape`): one collective a read instead of one a param, which took 13% of the ranks' CPU in
        ZeRO-3 cells. None where a param is not plainly partitioned (gathered already, ZeRO++'s secondary or
        quantized partitions, another process group): those read through `gathered_params`."""
        params = self.named_parameters()
        if not params:
            return None
        groups = {id(getattr(p, "ds_process_group", None)) for p in params.values()}
        plain = all(getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE
                    and getattr(p, "ds_secondary_tensor", None) is None
                    and not hasattr(p.ds_tensor, "ds_quant_scale") for p in params.values())
        group = next(iter(params.values())).ds_process_group
        if not plain or len(groups) != 1 or group is None:
            return None
        partitions = [p.ds_tensor for p in params.values()]
        # every rank's partition of a param has the same size (the param is padded to a multiple of the ranks)
        shapes = [[list(t.shape) for t in partitions]] * dist.get_world_size(group)
        by_rank = all_gather_tensors(partitions, group, shapes=shapes)
        return {name: torch.cat([ranks[i] for ranks in by_rank])[:p.ds_numel].reshape(p.ds_shape)
                for i, (name, p) in enumerate(params.items())}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        grads: dict[str, torch.Tensor | None] = {}
        for name, param in self.named_parameters().items():  # the same order on every rank: collectives
            grad = None if _outside_zero3_partitions(param) else safe_get_full_grad(param)
            shape = getattr(param, "ds_shape", param.shape)
            grads[name] = None if grad is None else grad.detach().float().reshape(shape).clone()
        return grads

    def optimizer_state(self, key: str = "exp_avg") -> dict[str, torch.Tensor | None]:
        """Each param's full optimizer state `key` (`safe_get_full_optimizer_state`; stage 0: the torch state)."""
        out: dict[str, torch.Tensor | None] = {}
        for name, param in self.named_parameters().items():
            if self.plugin.stage == 0:
                state = self.engine.optimizer.state.get(param, {}) if self.engine.optimizer is not None else {}
                value = state.get(key)
            else:
                value = safe_get_full_optimizer_state(param, key)
            out[name] = None if value is None else value.detach().float().clone()
        return out


def _outside_zero3_partitions(param: torch.nn.Parameter) -> bool:
    """A ZeRO-3 param that requires grad now but had no place in the optimizer's partitions when the engine was built
    (unfrozen later): ZeRO-3 keeps no grad for it, and `safe_get_full_grad` (stage3.py `get_fp32_grad_for_param`,
    which checks `requires_grad` alone) raises a KeyError looking it up in `grad_position`."""
    optimizer = getattr(param, "_z3_optimizer", None)
    return (param.grad is None and hasattr(param, "ds_id") and optimizer is not None and param.requires_grad
            and optimizer.get_param_id(param) not in optimizer.grad_position)


def _model_states_file(folder: Path) -> Path:
    """Rank 0's model-states file: `mp_rank_00_model_states.pt` (stages 0-2), `zero_pp_rank_0_...` (stage 3)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(f"no model-states file in {folder}: {sorted(p.name for p in folder.iterdir())}")


def saved_contents(folder: Path, view: DeepSpeedView, exclude_frozen: bool) -> Saved:
    """What DeepSpeed's files hold, by bare names: a param is saved where its values are, the module state dict
    (stages 0-2; stage 3 keeps only empty placeholders there), the ZeRO shards' flat fp32 partitions (the names
    of `param_shapes`) or the frozen fragments (`frozen_param_fragments`, stages 2-3); optimizer state where
    the torch optimizer's state has moments (stage 0) or the ZeRO shards' base optimizer state does (1-3)."""
    state = load_file(_model_states_file(folder))
    module = state.get("module") or {}
    params = {name for name, tensor in module.items() if isinstance(tensor, torch.Tensor) and tensor.numel() > 0}
    in_partitions = {name for group in (state.get("param_shapes") or []) for name in group}
    params |= set(state.get("frozen_param_fragments") or {})
    optimizer_state: set[str] = set()
    shards = sorted(folder.glob("*zero_pp_rank_*_optim_states.pt"))  # ZeRO, and bf16 at stage 0 (BF16_Optimizer)
    if not shards and "state" not in (state.get("optimizer") or {}):  # FP16_Optimizer (bf16 at stage 0): flat masters
        if _holds_moments(state.get("optimizer")):
            optimizer_state = set(_names_of(view, view._optimizer_params()))
    elif not shards:
        optim = state.get("optimizer") or {}
        ordered = [p for group in view.engine.optimizer.param_groups for p in group["params"]]
        names = {id(p): n for n, p in view.named_parameters().items()}
        for index, moments in (optim.get("state") or {}).items():
            if moments and "exp_avg" in moments and index < len(ordered):
                optimizer_state.add(names.get(id(ordered[index]), f"<not a model param: index {index}>"))
    else:
        # stages 1-2: optimizer_state_dict.base_optimizer_state; stage 3: optimizer_state_dict.optimizer_state_dict
        has_moments = any(_holds_moments(load_file(shard).get("optimizer_state_dict")) for shard in shards)
        params |= in_partitions
        if has_moments:
            optimizer_state = set(in_partitions)
    return Saved(frozenset(params), frozenset(optimizer_state), trainable_only=exclude_frozen)


def _names_of(view: DeepSpeedView, params: list[nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in view.named_parameters().items()}
    return [by_id[id(p)] for p in params if id(p) in by_id]


def _holds_moments(tree: Any) -> bool:
    """Whether a ZeRO shard's optimizer state holds Adam's moments somewhere (a non-empty `exp_avg` tensor)."""
    if isinstance(tree, dict):
        moment = tree.get("exp_avg")
        if isinstance(moment, torch.Tensor) and moment.numel() > 0:
            return True
        return any(_holds_moments(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_holds_moments(value) for value in tree)
    return False


def destroy(engine: Any) -> None:
    """`engine.destroy()` where the release has it: ZeRO's hooks and per-engine registries go with it."""
    ending = getattr(engine, "destroy", None)
    if ending is not None:
        ending()


def keep_world_clone(ctx: RunContext) -> None:
    """DeepSpeed clones the world group once per process and keeps it in a module global: made once, as in a
    user's job, and kept with the rank's default group (else the next cell would meet a destroyed group)."""
    ctx.kept.ensure("deepspeed world group clone", ctx.world_size, ds_groups._clone_world_group, _release_world_clone)


def _release_world_clone() -> None:
    ds_groups._WORLD_GROUP = None
