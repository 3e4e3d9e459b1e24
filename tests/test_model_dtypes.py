"""A model's own dtypes (a frozen bf16 base, fp32 adapters): stated on the row, no stack mismatch under an fp32 cell,
judged against the model as held with the room its dtypes measure; a frozen bf16 param still must not move."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from own_project import TOKEN_DATA
from test_observed_stack import cell, record

from pytest_freezecompat.adapters.base import dtypes_of
from pytest_freezecompat.core import dtypes
from pytest_freezecompat.core.records import PlanFacts, RankRecord, StepFacts
from pytest_freezecompat.verdict import checks, stack

HELD = {"base.weight": "bf16", "lora.weight": "fp32"}


def test_the_dtypes_a_model_holds_are_named_per_param_and_summed_up_by_what_trains():
    model = torch.nn.ModuleDict({"base": torch.nn.Linear(2, 2, dtype=torch.bfloat16), "lora": torch.nn.Linear(2, 2)})
    held = dtypes_of(model.named_parameters())
    assert held == {"base.weight": "bf16", "base.bias": "bf16", "lora.weight": "fp32", "lora.bias": "fp32"}
    assert dtypes.precision(held) == "bf16+fp32" and dtypes.own_low_precision(held)
    assert dtypes.summary(held, ["lora.weight", "lora.bias"]) == "bf16 frozen, fp32 trained"
    assert dtypes.summary(held, held) == "bf16+fp32 trained"
    assert not dtypes.own_low_precision({"w": "fp32"}) and dtypes.precision({}) == "fp32"


def held_record(rank: int, precision: str) -> RankRecord:
    return dataclasses.replace(record(rank, wrapper="Engine", zero_stage="2", precision=precision), dtypes=dict(HELD))


def test_an_fp32_cell_runs_a_model_as_held_and_a_cast_is_a_note_not_another_stack():
    held = [held_record(r, "bf16+fp32") for r in (0, 1)]
    assert stack.mismatch(cell(), held) is None and stack.casts(cell(), held) is None
    upcast = [held_record(r, "fp32") for r in (0, 1)]
    assert stack.mismatch(cell(), upcast) is None
    assert stack.casts(cell(), upcast).startswith("the stack holds the model's params as fp32; the model held "
                                                  "bf16+fp32")


def test_a_low_precision_config_still_promises_its_precision_whatever_the_model_holds():
    ranks = [held_record(r, "bf16+fp32") for r in (0, 1)]
    assert "precision is bf16+fp32 on rank 0, the cell's name promises bf16" in stack.mismatch(cell(precision="bf16"),
                                                                                               ranks)


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_a_param_stored_in_bf16_gets_at_least_its_storage_rounding_as_room():
    ref = StepFacts({"base.weight": arr(0.1), "lora.weight": arr(0.1)}, 1.0, None,
                    {"base.weight": arr(4.0), "lora.weight": arr(4.0)})
    room = checks.measured_room(ref, ref, HELD)
    assert room.param("base.weight") == pytest.approx(checks.SPREAD_FACTOR * 2.0 ** -7 * 4.0)
    assert room.param("lora.weight") == 0.0


def own_dtypes_record(frozen_base_after: float) -> RankRecord:
    """The bf16 base frozen, the fp32 adapter trained; the upcast reference's adapter grad is 1% off (the spread)."""
    initial = {"base.weight": arr(1.0), "lora.weight": arr(0.5)}
    grads = {"base.weight": None, "lora.weight": arr(0.2)}
    params = {"base.weight": arr(frozen_base_after), "lora.weight": arr(0.49)}
    reference = [StepFacts(dict(grads), 0.2, None, {"base.weight": arr(1.0), "lora.weight": arr(0.49)})]
    return RankRecord(
        rank=0, requires_grad={"base.weight": False, "lora.weight": True}, tracked=("lora.weight",),
        plan=PlanFacts(tuple(HELD), ("lora.weight",), ("lora.weight",), ()), initial=initial, dtypes=dict(HELD),
        steps=[StepFacts({"base.weight": None, "lora.weight": arr(0.2015)}, 0.2015, "returned", params)],
        reference=reference,
        reference_mixed=[StepFacts({"base.weight": None, "lora.weight": arr(0.202)}, 0.202, None, reference[0].params)])


def test_an_fp32_cell_of_a_bf16_model_is_judged_in_the_models_dtypes_with_their_measured_room():
    verdict = checks.judge_records([own_dtypes_record(1.0)], "fp32")
    assert verdict.status == "pass"
    assert verdict.tolerance["precision"] == "bf16+fp32" and verdict.tolerance["widest_relative_grad_spread"] == 0.01


def test_a_frozen_bf16_param_still_must_stay_bit_identical():
    verdict = checks.judge_records([own_dtypes_record(1.0078125)], "fp32")  # one bf16 ulp: within its room
    assert (verdict.status, verdict.check) == ("fail", "update")
    assert verdict.failures[0].params == ("base.weight",)


MODEL = '''
import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Lora(nn.Module):
    """A bf16 base and an fp32 adapter, computed as PEFT's lora.Linear does."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(8, 8, dtype=torch.bfloat16)
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x.float())).to(x.dtype)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8, dtype=torch.bfloat16)
        self.body = Lora()
        self.head = nn.Linear(8, 32, dtype=torch.bfloat16)

    def forward(self, tokens):
        return self.head(torch.relu(self.body(self.embed(tokens)))).float()

''' + TOKEN_DATA + '''


@freeze_case(batch=batch, loss=loss, patterns={"lora": {"trainable": ["body.lora_*"]}}, checkpoint=["none"],
             blocks=["Lora"], plugins=["ddp", "fsdp2"], init=["eager"])
def bf16_base():
    return Net()
'''


def test_a_bf16_base_with_fp32_adapters_is_judged_under_ddp_and_fsdp2(pytester, run_user):
    pytester.makepyfile(test_mine=MODEL)
    result, report = run_user("--freeze-matrix-select=freeze=lora")
    result.assert_outcomes(passed=2)
    assert {(c["plugin"], c["status"]) for c in report["cells"]} == {("ddp", "pass"), ("fsdp2", "pass")}
    for row in report["cells"]:
        assert row["observed"]["model_dtypes"] == "bf16 frozen, fp32 trained"
        assert row["tolerance"]["precision"] == "bf16+fp32" and row["tolerance"]["spread_factor"] == 2.0
