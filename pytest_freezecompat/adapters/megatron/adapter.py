"""Megatron-core: a real `GPTModel` (local layer spec) trained the way Megatron trains it.

Per (tp, pp) layout: `parallel_state.initialize_model_parallel` on the rank's default group
(kept across clean cells, as a user's job makes it once). Per cell: the
model built for this rank's pipeline stage and tensor-parallel shard, frozen before
wrapping (or, for the after-wrap scenario, after), wrapped in torch DDP or Megatron's
`DistributedDataParallel` (optionally with the distributed optimizer), trained through
Megatron's own schedule from `get_forward_backward_func`, clipped by the optimizer's
`step()`. The view names everything by the full model's names (global layer index,
TP shards and pipeline stages gathered), so the single-process `MirrorGPT` reference
can be compared parameter by parameter.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import shard_buffer
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import DistributedOptimizer, OptimizerConfig
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import param_is_not_shared
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from ... import models
from ...core.cell import Cell
from ...core.freeze import FreezePlan
from ..base import AdapterBase, Batch, LossOf, Probe, RunContext, apply_freeze, precision_of
from ..loop import train
from ..views import all_gather_json, all_gather_tensors, settle_groups
from . import WRAPPERS, compat
from .checkpoint import MegatronCheckpoint

VOCAB, SEQ, HIDDEN, HEADS, LAYERS = 64, 8, 16, 2, 4
#: `<wrapper>-tp<N>` or `<wrapper>-pp<N>`: the parallel layout is part of the plugin id.
LAYOUT_RE = re.compile(r"^(tp|pp)(\d+)$")
LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
RECOMPUTE = {"none": {}, "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                                  "recompute_num_layers": 1},
             "selective": {"recompute_granularity": "selective"}}
#: A rule's `options = {freeze_after_wrap = true}` freezes after wrapping, as users sometimes do.
FREEZE_AFTER_WRAP = "freeze_after_wrap"
SEED_OFFSET = 2718


@dataclass(frozen=True)
class Layout:
    wrapper: str  # "torch-ddp" | "megatron-ddp" | "megatron-ddp-distopt"
    tp: int
    pp: int


def parse_plugin(plugin: str) -> Layout:
    wrapper, _, layout = plugin.rpartition("-")
    match = LAYOUT_RE.match(layout)
    if wrapper not in WRAPPERS or not match:
        raise ValueError(f"megatron adapter has no plugin {plugin!r} (expected e.g. megatron-ddp-tp2, torch-ddp-pp2)")
    axis, size = match.group(1), int(match.group(2))
    return Layout(wrapper, size if axis == "tp" else 1, size if axis == "pp" else 1)


# -- the single-process reference: plain PyTorch with GPTModel's parameter names and math ------------------
class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_proj = nn.Linear(HIDDEN, HIDDEN)  # registered first, as in Megatron's Attention
        self.linear_qkv = nn.Linear(HIDDEN, 3 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        # Megatron's fused QKV layout: per head [q | k | v] (num_query_groups == heads).
        q, k, v = self.linear_qkv(x).view(b, s, HEADS, 3 * (h // HEADS)).split(h // HEADS, dim=-1)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.linear_proj(att.transpose(1, 2).reshape(b, s, h))


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.linear_fc2 = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.self_attention = _Attention()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN, eps=1e-5)
        self.mlp = _MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(HIDDEN, eps=1e-5)


class _Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)


class MirrorGPT(nn.Module):
    """`GPTModel(get_gpt_layer_local_spec())` at TP=PP=1, untied output, no dropout, in plain PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = _Embedding()
        self.decoder = _Decoder()
        self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(positions)
        for layer in self.decoder.layers:
            x = layer(x)
        return self.output_layer(self.decoder.final_layernorm(x))


def _mirror_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return models.loss_fn(model(batch["tokens"]), batch["targets"])


