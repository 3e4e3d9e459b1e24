"""Views of a wrapped model by the bare model's parameter names: whole params, DTensors, FSDP1 units.

Every adapter reads its model back through one of these (or a subclass for the stack's own
storage: ZeRO grad stores, Gemini chunks, Megatron's TP shards). Only torch is imported, so
adapters pinned to an older torch share them. The one name mapping is `original_names`.

Views that gather metadata or rank-dependent shards across ranks use `all_gather_json` and
`all_gather_tensors`, never torch's `*_object` collectives: those unpickle what peers send,
and on more than one host that arrives over a network socket.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .base import buffers_of, strip_wrapper_infixes

#: The module names FSDP1 inserts into parameter names.
FSDP1_INFIXES = ("_fsdp_wrapped_module",)
#: ... and with torch's `checkpoint_wrapper` around blocks (Composer's activation checkpointing).
CHECKPOINT_WRAPPER_INFIXES = (*FSDP1_INFIXES, "_checkpoint_wrapped_module")
FLAT_PARAM = "_flat_param"


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must live for a collective on `group`: NCCL's current CUDA device, else the CPU (gloo)."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: How long the gloo workers get to let go of a finished collective's tensors (`settle_groups`).
SETTLE_S = 0.01
#: From this torch on, a process group's destructor releases the GIL (pytorch/pytorch#154976, merged 2025-06-04,
#: before 2.8 branched): `settle_groups` has nothing to prevent there.
GIL_RELEASING_GROUP_DESTRUCTOR = (2, 8)


def settle_groups() -> None:
    """Call before dropping the last reference to process groups (a wrapper's `__del__`, a destroy): torch's
    ProcessGroupGloo destructor takes its work lock holding the GIL, while a worker finishing an async op
    (ZeRO's) holds that lock and needs the GIL to free the op's tensors: a deadlock, seen on torch 2.5 with
    ColossalAI's HybridParallel ZeRO-1 in ~1 run of 3 of its 98 cells once cells got fast (gdb: the main thread
    in ~ProcessGroupGloo waiting for the work mutex, a worker in ~TensorImpl waiting for the GIL). Upstream:
    pytorch/pytorch#56297; the destructor releases the GIL since pytorch/pytorch#154976 (torch 2.8). A barrier
    on every group waits for its earlier work; the sleep (the GIL released) lets the workers finish with it.
    A collective: every rank calls it."""
    if torch.__version__ >= GIL_RELEASING_GROUP_DESTRUCTOR:
        return
    for group in list(dist.distributed_c10d._world.pg_map):  # creation order: the same on every rank
        dist.barrier(group=group)
    time.sleep(SETTLE_S)


def _all_gather_padded(flat: torch.Tensor, lengths: list[int], group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's 1-d `flat` (rank i's has `lengths[i]` elements): padded to the longest, gathered, trimmed."""
    longest = max(max(lengths), 1)  # never a zero-sized collective
    padded = torch.zeros(longest, dtype=flat.dtype, device=flat.device)
    padded[:flat.numel()] = flat
    gathered = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(gathered, padded, group=group)
    return [t[:n] for t, n in zip(gathered, lengths)]


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serializable `value`, in rank order of `group` (a collective; no pickle).

    The value travels as UTF-8 JSON in a uint8 tensor: the lengths are gathered first, then the
    bytes, padded to the longest. JSON turns tuples into lists, as it does anywhere.
    """
    device = collective_device(group)
    data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    chunks = _all_gather_padded(data, [int(n.item()) for n in sizes], group)
    return [json.loads(bytes(chunk.cpu().tolist()).decode()) for chunk in chunks]


def all_gather_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, *,
                       shapes: list[list[list[int]]] | None = None) -> list[list[torch.Tensor]]:
    """Every rank's list of tensors (any count, any shapes), in rank order of `group`, in fp32 on the CPU.

    Each rank's tensors are flattened into one fp32 buffer; the buffers are padded to the longest,
    gathered and split again. `shapes` is every rank's list of shapes when the caller has already
    gathered them (with its own metadata, through `all_gather_json`); otherwise they are gathered here.
    A collective: every rank calls it.
    """
    if shapes is None:
        shapes = all_gather_json([list(t.shape) for t in tensors], group)
    device = collective_device(group)
    flat = (torch.cat([t.detach().reshape(-1).to(device, torch.float32) for t in tensors]) if tensors
            else torch.zeros(0, dtype=torch.float32, device=device))
    numels = [[math.prod(shape) for shape in rank_shapes] for rank_shapes in shapes]
    buffers = _all_gather_padded(flat, [sum(n) for n in numels], group)
    out: list[list[torch.Tensor]] = []
    for buffer, rank_shapes, rank_numels in zip(buffers, shapes, numels):
        pieces = buffer.cpu().split(rank_numels) if rank_numels else ()
        out.append([piece.reshape(shape).clone() for piece, shape in zip(pieces, rank_shapes)])
    return out


def original_names(name: str, param: nn.Parameter, infixes: tuple[str, ...] = FSDP1_INFIXES) -> list[str]:
    """The bare model's names one wrapped parameter stands for (an FSDP1 flat param stands for many)."""
    fqns = getattr(param, "_fqns", None)
    if fqns is None:
        return [strip_wrapper_infixes(name, infixes)]
    owner = name.rpartition(FLAT_PARAM)[0]
    return [strip_wrapper_infixes(owner + fqn, infixes) for fqn in fqns]


def optimizer_params(module: nn.Module, optimized: Iterable[str],
                     infixes: tuple[str, ...] = FSDP1_INFIXES) -> list[nn.Parameter]:
    """What a user passes to the optimizer: the wrapped params that stand for a param they mean to train."""
    wanted = set(optimized)
    return [p for n, p in module.named_parameters()
            if p.requires_grad and any(o in wanted for o in original_names(n, p, infixes))]


class ParamView:
    """Whole, full tensors with their grads on them (DDP-style wrappers leave the bare model like that)."""

    grad_access = "param.grad"

    def __init__(self, module: nn.Module, optimizers: torch.optim.Optimizer | list,
                 infixes: tuple[str, ...] = FSDP1_INFIXES) -> None:
        self.module = module
        self.optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.infixes = infixes

    def named_parameters(self) -> dict[str, nn.Parameter]:
        return {strip_wrapper_infixes(n, self.infixes): p for n, p in self.module.named_parameters()}

    def requires_grad_flags(self) -> dict[str, bool]:
        return {n: p.requires_grad for n, p in self.named_parameters().items()}

    def tracked_names(self) -> set[str]:
        owners = {id(p): (n, p) for n, p in self.module.named_parameters()}
        tracked: set[str] = set()
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if id(param) in owners:
                        tracked.update(original_names(*owners[id(param)], self.infixes))
                    else:  # the optimizer holds a tensor the wrapped model does not: name it so the check shows it
                        tracked.add(f"<not a model param: {tuple(param.shape)}>")
        return tracked

    def full_params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.named_parameters().items()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.named_parameters().items()}

    def full_buffers(self) -> dict[str, torch.Tensor]:
        return buffers_of(self.module, self.infixes)


