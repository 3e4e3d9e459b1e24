"""The `resume` round trip through Megatron-core's distributed checkpointing, as Megatron-LM's
`training/checkpointing.py` does it with `--ckpt-format torch_dist`:

save: `dist_checkpointing.save({"model": model.sharded_state_dict(), "optimizer":
optimizer.sharded_state_dict(model_sharded_sd)}, dir)`; load: the same sharded state dict of the fresh
model (`is_loading=True` for the optimizer), `dist_checkpointing.load(it, dir)`, then
`model.load_state_dict(loaded["model"])` and `optimizer.load_state_dict(loaded["optimizer"])`.

Each rank builds the sharded state dict of its own pipeline stage and TP shard; `ShardedTensor` keys
are global (`decoder.layers.mlp.linear_fc1.weight` stacks every layer along a leading dim), so the
files are read back through `load_tensors_metadata` and mapped to the full model's names.

Under torch DDP the optimizer is a plain `torch.optim.AdamW`, which has no `sharded_state_dict`: it is
made sharded with Megatron's own helpers for "most common optimizer state dicts"
(`dist_checkpointing.optimizer.get_param_id_to_sharded_param_map` + `optim_state_to_sharding_state`),
exactly as Megatron's `FP32Optimizer.sharded_state_dict` does for its torch optimizer (the per-param
`step` saved once as `common_step`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.validation import determine_global_metadata, validate_sharding_integrity
from megatron.core.optimizer import MegatronOptimizer

from ..loop import Saved
from ..views import all_gather_json
from . import compat

MODEL, OPTIMIZER = "model", "optimizer"
#: Adam's moments: what `Saved.optimizer_state` reports (the distributed optimizer also saves `fp32_param`).
MOMENTS = ("exp_avg", "exp_avg_sq")
#: `ChainedOptimizer` prefixes each inner optimizer's keys (0.8 always; 0.16 with several optimizers).
CHAINED = re.compile(r"^chained_\d+\.")
#: A key of every layer at once: the layer index is the leading dim of the global shape.
STACKED = re.compile(r"^decoder\.layers\.(?!\d)")
OPTIM_STATE = re.compile(r"^optimizer\.state\.(\w+)\.(.+)$")
BUCKET_STATE = re.compile(
    r"^(optimizer\.distributed\.dp_group_idx_\d+\.gbuf_idx_\d+\.dtype_.+\.bucket_idx_\d+)\.(\w+)$")

SAVE_API = {
    "torch-ddp": ("megatron.core.dist_checkpointing.save/load of {model: GPTModel.sharded_state_dict(), "
                  "optimizer: torch AdamW state via dist_checkpointing.optimizer.optim_state_to_sharding_state "
                  "(as FP32Optimizer.sharded_state_dict)}; model/optimizer.load_state_dict"),
    "megatron-ddp": ("megatron.core.dist_checkpointing.save/load of {model: GPTModel.sharded_state_dict(), "
                     "optimizer: FP32Optimizer.sharded_state_dict(model_sd)}; model/optimizer.load_state_dict"),
    "megatron-ddp-distopt": ("megatron.core.dist_checkpointing.save/load of {model: GPTModel.sharded_state_dict(), "
                             "optimizer: DistributedOptimizer.sharded_state_dict(model_sd)}, with Megatron-LM's "
                             "metadata (dp_reshardable) where the release takes it; "
                             "model/optimizer.load_state_dict"),
}


# -- a plain torch optimizer (torch DDP), made sharded the way FP32Optimizer makes its own ----------------
def _torch_optimizer_sharded(optimizer: torch.optim.Optimizer, model_sd: dict, present: set[str] | None) -> dict:
    """`present` (loading): the checkpoint's keys. Adam's state exists only for params that got a grad, so on
    load the fresh optimizer gets zero state (Megatron's `init_state_fn`) for the params whose state was saved."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    if present is not None:
        for index, param in enumerate(params):
            sharded = id_map.get(index)
            if sharded is not None and f"optimizer.state.exp_avg.{sharded.key}" in present \
                    and not optimizer.state[param]:
                optimizer.state[param].update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
    state = optimizer.state_dict()
    step = MegatronOptimizer._extract_common_per_param_step(state)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if step is not None:
        state["state"]["common_step"] = step
    return state


def _torch_optimizer_load(optimizer: torch.optim.Optimizer, state: dict) -> None:
    step = state["state"].pop("common_step", None)
    if step is not None:
        MegatronOptimizer._restore_common_per_param_step(state, step)
    optimizer.load_state_dict(state)


class MegatronCheckpoint:
    """Mixed into the adapter's `_Loop` (which has `ctx`, `layout`, `view`)."""

    ctx: Any
    layout: Any
    view: Any

    @property
    def save_api(self) -> str:
        return SAVE_API[self.layout.wrapper]

    def _torch_optimizer(self) -> bool:
        return self.layout.wrapper == "torch-ddp"

    def _metadata(self) -> dict[str, Any] | None:
        return None if self._torch_optimizer() else compat.sharded_state_dict_metadata(self.view.optimizer)

    def _stub_optimizer(self) -> bool:
        """Nothing to train on this rank: Megatron's optimizer is a stub (`is_stub_optimizer`), whose state
        Megatron-LM's checkpointing skips (`optimizer is not None and not optimizer.is_stub_optimizer`)."""
        return all(getattr(opt, "is_stub_optimizer", False) for opt in compat.chained_optimizers(self.view.optimizer))

    def _model_sd(self) -> dict:
        metadata = self._metadata()
        return self.view.bare.sharded_state_dict(**({} if metadata is None else {"metadata": metadata}))

    def _sharded(self, loading_from: Path | None) -> dict:
        model_sd = self._model_sd()
        if self._torch_optimizer():
            present = None if loading_from is None else set(
                dist_checkpointing.load_tensors_metadata(str(loading_from)))
            optim_sd = _torch_optimizer_sharded(self.view.optimizer, model_sd, present)
        elif self._stub_optimizer():
            return {MODEL: model_sd}  # Megatron-LM saves no optimizer state for a stub (nothing to train)
        else:
            metadata = self._metadata()
            optim_sd = self.view.optimizer.sharded_state_dict(
                model_sd, is_loading=loading_from is not None, **({} if metadata is None else {"metadata": metadata}))
        return {MODEL: model_sd, OPTIMIZER: optim_sd}

    def save(self, directory: Path) -> None:
        problem = compat.torch_dist_writer_problem()
        if problem:
            raise RuntimeError(problem)
        sharded = self._sharded(None)
        refusal = _sharding_refusal(sharded)
        if refusal:
            raise CheckpointingException(refusal)
        compat.keep_write_results_in_process()
        dist_checkpointing.save(sharded, str(directory))
        torch.distributed.barrier()

    def saved(self, directory: Path) -> Saved:
        """The checkpoint's tensor keys (`load_tensors_metadata`: metadata only), by the full model's names.

        A key is a `ShardedTensor` key, which is not the param's name: layers are stacked (the leading dim is
        the global layer) and the local spec renames the layernorms after the TE layer that fuses them
        (`input_layernorm.weight` is saved as `self_attention.linear_qkv.layer_norm_weight`). The map back
        is read from every stage's own `sharded_state_dict()` (a collective)."""
        names, buckets = self._key_names(), self._bucket_names()
        metadata = dist_checkpointing.load_tensors_metadata(str(directory))
        params: set[str] = set()
        state: set[str] = set()
        for key, tensor in metadata.items():
            key = CHAINED.sub("", key)
            match, bucket = OPTIM_STATE.match(key), BUCKET_STATE.match(key)
            if match:
                if match.group(1) in MOMENTS:
                    state.update(_full_names(match.group(2), tensor, names))
            elif bucket:
                if bucket.group(2) in MOMENTS:
                    state.update(buckets.get(bucket.group(1), [f"<bucket {bucket.group(1)}>"]))
            elif not key.startswith("optimizer."):
                params.update(_full_names(key, tensor, names))
        return Saved(frozenset(params), frozenset(state))

    def _bucket_names(self) -> dict[str, list[str]]:
        """`dp_reshardable` saves the distributed optimizer's state per grad-buffer bucket
        (`optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<i>.dtype_<d>.bucket_idx_<b>.<state>`): the params
        each bucket's ranges hold, read from the optimizer's own `gbuf_ranges` on every rank (a collective)."""
        mine: dict[str, list[str]] = {}
        if self.layout.wrapper == "megatron-ddp-distopt":
            by_id = {id(p): self.view.names[local] for local, p in self.view.bare.named_parameters()}
            for opt in compat.chained_optimizers(self.view.optimizer):
                # A stub optimizer (nothing to train on this rank) has no grad buffers.
                for gbuf_idx, ranges in enumerate(getattr(opt, "gbuf_ranges", ())):
                    for dtype, buckets in ranges.items():
                        for bucket_idx, bucket in enumerate(buckets):
                            key = (f"optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}"
                                   f".gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}")
                            mine[key] = sorted(by_id[id(p)] for p in bucket["param_map"])
        united: dict[str, list[str]] = {}
        for every in all_gather_json(mine):
            for key, names in every.items():
                united.setdefault(key, []).extend(names)
        return united

    def _key_names(self) -> dict[str, str]:
        """`<sharded key>@<global layer or ->` -> the full model's param name, over every stage and shard."""
        mine = {}
        for local, sharded in self._model_sd().items():
            if local in self.view.names and isinstance(sharded, ShardedTensor):
                mine[_slot(sharded.key, sharded.global_offset[0] if STACKED.match(sharded.key) else None)] = \
                    self.view.names[local]
        return {slot: name for every in all_gather_json(mine) for slot, name in every.items()}

    def load(self, directory: Path, omit: str | None = None) -> None:
        request = self._sharded(directory)
        fresh = self._omit(request, omit) if omit is not None else None
        # Dropping one layer's shard of a stacked key leaves that key partly read: the access check would refuse.
        loaded = dist_checkpointing.load(request, str(directory), validate_access_integrity=omit is None)
        self.view.bare.load_state_dict(loaded[MODEL], strict=omit is None)
        if self._torch_optimizer():
            _torch_optimizer_load(self.view.optimizer, loaded[OPTIMIZER])
        elif OPTIMIZER in loaded:
            self.view.optimizer.load_state_dict(loaded[OPTIMIZER])
        if fresh is not None:
            # The distributed optimizer's load writes its saved main param (fp32_param / a bucket's `param`)
            # into its main shard, which for fp32 params is a view of the model param: put the fresh value back.
            with torch.no_grad():
                fresh[0].copy_(fresh[1])

    def _omit(self, request: dict, omit: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Leave `omit` (a full-model name) at its fresh value: its model shard is not loaded."""
        local = next((loc for loc, full in self.view.names.items() if full == omit), None)
        if local is None or local not in request[MODEL]:
            return None  # another pipeline stage owns it
        del request[MODEL][local]
        param = dict(self.view.bare.named_parameters())[local]
        return param, param.detach().clone()


def _sharding_refusal(sharded: dict) -> str:
    """The access check `dist_checkpointing.save` makes, made first with its answer shared by every rank.

    Save runs it on global rank 0 only (validation.py: `validate_sharding_integrity` returns at once elsewhere): a
    refusal there leaves the other ranks in the save's collectives (on a cluster, until the collective timeout). The
    same function on the same input, so the refusal is Megatron's; only its reaching every rank is ours."""
    refusal = ""
    try:
        validate_sharding_integrity(determine_global_metadata(compat.sharded_part(sharded))[1])
    except CheckpointingException as exc:
        refusal = str(exc)
    return next((r for r in all_gather_json(refusal) if r), "")


def _slot(key: str, layer: int | None) -> str:
    return f"{key}@{'-' if layer is None else layer}"


def _full_names(key: str, tensor: Any, names: dict[str, str]) -> list[str]:
    """A checkpoint key -> the full model's param names it holds (a stacked key: one per layer). A key no
    stage's model makes (none expected) keeps its own spelling, so it shows as what it is."""
    if STACKED.match(key):
        return [names.get(_slot(key, i), f"{key}[layer {i}]") for i in range(tensor.global_shape[0])]
    return [names.get(_slot(key, None), key)]