# -- the Megatron model on this rank -------------------------------------------------------------------------
def transformer_config(cell: Cell, layout: Layout, on_cpu: bool, meta: bool) -> TransformerConfig:
    if cell.precision != "fp32":
        raise ValueError(f"the megatron adapter runs fp32 only, not {cell.precision}")
    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        # perform_initialization stays on for meta: with it off, Megatron's CPU path never sets the TP attributes.
        use_cpu_initialization=on_cpu or meta, **RECOMPUTE[cell.key.checkpoint],
        # Megatron-LM's training hard-codes this: backward goes straight to the C++ autograd engine.
        deallocate_pipeline_outputs=True,
    )


def global_names(model: nn.Module) -> dict[str, str]:
    """Local name on this stage -> the full model's name (`decoder.layers.<global index>`)."""
    names = {}
    for local, _ in model.named_parameters():
        match = LAYER_RE.match(local)
        if match:
            number = model.decoder.layers[int(match.group(1))].layer_number  # 1-based, global
            names[local] = f"decoder.layers.{number - 1}.{local[match.end():]}"
        else:
            names[local] = local
    return names


def partition_dims(model: nn.Module) -> dict[str, int | None]:
    """Which dim of each param is split across TP ranks (None: replicated), read from Megatron's attributes."""
    return {local: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            for local, p in model.named_parameters()}


@torch.no_grad()
def fill_deterministic(model: nn.Module, names: dict[str, str], dims: dict[str, int | None], seed: int) -> None:
    """`models.init_weights` semantics on the full tensor, then this rank's TP shard of it."""
    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    for local, param in model.named_parameters():
        shape, dim = list(param.shape), dims[local]
        if dim is not None:
            shape[dim] *= tp_size
        full = models.deterministic_values(seed, names[local], torch.Size(shape))
        if dim is not None:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        param.copy_(full.to(param.device, param.dtype))


