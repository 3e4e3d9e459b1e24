"""DeepSpeed through `deepspeed.initialize` and its engine, as a DeepSpeed user trains.

Per cell: build the bare model (inside `deepspeed.zero.Init` for init `zero-init`), freeze it, hand it to
`deepspeed.initialize` with a config (ZeRO stage, offload, clipping, precision, optionally the optimizer), then
`engine(batch)`, `engine.backward(loss)`, `engine.step()`: the engine clips inside `step()` with the config's
`gradient_clipping`. The view reads everything back by the bare model's names through DeepSpeed's public
debugging API (`deepspeed.utils.safe_get_full_grad` / `safe_get_full_optimizer_state`, `GatheredParameters` at
stage 3). The round trip is `engine.save_checkpoint` / a fresh engine's `engine.load_checkpoint`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .ops import missing, use_environment_cache

use_environment_cache()  # before DeepSpeed is imported: its ops load from the environment's cache

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.runtime import engine as ds_engine  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402
from deepspeed.utils import groups as ds_groups  # noqa: E402
from deepspeed.utils import safe_get_full_grad, safe_get_full_optimizer_state, safe_set_full_fp32_param  # noqa: E402
from torch import nn  # noqa: E402

from ... import models  # noqa: E402
from ...core.cell import Cell  # noqa: E402
from ..base import AdapterBase, RunContext, apply_freeze  # noqa: E402
from ..loop import Saved, train  # noqa: E402
from ..saved_files import load_file  # noqa: E402
from ..views import ParamView, all_gather_tensors, settle_groups  # noqa: E402
from . import CONFIG_OPTIMIZER  # noqa: E402

PLUGIN_RE = re.compile(r"^zero(?P<stage>[0-3])(?P<offload>-offload)?(?P<config>-config-optim)?(?P<bf16>-bf16)?$")
#: A rule's `options = {exclude_frozen_parameters = true}`: `save_checkpoint(..., exclude_frozen_parameters=True)`
#: (the PEFT recipe: the base model supplies the frozen weights), loaded with `load_module_strict=False`.
EXCLUDE_FROZEN = "exclude_frozen_parameters"
#: The round trip's checkpoint tag (a sub-folder of the cell's folder).
TAG = "freezecompat"
#: A tiny model needs it: with the default (1e5 elements) stage 3 keeps every param of tiny-gpt whole.
PERSISTENCE_THRESHOLD = 0
#: DeepSpeed logs at INFO on every initialize; a cell's log keeps its warnings.
LOG_LEVEL = "WARNING"


@dataclass(frozen=True)
class Plugin:
    stage: int
    offload: bool
    config_optimizer: bool
    bf16: bool = False


def parse_plugin(plugin: str) -> Plugin:
    match = PLUGIN_RE.match(plugin)
    if not match:
        raise ValueError(f"deepspeed adapter has no plugin {plugin!r} "
                         f"(expected zero<0-3>[-offload][{CONFIG_OPTIMIZER}][-bf16])")
    return Plugin(int(match["stage"]), bool(match["offload"]), bool(match["config"]), bool(match["bf16"]))


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
            grad = safe_get_full_grad(param)
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


@dataclass
class _StageZeroNorm:
    """Stage 0 (fp32) clips inside `engine.step()` with `deepspeed.runtime.utils.clip_grad_norm_` and drops the
    norm it returns (`get_global_grad_norm()` stays None): record what that call returns, changing nothing."""

    norms: list[float] = field(default_factory=list)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        original = ds_engine.clip_grad_norm_

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = original(*args, **kwargs)
            self.norms.append(float(norm))
            return norm

        ds_engine.clip_grad_norm_ = clip_grad_norm_
        try:
            yield
        finally:
            ds_engine.clip_grad_norm_ = original


@dataclass
class _Loop:
    ctx: RunContext
    engine: Any
    plugin: Plugin
    view: DeepSpeedView
    exclude_frozen: bool
    clips_in_step = True
    stage0: _StageZeroNorm = field(default_factory=_StageZeroNorm)
    destroyed: bool = False

    @property
    def save_api(self) -> str:
        excluded = ", exclude_frozen_parameters=True" if self.exclude_frozen else ""
        strict = "load_module_strict=False" if self.exclude_frozen else "load_module_strict=True"
        return f"engine.save_checkpoint(dir{excluded}); fresh engine.load_checkpoint(dir, {strict})"

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward_backward(self, step: int) -> None:
        loss = self.ctx.loss(self.engine, self.ctx.local_batch(step))
        self.engine.backward(loss)

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        raise AssertionError("the DeepSpeed engine clips inside step() (gradient_clipping)")

    def step(self) -> None:
        with self.stage0.recording() if self.plugin.stage == 0 else contextlib.nullcontext():
            self.engine.step()

    def norm_after_step(self) -> tuple[float | None, str]:
        norm = self.engine.get_global_grad_norm()
        if norm is not None:
            return float(norm), "engine.get_global_grad_norm() after engine.step() (gradient_clipping)"
        if self.plugin.stage == 0 and self.stage0.norms:
            return self.stage0.norms[-1], ("stage 0: get_global_grad_norm() is None; the norm returned by "
                                           "deepspeed.runtime.utils.clip_grad_norm_ inside engine.step() "
                                           "(engine.clip_fp32_gradients drops it), recorded around that call")
        return None, "engine.get_global_grad_norm() is None after engine.step()"

    # -- the model-checkpoint round trip ---------------------------------------------------------------
    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, exclude_frozen_parameters=self.exclude_frozen)
        dist.barrier()

    def saved(self, directory: Path) -> Saved:
        return saved_contents(directory / TAG, self.view, self.exclude_frozen)

    def close(self) -> None:
        self.destroy()
        settle_groups()
        dist.barrier()

    def destroy(self) -> None:
        """`engine.destroy()` (once): the optimizer's hooks and DeepSpeed's per-engine registries go with it."""
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None and not self.destroyed:
            destroy()
        self.destroyed = True

    def load(self, directory: Path, omit: str | None = None) -> None:
        fresh = None
        if omit is not None:
            fresh = self.view.full_params().get(omit)
        path, _ = self.engine.load_checkpoint(str(directory), tag=TAG, load_module_strict=not self.exclude_frozen)
        if path is None:
            raise RuntimeError(f"engine.load_checkpoint found no checkpoint in {directory}")
        if fresh is not None:
            _overwrite(self.view, omit, fresh)


def _overwrite(view: DeepSpeedView, name: str, value: torch.Tensor) -> None:
    """A broken load (tests only): put `name` back at its fresh value, in the model and the optimizer's master."""
    param = view.named_parameters()[name]
    if param.requires_grad and (hasattr(param, "_hp_mapping") or hasattr(param, "ds_id")):
        safe_set_full_fp32_param(param, value.to(param.dtype))
        return
    if hasattr(param, "ds_id"):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value.to(param.dtype))
        return
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


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


