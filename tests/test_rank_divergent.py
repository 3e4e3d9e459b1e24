"""Branches only some ranks use (issue #67): the tiny GPT's experts, the batches that route each rank's rows to one
expert, the reference that judges them, and real FSDP2 cells of the built-in matrix (silent, named by the registry)
beside the dense recipe that trains right."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from slices import WORLD_SIZE, matrix_cell

from pytest_freezecompat import models
from pytest_freezecompat.adapters.base import rows_of
from pytest_freezecompat.core.freeze import resolve
from pytest_freezecompat.rank import reference, scenario

ROOT = Path(__file__).parent.parent
EXPERTS = ("experts.0", "experts.1")


def expert_grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    model.zero_grad(set_to_none=True)
    reference.tiny_loss(model, batch).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if n.startswith(EXPERTS)}


@pytest.mark.parametrize("features", [("experts",), ("experts-unequal",)])
def test_each_ranks_rows_reach_one_expert_and_leave_the_other_out_of_its_graph(features: tuple[str, ...]) -> None:
    model = models.build("tiny-gpt", seed=3, features=features)
    batch = models.make_batches("tiny-gpt", seed=3, steps=1, global_batch=2 * WORLD_SIZE, features=features)[0]
    for rank, expert in enumerate(EXPERTS):
        grads = expert_grads(model, rows_of(batch, rank, WORLD_SIZE))
        assert {n for n, g in grads.items() if g is not None} == {n for n in grads if n.startswith(expert)}


def test_the_dense_recipe_keeps_every_expert_in_each_ranks_graph() -> None:
    model = models.build("tiny-gpt", seed=3, features=("experts", "dense"))
    batch = models.make_batches("tiny-gpt", seed=3, steps=1, global_batch=4, features=("experts", "dense"))[0]
    for rank, expert in enumerate(EXPERTS):
        grads = expert_grads(model, rows_of(batch, rank, WORLD_SIZE))
        assert all(g is not None for g in grads.values())
        assert all((g.abs().sum() > 0) == n.startswith(expert) for n, g in grads.items() if g is not None)


def test_the_unequal_experts_differ_in_shape_and_an_unknown_feature_is_refused() -> None:
    shapes = {n: p.shape for n, p in models.build("tiny-gpt", seed=0, features=("experts-unequal",)).named_parameters()}
    assert shapes["experts.0.up.weight"] != shapes["experts.1.up.weight"]
    with pytest.raises(ValueError, match="unknown model feature"):
        models.build("tiny-gpt", seed=0, features=("moe",))


def test_the_references_expert_grads_are_the_average_of_each_ranks() -> None:
    """Equal rows per rank: the whole batch's mean loss is the ranks' means averaged, so the single-process reference
    is what a correct data-parallel run computes, the expert a rank never reached included."""
    cell = matrix_cell("torch", plugin="ddp-find-unused", init="eager", checkpoint="none", clip="clip",
                       freeze="rank-divergent")
    model = models.build(cell.key.model, seed=cell.hyper.seed, features=cell.pattern.features)
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    plan = resolve(cell.pattern, cell.groups, list(initial))
    batches, loss = scenario._data(cell)
    [step, *_] = reference.run(cell, plan, initial, batches, scenario._construct(cell, "cpu", initialize=False), loss)
    per_rank = [expert_grads(model, rows_of(batches[0], rank, WORLD_SIZE)) for rank in range(WORLD_SIZE)]
    for name in per_rank[0]:
        summed = sum(torch.zeros_like(initial[name]) if g[name] is None else g[name] for g in per_rank)
        torch.testing.assert_close(step.grads[name], summed / WORLD_SIZE)


def cells_by_plugin(report: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(cell["plugin"], cell["freeze"]): cell for cell in report["cells"]}


def test_fsdp2_mixes_the_experts_grads_silently_and_the_dense_recipe_trains_right(run_matrix, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    _, report = run_matrix("--freeze-matrix-builtin", "--freeze-matrix-select=framework=torch,plugin=fsdp2,"
                           "plugin=fsdp2-reduce-unused,init=eager,checkpoint=none,clip=clip,freeze=rank-divergent,"
                           "freeze=rank-divergent-dense")
    cells = cells_by_plugin(report)
    mixed = cells[("fsdp2", "rank-divergent")]
    assert (mixed["status"], mixed["severity"], mixed["check"]) == ("fail", "silent", "grads")
    assert mixed["known_issue"]["id"] == "torch-fsdp2-rank-divergent-grads-mixed"
    assert any("rank-divergent: in one step some ranks' rows reach" in note for note in mixed["notes"])
    assert cells[("fsdp2", "rank-divergent-dense")]["status"] == "pass"
    # FSDP2's own opt-in (zero grads for what a rank did not reach) trains the very cell right
    assert (cells[("fsdp2-reduce-unused", "rank-divergent")]["status"],
            cells[("fsdp2-reduce-unused", "rank-divergent")]["severity"]) == ("pass", "ok")


def test_the_params_only_some_ranks_rows_reach_are_found_from_the_model_itself():
    """What names a user's MoE on its row: each rank's rows alone, which params get a grad on some ranks only."""
    features = ("experts",)
    model = models.build("tiny-gpt", seed=0, features=features)
    batches = models.make_batches("tiny-gpt", seed=0, steps=2, global_batch=4, features=features)
    divergent = reference.rank_divergent(model, reference.tiny_loss, batches, world_size=2)
    assert divergent == sorted(f"experts.{e}.{layer}.{kind}" for e in (0, 1) for layer in ("up", "down")
                               for kind in ("weight", "bias"))
    dense = models.build("tiny-gpt", seed=0, features=(*features, "dense"))
    assert reference.rank_divergent(dense, reference.tiny_loss, batches, world_size=2) == []