def full_tensors(tensors: dict[str, Any]) -> dict[str, Any]:
    """The full values of DTensors (None stays None), in as few collectives as their layouts allow.

    Those sharded on dim 0 of a 1-D mesh (FSDP2's layout) are gathered together, one `all_gather_tensors` per mesh,
    and their rank-ordered local shards concatenated: what `full_tensor()` gives, in the DTensor's dtype. Every
    rank's shard shape follows from the global shape (`dim0_shard_rows`), so no shapes are gathered first. Any other
    layout (a 2-D mesh, TP's) is read by its own `full_tensor()`. One collective per param took a tenth of the
    ranks' CPU in FSDP2 cells, the shapes' gather half of what was left. A collective: every rank calls it with the
    same names in the same order.
    """
    full: dict[str, Any] = dict.fromkeys(tensors)
    by_mesh: dict[int, tuple[Any, list[str]]] = {}
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        if not hasattr(tensor, "device_mesh"):  # not a DTensor: left out of sharding (ignored_params), whole
            full[name] = tensor
        elif tensor.device_mesh.ndim == 1 and len(tensor.placements) == 1 and tensor.placements[0].is_shard(0):
            by_mesh.setdefault(id(tensor.device_mesh), (tensor.device_mesh, []))[1].append(name)
        else:
            full[name] = tensor.full_tensor()
    for mesh, names in by_mesh.values():
        ranks, own = mesh.size(), mesh.get_local_rank()
        shapes: list[list[list[int]]] = [[] for _ in range(ranks)]
        locals_ = [tensors[name].to_local() for name in names]
        for name, local in zip(names, locals_):
            global_shape = list(tensors[name].shape)
            for rank, rows in enumerate(dim0_shard_rows(global_shape[0] if global_shape else 1, ranks)):
                shapes[rank].append([rows, *global_shape[1:]])
            if list(local.shape) != shapes[own][-1]:  # a layout this rule does not describe: never misread it
                raise RuntimeError(f"{name}: rank {own}'s shard has shape {list(local.shape)}, not the "
                                   f"{shapes[own][-1]} of a dim-0 chunk of {global_shape} over {ranks} ranks")
        shards = all_gather_tensors(locals_, mesh.get_group(), shapes=shapes)
        for index, name in enumerate(names):
            whole = torch.cat([rank_shards[index] for rank_shards in shards])
            full[name] = whole.reshape(tensors[name].shape).to(tensors[name].dtype)
    return full