def _checkpoint_blocks_with_deepspeed(model: nn.Module) -> None:
    """`checkpoint = "framework"`: each block through `deepspeed.checkpointing.checkpoint`. A transformers model
    takes it through its own switch, as its docs swap the checkpoint function (`_set_gradient_checkpointing`
    after `gradient_checkpointing_enable`: the switch also turns the KV cache off, which a recomputed layer would
    otherwise append to twice); any other model has each block's forward wrapped, as a model written for
    DeepSpeed calls it around its layers (Megatron-DeepSpeed)."""
    deepspeed.checkpointing.configure(None, partition_activations=False, contiguous_checkpointing=False,
                                      checkpoint_in_cpu=False, synchronize=False, profile=False)
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=deepspeed.checkpointing.checkpoint)
        return
    for block in models.block_modules(model):
        inner = block.forward

        def forward(*args: Any, _inner: Any = inner) -> Any:
            return deepspeed.checkpointing.checkpoint(_inner, *args)

        block.forward = forward


def _fill_partitioned(ctx: RunContext, model: nn.Module) -> None:
    """`models.init_weights` on a model built inside `zero.Init`: each param gathered, filled, re-partitioned."""
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(models.deterministic_values(ctx.cell.hyper.seed, name, param.shape).to(param.dtype))


def _transformers_construction_under_zero3() -> contextlib.AbstractContextManager[None]:
    """What transformers' `from_config` enters around a model's constructor under ZeRO-3 (`modeling_utils`:
    `no_init_weights`, `prevent_arange_dtype_change`): a transformers model's own weight init would index its
    partitioned (empty) params (`weight[padding_idx]`). Its weights are filled after construction, gathered, as
    transformers' `initialize_weights_zero3` does (here `_fill_partitioned`). Nothing where transformers is absent."""
    stack = contextlib.ExitStack()
    try:
        from transformers import initialization
        from transformers.integrations.deepspeed import prevent_arange_dtype_change
    except ImportError:
        return stack
    stack.enter_context(initialization.no_init_weights())
    stack.enter_context(prevent_arange_dtype_change())
    return stack


