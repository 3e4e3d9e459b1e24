"""Megatron-core API differences between the release lines the adapter runs on (0.8 to 0.16).

Each function hides one difference, found by feature detection (a keyword in a signature, an
attribute), so the adapter reads the same on every release. None changes what Megatron does
with frozen params: they only call the same Megatron function under its other spelling.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
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
