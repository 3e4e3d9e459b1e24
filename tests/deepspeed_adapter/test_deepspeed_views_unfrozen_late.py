"""A ZeRO-3 param unfrozen after the engine was built has no place in the optimizer's partitions: the view reads no
grad for it (DeepSpeed's `safe_get_full_grad` would raise a KeyError looking it up), and reads every other as before."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import torch

from pytest_freezecompat.adapters.deepspeed_views import _outside_zero3_partitions


class _Optimizer:
    """ZeRO-3's optimizer as the check reads it: param ids with a place in `grad_position`."""

    def __init__(self, placed: set[int]) -> None:
        self.grad_position = {i: [0, 0, 1] for i in placed}

    def get_param_id(self, param: torch.nn.Parameter) -> int:
        return param.ds_id

def _param(ds_id: int, requires_grad: bool, optimizer: _Optimizer) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(2), requires_grad=requires_grad)
    param.ds_id, param._z3_optimizer = ds_id, optimizer
    return param

def test_only_a_trainable_zero3_param_without_a_partition_place_is_outside():
    optimizer = _Optimizer(placed={1})
    assert _outside_zero3_partitions(_param(2, True, optimizer))  # unfrozen after the engine was built
    assert not _outside_zero3_partitions(_param(1, True, optimizer))  # trained from the start
    assert not _outside_zero3_partitions(_param(2, False, optimizer))  # frozen: DeepSpeed returns None itself
    assert not _outside_zero3_partitions(torch.nn.Parameter(torch.zeros(2)))  # not a ZeRO-3 param
    with_grad = _param(2, True, optimizer)
    with_grad.grad = torch.ones(2)
    assert not _outside_zero3_partitions(with_grad)  # a grad DeepSpeed left on the param is read as it is
