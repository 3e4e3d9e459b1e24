"""Quantized weights (a QLoRA base): what no optimizer can step stays frozen in the control, is left out of the
precision a model computes in, and a NaN its packed bytes hold is no change. The declared cases are read through
their module: a name imported here would run as matrix cells."""

import numpy as np
import quantized_models
import torch
from torch import nn

from pytest_freezecompat.adapters.base import precision_of
from pytest_freezecompat.core.freeze import is_quantized
from pytest_freezecompat.user import CASE_ATTRIBUTE, CONTROL, build_case
from pytest_freezecompat.verdict.checks import unchanged


def test_what_is_quantized() -> None:
    assert is_quantized(quantized_models.Packed().packed) and is_quantized(quantized_models.StoredAsFloat().weight)
    assert not is_quantized(nn.Linear(2, 2).weight)


def test_the_control_leaves_quantized_weights_frozen_and_says_so() -> None:
    case = build_case(getattr(quantized_models.packed, CASE_ATTRIBUTE))
    control = case.patterns[CONTROL]
    assert [case.groups[group] for group in control.frozen] == [("packed",)]
    assert "quantized" in control.description


def test_a_model_without_quantized_weights_keeps_the_plain_control() -> None:
    assert build_case(getattr(quantized_models.plain, CASE_ATTRIBUTE)).patterns[CONTROL].frozen == ()


def test_precision_leaves_packed_weights_out() -> None:
    assert precision_of(quantized_models.Packed()) == "fp32"
    assert precision_of(quantized_models.StoredAsFloat()) == "fp32"
    assert precision_of(nn.Linear(2, 2).to(torch.bfloat16)) == "bf16"


def test_a_nan_in_the_same_place_is_unchanged_and_nowhere_else() -> None:
    before = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    assert unchanged(before.copy(), before)
    assert not unchanged(np.array([1.0, 2.0, 3.0], dtype=np.float32), before)
    assert not unchanged(np.array([np.nan, np.nan, 3.0], dtype=np.float32), before)
