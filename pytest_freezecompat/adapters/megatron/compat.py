"""Megatron-core API differences between the release lines the adapter runs on (0.8 to 0.16).

Each function hides one difference, found by feature detection (a keyword in a signature, an
attribute), so the adapter reads the same on every release. None changes what Megatron does
with frozen params: they only call the same Megatron function under its other spelling.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import queue
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from packaging.version import Version
from torch import nn


def _accepts(func: Callable[..., Any], keyword: str) -> bool:
    return keyword in inspect.signature(func).parameters


def megatron_optimizer(config: OptimizerConfig, chunks: list[nn.Module]) -> Any:
    """`get_megatron_optimizer` with weight decay on every param (biases and norms too), as the reference.

    0.16 spells it `config_overrides={}` (no per-param overrides); before `config_overrides`
    existed (<= 0.15), `no_weight_decay_cond=None` meant "no decay on biases and 1-D params",
    so the same intent is a condition that is never true.
    """
    if _accepts(get_megatron_optimizer, "config_overrides"):
        return get_megatron_optimizer(config, chunks, config_overrides={})
    return get_megatron_optimizer(config, chunks, no_weight_decay_cond=lambda name, param: False)


def grad_norm_fp32(grads: list[torch.Tensor], group: Any) -> float:
    """`get_grad_norm_fp32` over `group`: the keyword was `model_parallel_group` before 0.10."""
    keyword = "grad_stats_parallel_group" if _accepts(get_grad_norm_fp32, "grad_stats_parallel_group") \
        else "model_parallel_group"
    return get_grad_norm_fp32(grads, **{keyword: group})


def chained_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers inside what `get_megatron_optimizer` returned.

    Before 0.12 it returns the one optimizer itself when there is only one (no MoE params);
    from 0.12 the dense path always returns a `ChainedOptimizer`.
    """
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def torch_dist_writer_problem() -> str | None:
    """Why `dist_checkpointing.save` with the default torch_dist strategy would hang here, or None.

    From 0.9 psutil is optional at import (`HAVE_PSUTIL`), but the forked writer process still calls
    `_process_memory()`, which raises without psutil *before* its try block, so it never marks its task
    done and the saving rank waits forever on `count_queue.join()` (0.16.1: filesystem_async.py:366, :642,
    :308). psutil is not a declared dependency of megatron-core. Raised instead of hanging. (0.8 imports
    psutil at module level and refuses on its own: "Cannot import a default strategy".)
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:  # 0.8 without psutil: dist_checkpointing.save raises its own CheckpointingException
        return None
    if getattr(filesystem_async, "HAVE_PSUTIL", True):
        return None
    return ("megatron-core's torch_dist writer needs psutil, which is not installed (not a declared dependency "
            "of megatron-core): its forked writer raises in _process_memory() before marking its task done and "
            "dist_checkpointing.save then waits forever on count_queue.join() (strategies/filesystem_async.py); "
            "refused before the save instead of hanging")


def keep_write_results_in_process() -> None:
    """Let a synchronous save hand its writers' results to itself through a plain queue.

    The torch_dist writer puts them into `_get_write_results_queue()` (strategies/filesystem_async.py), a
    `multiprocessing` Manager queue started with *spawn*: its first put makes a new interpreter import torch to
    unpickle the `WriteResult`s, ~2 s in every fresh rank (Megatron-LM pays it once per training run). A
    synchronous save (the only kind here) puts and gets them in the rank's own process (`execute_sync`, then
    `retrieve_write_results`), so a `queue.Queue` carries the same results; the writer processes, the files and
    what is saved are Megatron's. Releases without that queue (0.8) are left alone.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if hasattr(filesystem_async, "_get_write_results_queue") and filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def sharded_state_dict_metadata(optimizer: Any) -> dict[str, Any] | None:
    """The `metadata` Megatron-LM's `training/checkpointing.py` passes to `sharded_state_dict` on releases
    after 0.13.1 (`_build_sharded_state_dict_metadata`), or None where the optimizers take no `metadata`
    (0.8: the release's defaults are what Megatron-LM of its time used).

    It matters for the distributed optimizer: 0.16's default sharding (`fully_sharded_model_space`,
    deprecated) makes `flattened_range` ShardedTensors that its own `validate_metadata_integrity` refuses
    ("ShardedTensor.flattened_range is not supported."); Megatron-LM asks for `dp_reshardable`.
    """
    inner = chained_optimizers(optimizer)[0]
    if not _accepts(type(inner).sharded_state_dict, "metadata"):
        return None
    from megatron.core import parallel_state as ps

    return {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def sharded_part(sharded_state_dict: dict) -> dict:
    """What `dist_checkpointing.save` checks the access pattern of: factories applied, non-persistent and common
    items taken out. From 0.9 `state_dict_utils.save_preprocess` does it (its check turned off here); 0.8 inlines
    the same three steps in `save`. Applying factories changes the dict in place, as save itself does."""
    try:
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    except ImportError:  # 0.8
        from megatron.core.dist_checkpointing.mapping import apply_factories
        from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base

        apply_factories(sharded_state_dict)
        return extract_sharded_base(extract_nonpersistent(sharded_state_dict)[1])[0]
    return save_preprocess(sharded_state_dict, validate_access_integrity=False)[0]


#: The first release whose dist_checkpointing saves on the torch the environments pin (2.13.0, the fast CPU build):
#: 0.8's torch_dist save planner has several ranks write the same non-shard items, which torch 2.13's DCP planner
#: refuses on every save ("item.index.fqn not in md", default_planner.py). 0.8's own torch (2.3/2.4) is a CUDA build
#: this workplace does not install for it, so the round trip cannot say anything about 0.8 here.
ROUND_TRIP_FROM = Version("0.9")


def round_trip_problem() -> str | None:
    """Why the model-checkpoint round trip is not run on this release, or None where it is."""
    release = Version(importlib.metadata.version("megatron-core"))
    if release >= ROUND_TRIP_FROM:
        return None
    return (f"resume not checked: megatron-core {release}'s dist_checkpointing save does not run on torch "
            f"{torch.__version__.split('+')[0]} (its save planner and torch's DCP planner disagree on every save); "
            f"the round trip runs from {ROUND_TRIP_FROM}")