def _gather_full(local: dict[str, tuple[int | None, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    """{full name: (partition dim or None, this rank's tensor)} on every rank -> full tensors (a collective).

    Metadata travels as JSON and the tensors as one fp32 buffer per rank: nothing is unpickled.
    """
    tp_rank = ps.get_tensor_model_parallel_rank()
    sent = [t for _, t in local.values() if t is not None]
    meta = [[name, tp_rank, dim, None if t is None else list(t.shape)] for name, (dim, t) in local.items()]
    everyone = all_gather_json(meta)
    tensors = all_gather_tensors(sent, shapes=[[shape for *_, shape in entries if shape is not None]
                                               for entries in everyone])
    shards: dict[str, dict[int, tuple[int | None, torch.Tensor | None]]] = {}
    for entries, received in zip(everyone, tensors):
        arrived = iter(received)
        for name, rank, dim, shape in entries:
            tensor = None if shape is None else next(arrived)
            shards.setdefault(name, {}).setdefault(rank, (dim, tensor))  # data-parallel replicas: keep one
    full: dict[str, torch.Tensor | None] = {}
    for name, by_rank in shards.items():
        parts = [by_rank[r] for r in sorted(by_rank)]
        dim = parts[0][0]
        if any(t is None for _, t in parts):
            full[name] = None
        else:
            full[name] = parts[0][1] if dim is None else torch.cat([t for _, t in parts], dim=dim)
    return full


class _View:
    """The rank's GPTModel stage, read back under the full model's names."""

    def __init__(self, bare: GPTModel, names: dict[str, str], dims: dict[str, int | None], wrapped: nn.Module,
                 optimizer: Any, layout: Layout) -> None:
        self.bare = bare
        self.names = names
        self.dims = {names[local]: dim for local, dim in dims.items()}
        self.wrapped = wrapped
        self.optimizer = optimizer
        self.layout = layout
        if layout.wrapper == "torch-ddp":
            self.grad_access = "param.grad (torch DDP); TP shards and pipeline stages gathered by name"
        elif layout.wrapper == "megatron-ddp":
            self.grad_access = "param.main_grad (Megatron DDP grad buffer; param.grad is None after backward)"
        else:
            self.grad_access = ("param.main_grad is reduced only on this rank's shard of each bucket "
                                "(reduce-scatter): all-gather shard_buffer(bucket.grad_data)[dp_rank] over the "
                                "data-parallel group, then slice by buffer.param_index_map")

    def _params(self) -> Iterator[tuple[str, nn.Parameter]]:
        for local, param in self.bare.named_parameters():
            yield self.names[local], param

    def requires_grad_flags(self) -> dict[str, bool]:
        return {name: param.requires_grad for name, param in self._params()}

    def tracked_names(self) -> set[str]:
        by_id = {id(p): name for name, p in self._params()}
        local = {by_id[id(p)] for p in _optimizer_model_params(self.optimizer)}
        # the distributed optimizer holds a shard per rank
        return set().union(*all_gather_json(sorted(local)))

    def full_params(self) -> dict[str, torch.Tensor]:
        return _gather_full({name: (self.dims[name], p) for name, p in self._params()})

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        if self.layout.wrapper == "torch-ddp":
            local = {name: p.grad for name, p in self._params()}
        elif self.layout.wrapper == "megatron-ddp":
            local = {name: getattr(p, "main_grad", None) for name, p in self._params()}
        else:
            local = self._distopt_grads()
        return _gather_full({name: (self.dims[name], grad) for name, grad in local.items()})

    def _distopt_grads(self) -> dict[str, torch.Tensor | None]:
        """After the reduce-scatter only this rank's shard of each bucket is reduced: gather the shards."""
        group = ps.get_data_parallel_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grads: dict[int, torch.Tensor] = {}
        for buffer in self.wrapped.buffers + self.wrapped.expert_parallel_buffers:
            gathered = []
            for bucket in buffer.buckets:
                shards = [torch.empty_like(s) for s in shard_buffer(bucket.grad_data, size)]
                dist.all_gather(shards, shard_buffer(bucket.grad_data, size)[rank].contiguous(), group=group)
                gathered.append(torch.cat(shards))
            # param_index_map holds the padded offsets the distributed optimizer really uses.
            for param, (start, end, bucket_id) in buffer.param_index_map.items():
                offset = buffer.buckets[bucket_id].offset
                grads[id(param)] = gathered[bucket_id][start - offset:end - offset].view(param.shape)
        return {name: grads.get(id(p)) for name, p in self._params()}


def _optimizer_model_params(optimizer: Any) -> list[nn.Parameter]:
    """The model params an optimizer updates: the distributed optimizer holds shards, mapped back here."""
    if optimizer is None:  # torch DDP: a pipeline stage with nothing to optimize has no optimizer
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [p for group in optimizer.param_groups for p in group["params"]]
    params: list[nn.Parameter] = []
    for opt in compat.chained_optimizers(optimizer):
        if isinstance(opt, DistributedOptimizer):
            # A rank with nothing to train gets a DistributedOptimizer without these groups.
            groups = getattr(opt, "model_float16_groups", []) + getattr(opt, "model_fp32_groups", [])
            params += [p for group in groups for p in group]
        elif opt.optimizer is not None:
            params += [p for group in opt.optimizer.param_groups for p in group["params"]]
    return params


def _freeze(model: nn.Module, names: dict[str, str], plan: FreezePlan) -> None:
    """The same rule on every rank; each stage touches only the modules it owns (pre/post_process)."""
    apply_freeze(plan, model, names.__getitem__)


def _microbatches(ctx: RunContext, step: int, layout: Layout) -> list[Batch]:
    """This data-parallel rank's rows of the global batch, as the pipeline's microbatches."""
    batch = ctx.batches[step]
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = batch["tokens"].shape[0] // dp_size
    mine = {k: v[dp_rank * rows:(dp_rank + 1) * rows].to(ctx.device) for k, v in batch.items()}
    count = layout.pp  # one microbatch per stage keeps the 1F1B schedule honest at pp > 1
    return [{k: v.chunk(count)[i] for k, v in mine.items()} for i in range(count)]


def _forward_step(data: Iterator[Batch], model: nn.Module) -> tuple[torch.Tensor, Callable]:
    batch = next(data)
    tokens = batch["tokens"]
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    per_token = model(tokens, positions, None, labels=batch["targets"])

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        total = output.float().sum()
        return total, torch.tensor(output.numel(), dtype=torch.int), {"lm loss": total.detach()}

    return per_token, loss_func


def _materialize(ctx: RunContext, model: nn.Module, names: dict[str, str]) -> None:
    """`to_empty` (PyTorch's way; Megatron's local layers have no other) re-creates every param from meta.

    The new params keep `requires_grad` but lose Megatron's per-param attributes (tensor_model_parallel,
    partition_dim, allreduce, ...), which its grad-norm and buffers read: copy them back, as a user must.
    """
    attributes = {local: dict(vars(p)) for local, p in model.named_parameters()}
    model.to_empty(device=ctx.device)
    dropped = set()
    for local, param in model.named_parameters():
        missing = {k: v for k, v in attributes[local].items() if k not in vars(param)}
        dropped.update(missing)
        vars(param).update(missing)
    if dropped and ctx.rank == 0:
        ctx.probe.note(f"to_empty() dropped Megatron's param attributes ({', '.join(sorted(dropped))}); "
                       "the adapter copied them back from the meta params")


@dataclass
class _Loop(MegatronCheckpoint):
    """Megatron's own schedule (`get_forward_backward_func`) over this rank's microbatches; saved and loaded
    through Megatron's distributed checkpointing (`checkpoint.MegatronCheckpoint`)."""

    ctx: RunContext
    layout: Layout
    view: _View
    stepped: tuple[Any, Any, Any] | None = None  # what the last optimizer.step() returned

    @property
    def clips_in_step(self) -> bool:
        """Megatron's optimizer clips inside step() (clip_grad); under torch DDP we clip with Megatron's tools."""
        return self.layout.wrapper != "torch-ddp"

    def zero_grad(self) -> None:
        if self.layout.wrapper == "torch-ddp":  # the canonical loop: grads are zeroed through the optimizer
            if self.view.optimizer is not None:
                self.view.optimizer.zero_grad(set_to_none=True)
        else:
            self.view.wrapped.zero_grad_buffer()
            self.view.optimizer.zero_grad()

    def forward_backward(self, step: int) -> None:
        micro = _microbatches(self.ctx, step, self.layout)
        get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=iter(micro), model=[self.view.wrapped],
            num_microbatches=len(micro), seq_length=SEQ, micro_batch_size=micro[0]["tokens"].shape[0],
            forward_only=False)

    def clip(self, max_norm: float) -> tuple[float | None, str]:
        return _clip_torch_ddp(self.view.bare, max_norm), (
            "megatron.core.optimizer.clip_grads.get_grad_norm_fp32 over the model-parallel group "
            "(then clip_grad_by_total_norm_fp32)")

    def step(self) -> None:
        if self.view.optimizer is not None:
            self.stepped = self.view.optimizer.step()

    # A torch-DDP stage with no optimizer is checkpointed as Megatron-LM checkpoints a stub optimizer: model only.
    def _torch_optimizer(self) -> bool:
        return self.view.optimizer is not None and super()._torch_optimizer()

    def _stub_optimizer(self) -> bool:
        return self.view.optimizer is None or super()._stub_optimizer()

    def _metadata(self) -> dict[str, Any] | None:
        return None if self.view.optimizer is None else super()._metadata()

    def norm_after_step(self) -> tuple[float | None, str]:
        _, norm, _ = self.stepped
        return norm, "returned by MegatronOptimizer.step() (clip_grad = max_norm)"

    def close(self) -> None:
        """Nothing global to undo: the parallel state is kept for the rebuild, and the wrapped model, its grad
        buffers and the optimizer belong to this loop alone. Let the groups settle before they are dropped."""
        settle_groups()
        dist.barrier()


def _stub_stage_problem(loop: _Loop) -> str | None:
    """Why the round trip is not run where a pipeline stage has nothing to train and another does: its optimizer
    saves nothing (Megatron-LM skips a stub's state) while the other stage's distributed optimizer issues
    collectives the empty stage never joins, so the ranks' saves do not meet (distopt-pp2 all-but-last). A
    collective: every rank answers."""
    if loop.layout.wrapper != "megatron-ddp-distopt":  # Megatron's DDP and torch's save such a stage fine
        return None
    stubs = all_gather_json(not any(p.requires_grad for p in loop.view.bare.parameters()))
    if all(stubs) or not any(stubs):
        return None
    return ("resume not checked: a pipeline stage has nothing to train (its optimizer is a stub, whose state "
            "Megatron-LM does not save) while another trains; the stages' saves do not meet on the same "
            "collectives here (to be worked out)")


class MegatronAdapter(AdapterBase):
    def reference_model(self, cell: Cell) -> tuple[nn.Module, LossOf]:
        return MirrorGPT(), _mirror_loss

    def run(self, ctx: RunContext) -> None:
        with ctx.emulation():
            self._run(ctx)

    def _run(self, ctx: RunContext) -> None:
        layout = parse_plugin(ctx.cell.key.plugin)
        ctx.probe.phase(f"initialize_model_parallel(tp={layout.tp}, pp={layout.pp})")
        # Made once per layout, as a user's job makes it once: kept with the rank's default group across clean
        # cells, and reused (not made again) by the round trip's rebuild.
        ctx.kept.ensure("megatron parallel state", (layout.tp, layout.pp),
                        lambda: ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                                             pipeline_model_parallel_size=layout.pp),
                        ps.destroy_model_parallel)
        loop = self.build(ctx, layout)
        problem = compat.round_trip_problem() or _stub_stage_problem(loop)
        if problem:
            ctx.probe.note(problem)
        train(ctx, loop, rebuild=None if problem else lambda: self.build(ctx, layout))

    def build(self, ctx: RunContext, layout: Layout) -> _Loop:
        """What a user's script does before its first step (and again when it resumes): seed, build this
        stage's model, freeze (before wrapping unless the rule says after), fill, wrap, make the optimizer."""
        meta = ctx.cell.key.init == "meta"
        after_wrap = bool(ctx.cell.options.get(FREEZE_AFTER_WRAP, False))
        tensor_parallel.model_parallel_cuda_manual_seed(ctx.cell.hyper.seed + SEED_OFFSET)

        ctx.probe.phase("build model")
        config = transformer_config(ctx.cell, layout, ctx.device.type == "cpu", meta)
        with torch.device("meta") if meta else contextlib.nullcontext():
            bare = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
        names, dims = global_names(bare), partition_dims(bare)
        with torch.device("meta"):
            plan = ctx.resolve_plan(MirrorGPT())  # the full model's names, whatever this stage owns
        if not after_wrap:
            _freeze(bare, names, plan)
        if meta:
            _materialize(ctx, bare, names)
        fill_deterministic(bare, names, dims, ctx.cell.hyper.seed)

        ctx.probe.phase(f"wrap ({layout.wrapper})")
        wrapped, optimizer = self._wrap(ctx, config, bare, layout, names, plan, after_wrap)
        _observe(ctx.probe, bare, wrapped, optimizer)
        config.no_sync_func = wrapped.no_sync
        dist.barrier()
        return _Loop(ctx, layout, _View(bare, names, dims, wrapped, optimizer, layout))

    def _wrap(self, ctx: RunContext, config: TransformerConfig, bare: GPTModel, layout: Layout,
              names: dict[str, str], plan: FreezePlan, after_wrap: bool) -> tuple[nn.Module, Any]:
        h = ctx.cell.hyper
        if layout.wrapper == "torch-ddp":
            device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            wrapped: nn.Module = TorchDDP(bare, device_ids=device_ids, process_group=ps.get_data_parallel_group())
            if after_wrap:
                _freeze(bare, names, plan)
            chosen = [p for local, p in bare.named_parameters() if names[local] in plan.optimized and p.requires_grad]
            # A pipeline stage that owns no optimized param gets no optimizer (torch refuses an empty one), as
            # get_megatron_optimizer gives such a stage none (a stub) from 0.11: its steps leave the stage alone.
            return wrapped, ctx.make_optimizer(chosen) if chosen else None
        distopt = layout.wrapper == "megatron-ddp-distopt"
        wrapped = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distopt),
                                          bare)
        if after_wrap:
            _freeze(bare, names, plan)
        config.finalize_model_grads_func = finalize_model_grads
        # config_overrides={} keeps weight decay on biases and norms: plain AdamW, like the reference.
        opt_config = OptimizerConfig(optimizer="adam", lr=h.lr, adam_beta1=h.betas[0], adam_beta2=h.betas[1],
                                     adam_eps=h.eps, weight_decay=h.weight_decay, clip_grad=h.max_norm,
                                     use_distributed_optimizer=distopt)
        return wrapped, compat.megatron_optimizer(opt_config, [wrapped])