def _release_world_clone() -> None:
    ds_groups._WORLD_GROUP = None


class DeepSpeedAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        absent = missing()
        if absent:
            raise RuntimeError(f"DeepSpeed ops {', '.join(absent)} are not built in this environment: run "
                               "`python -m pytest_freezecompat.adapters.deepspeed.environment_setup` with its python")
        deepspeed.utils.logger.setLevel(LOG_LEVEL)
        plugin = parse_plugin(ctx.cell.key.plugin)
        ctx.probe.phase("deepspeed.init_distributed")
        deepspeed.init_distributed(dist_backend=dist.get_backend())
        # DeepSpeed clones the world group once per process and keeps it in a module global: made once, as in a
        # user's job, and kept with the rank's default group (else the next cell would meet a destroyed group).
        ctx.kept.ensure("deepspeed world group clone", ctx.world_size, ds_groups._clone_world_group,
                        _release_world_clone)
        built: list[_Loop] = []

        def build() -> _Loop:
            built.append(self.build(ctx, plugin))
            return built[-1]

        train(ctx, build(), rebuild=build)
        # The ranks stay warm for the next cell: a user's script ends its process, we end the engines (their
        # ZeRO hooks and registries would otherwise live on in this process).
        for loop in built:
            loop.destroy()

    def build(self, ctx: RunContext, plugin: Plugin) -> _Loop:
        """What a user's script does before its first step (and again when it resumes)."""
        config = ds_config(ctx.cell, plugin, ctx.world_size)
        ctx.probe.phase("build model")
        if ctx.cell.key.init == "zero-init":
            if plugin.stage != 3:
                raise ValueError("zero.Init partitions params at construction: stage 3 only")
            with _transformers_construction_under_zero3(), deepspeed.zero.Init(config_dict_or_path=config):
                model = ctx.build_model(device=ctx.device, initialize=False)
            _fill_partitioned(ctx, model)
        else:
            model = ctx.build_model(device=ctx.device)
        if ctx.cell.key.checkpoint == "framework":
            _checkpoint_blocks_with_deepspeed(model)
        plan = ctx.resolve_plan(model)
        apply_freeze(plan, model)
        ctx.probe.phase(f"deepspeed.initialize ({ctx.cell.key.plugin})")
        if plugin.config_optimizer:
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        else:
            chosen = [p for n, p in model.named_parameters() if p.requires_grad and n in plan.optimized]
            engine, *_ = deepspeed.initialize(model=model, optimizer=ctx.make_optimizer(chosen), config=config)
        dist.barrier()
        exclude = bool(ctx.cell.options.get(EXCLUDE_FROZEN, False))
        return _Loop(ctx, engine, plugin, DeepSpeedView(engine, plugin), exclude)


def summarize_stage_3_arguments() -> None:
    """ZeRO-3's optimizer formats its constructor's arguments into a debug message that it then drops
    (`DeepSpeedZeroOptimizer_Stage3.__init__`: `print_rank_0(f"... with args: {locals()}", force=False)`), and
    `param_names` prints every param's values, not yet partitioned when the model was built eagerly: ~40 ms of
    every such engine for tiny-gpt, 7% of the ranks' CPU in ZeRO-3 cells. Inside that constructor a tensor's repr
    shows an element at each end only; what it builds is unchanged."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    construct = Stage3.__init__
    if getattr(construct, "summarized", False):
        return

    @functools.wraps(construct)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        options = torch._tensor_str.PRINT_OPTS
        threshold, edgeitems = options.threshold, options.edgeitems
        torch.set_printoptions(threshold=0, edgeitems=1)
        try:
            construct(self, *args, **kwargs)
        finally:
            torch.set_printoptions(threshold=threshold, edgeitems=edgeitems)

    __init__.summarized = True  # type: ignore[attr-defined]
    Stage3.__init__ = __init__


def warm_up() -> None:
    """Once in each rank template (a fork then has it all): ask py-cpuinfo, summarize ZeRO-3's dropped debug
    message, load the environment's built ops (never builds), and make the import every engine's first optimizer
    check makes: 0.19.8's `is_zero_supported_optimizer` imports its Muon optimizer on first call, whose
    `torch.compile` decorator loads inductor (~1 s of every fresh rank's first cell)."""
    if missing():
        return  # the cell says so, in one line
    from .ops import load_all, remember_cpu_info

    remember_cpu_info()  # first: each op's load asks twice (its compile flags)
    summarize_stage_3_arguments()
    load_all()
    with contextlib.suppress(ImportError):  # 0.19.2 imports it with deepspeed itself
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