def dim0_shard_rows(length: int, ranks: int) -> list[int]:
    """Each rank's rows of a tensor sharded on dim 0 (DTensor's `Shard(0)`, FSDP2's layout): `torch.chunk`'s
    chunks of ceil(length / ranks) rows, the last ones shorter or empty."""
    chunk = -(-length // ranks)
    return [max(0, min(chunk, length - rank * chunk)) for rank in range(ranks)]


class DTensorView(ParamView):
    """FSDP2 (`fully_shard`): params and grads are DTensors, read back whole through `full_tensors` (a collective)."""

    grad_access = "param.grad.full_tensor() (DTensor)"

    def full_params(self) -> dict[str, torch.Tensor]:
        return full_tensors({n: p.detach() for n, p in self.named_parameters().items()})

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        return full_tensors({n: p.grad for n, p in self.named_parameters().items()})


class FSDP1View(ParamView):
    """An FSDP1 module, flat params (use_orig_params=False) or original ones."""

    grad_access = "FSDP.summon_full_params(model, with_grads=True)"

    def __init__(self, module: FSDP, optimizers: torch.optim.Optimizer | list,
                 infixes: tuple[str, ...] = FSDP1_INFIXES) -> None:
        super().__init__(module, optimizers, infixes)
        if not module._use_orig_params:
            self.grad_access = "flat_param.grad shards, all-gathered and split by flat_param._fqns"

    def requires_grad_flags(self) -> dict[str, bool]:
        if self.module._use_orig_params:  # the original params stay registered: their flags are what a user reads
            return super().requires_grad_flags()
        with FSDP.summon_full_params(self.module, writeback=False):  # flat params: the originals only inside
            return super().requires_grad_flags()

    def full_params(self) -> dict[str, torch.Tensor]:
        with FSDP.summon_full_params(self.module, writeback=False):
            return super().full_params()

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        if self.module._use_orig_params:
            with FSDP.summon_full_params(self.module, writeback=False, with_grads=True):
                return super().full_grads()
        # summon_full_params(with_grads=True) refuses flat params: gather the shards ourselves.
        return flat_param_grads(self.module, self.infixes)


def flat_param_grads(fsdp_module: nn.Module,
                     infixes: tuple[str, ...] = FSDP1_INFIXES) -> dict[str, torch.Tensor | None]:
    """Full grads of every original param of an FSDP1 module with flat params (use_orig_params=False).

    Gather each flat grad's shards and split it by the flat param's FQNs, shapes and padding.
    A collective: every rank calls it.
    """
    grads: dict[str, torch.Tensor | None] = {}
    for name, flat in fsdp_module.named_parameters():  # same order on every rank
        names = original_names(name, flat, infixes)
        if flat.grad is None:
            grads.update(dict.fromkeys(names))
            continue
        shards = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, flat.grad.contiguous())
        full = torch.cat(shards)
        pieces = iter(zip(names, flat._shapes))
        offset = 0
        for numel, is_padding in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not is_padding:
                original, shape = next(pieces)
                grads[original] = full[offset:offset + numel].view(shape).clone()
            offset += numel
    return grads