#: The wrappers by the path users import them from (both classes are named DistributedDataParallel).
WRAPPER_CLASSES = ((DistributedDataParallel, "megatron.core.distributed.DistributedDataParallel"),
                   (TorchDDP, "torch.nn.parallel.DistributedDataParallel"))


def _observe(probe: Probe, bare: GPTModel, wrapped: nn.Module, optimizer: Any) -> None:
    """The stack as Megatron built it, read back from its objects (`promises` in the package's declaration): the
    wrapper's class, the optimizer's (the distributed one or not; a stage with nothing to train gets a stub of the
    same class from 0.11), the parallel layout from `parallel_state`, the recompute the model's own modules hold
    (the block reads `config.recompute_granularity` in forward; each attention its `checkpoint_core_attention`)."""
    probe.observed("wrapper", next((label for cls, label in WRAPPER_CLASSES if isinstance(wrapped, cls)),
                                   f"{type(wrapped).__module__}.{type(wrapped).__qualname__}"))
    probe.observed("precision", precision_of(wrapped))
    # get_megatron_optimizer returns one optimizer (< 0.12) or a ChainedOptimizer of them; torch DDP's is torch's
    # own, or none on a pipeline stage with nothing to optimize.
    inner = [] if optimizer is None else compat.chained_optimizers(optimizer)
    probe.observed("optimizer", "+".join(type(opt).__name__ for opt in inner) or "none")
    probe.observed("use_distributed_optimizer", any(isinstance(opt, DistributedOptimizer) for opt in inner))
    probe.observed("tensor_model_parallel_size", ps.get_tensor_model_parallel_world_size())
    probe.observed("pipeline_model_parallel_size", ps.get_pipeline_model_parallel_world_size())
    probe.observed("data_parallel_size", ps.get_data_parallel_world_size())
    block = bare.decoder.config
    probe.observed("recompute_granularity", block.recompute_granularity or "none")
    probe.observed("recompute_method", block.recompute_method or "none")
    core_attention = {layer.self_attention.checkpoint_core_attention for layer in bare.decoder.layers}
    probe.observed("checkpoint_core_attention",
                   core_attention.pop() if len(core_attention) == 1 else "differs across layers")


def _clip_torch_ddp(model: nn.Module, max_norm: float) -> float:
    """Megatron's own TP/PP-aware clipping for a model Megatron's optimizer does not own."""
    with_grad = [p for p in model.parameters() if p.grad is not None]
    for_norm = [p.grad for p in with_grad if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
    norm = compat.grad_norm_fp32(for_norm, ps.get_model_parallel_group())
    clip_grad_by_total_norm_fp32(with_grad, max_norm, norm)
    return float(norm)
