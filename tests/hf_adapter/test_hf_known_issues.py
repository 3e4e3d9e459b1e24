"""The shipped registry ties the Hugging Face row's red cells to the entry that explains them, by release.

Pure: cells written as the report writes them, matched against `matrix/known_issues.toml` with each release's
environment (the `hf` framework's version is accelerate's). The matrix runs (`nox -s matrix-hf`, `matrix-hf-1.10`)
are the evidence; this pins the selectors, so an edit that unties a row's cells, or ties them to another entry,
shows here without a run.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_freezecompat.spec import known_issues

NEW = {"python": "3.11.7", "torch": "2.13.0+cpu", "frameworks": {"hf": "1.15.0"}, "device": "cpu"}
OLD = {"python": "3.11.7", "torch": "2.9.0", "frameworks": {"hf": "1.10.1"}, "device": "cpu"}
RESUMED = "resumed step 1: update differs from the uninterrupted run: blocks.0.fc1.bias (max abs diff 1.2e-03)"
UNIFORM = "ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
NO_INPUT_GRAD = "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn"


def cell(plugin: str, freeze: str, status: str, message: str, model: str = "tiny-gpt", checkpoint: str = "none",
         **extra: Any) -> dict[str, Any]:
    """An error's message is the stack's own `Type: message`, which the row also records as `error`."""
    if status == "error":
        kind, said = message.split(": ", 1)
        extra.setdefault("error", {"type": kind, "message": said})
    return {"id": f"{model}/hf/{plugin}/eager/{checkpoint}/{freeze}", "model": model, "framework": "hf",
            "plugin": plugin, "init": "eager", "checkpoint": checkpoint, "freeze": freeze, "clip": "clip",
            "environment": "hf", "status": status, "message": message, "rank_details": [], "world_size": 2, **extra}


def resumed(plugin: str, freeze: str = "none", **extra: Any) -> dict[str, Any]:
    return cell(plugin, freeze, "fail", RESUMED, check="resume",
                failures=[{"check": "resume", "message": RESUMED, "params": ["blocks.0.fc1.bias"],
                           "kinds": ["resumed-update"], "params_kind": "trained"}], **extra)


@pytest.fixture(scope="module")
def registry() -> known_issues.Registry:
    return known_issues.load()


def tied(found: dict[str, Any] | None) -> str | None:
    return found["id"] if found and found.get("expected") else None


@pytest.mark.parametrize("plugin", ["accelerate-fsdp1", "accelerate-fsdp1-orig-params"])
@pytest.mark.parametrize("environment", [NEW, OLD], ids=["1.15.0", "1.10.1"])
def test_fsdp1_sharded_resume_is_the_finding_on_both_releases(registry, plugin, environment):
    """The nothing-frozen control too: the sharded optimizer load is not freeze-specific."""
    assert tied(known_issues.match(resumed(plugin), environment, registry)) == (
        "accelerate-fsdp-sharded-optimizer-load-restores-no-moments")


def test_fsdp2_sharded_resume_is_pr_3904s_range_and_a_pass_on_the_fixed_release(registry):
    assert tied(known_issues.match(resumed("accelerate-fsdp2"), OLD, registry)) == (
        "accelerate-fsdp2-sharded-optimizer-load-fresh-template")
    on_new = known_issues.match(resumed("accelerate-fsdp2"), NEW, registry)  # red on 1.15.0: the range is wrong
    assert on_new is not None and on_new["range_too_narrow"] and not on_new.get("expected")
    passing = cell("accelerate-fsdp2", "none", "pass", "")
    assert known_issues.match(passing, NEW, registry) is None  # outside the range: no `fixed?`
    assert known_issues.match(passing, OLD, registry)["fixed"]  # inside it: the entry expected a failure


def test_the_full_state_dict_twins_are_no_resume_entrys_cells(registry):
    found = known_issues.match(resumed("accelerate-fsdp1-full-state-dict"), NEW, registry)
    assert tied(found) is None


def test_torch_entries_select_the_accelerate_plugins_that_pass_their_wrappers_through(registry):
    refused = cell("accelerate-fsdp1", "embedding", "error", UNIFORM, raised_in="wrapping")
    assert tied(known_issues.match(refused, NEW, registry)) == "torch-fsdp1-uniform-requires-grad"
    unused = cell("accelerate-ddp", "unused-branch", "error", "RuntimeError: Expected to have finished reduction in "
                  "the prior iteration before starting a new one", raised_in="training")
    assert tied(known_issues.match(unused, NEW, registry)) == "torch-ddp-unused-parameters"
    reentrant = cell("accelerate-fsdp1-orig-params", "all-but-last", "error", NO_INPUT_GRAD, checkpoint="reentrant",
                     raised_in="training")
    assert tied(known_issues.match(reentrant, OLD, registry)) == "torch-reentrant-checkpoint-frozen-inputs-fsdp1"


def test_a_tiny_llama_reentrant_cell_is_transformers_4s_on_the_old_release_only(registry):
    """A user model's cell: its stack selects the torch entries too, the entry that names its model comes first."""
    llama = cell("accelerate-ddp", "last-layer", "error", NO_INPUT_GRAD, model="tiny-llama", checkpoint="reentrant",
                 raised_in="training", user_model=True)
    transformers_4 = "transformers-reentrant-checkpoint-input-grads-peft-flag-only"
    assert tied(known_issues.match(llama, OLD, registry)) == transformers_4
    assert tied(known_issues.match(llama, NEW, registry)) != transformers_4


def test_the_trainer_rows_reds_are_tied_to_the_trainers_own_defaults(registry):
    """Its DDP finds unused params for a model that is not a PreTrainedModel; its FSDP2 checkpoints load through
    Accelerate's sharded optimizer load (PR #3904's range on 1.10.1)."""
    twice = cell("trainer-ddp", "none", "error", "RuntimeError: Expected to mark a variable ready only once. This "
                 "error is caused by one of the following reasons", checkpoint="reentrant", raised_in="training")
    assert tied(known_issues.match(twice, NEW, registry)) == "transformers-trainer-ddp-find-unused-reentrant-checkpoint"
    assert tied(known_issues.match(resumed("trainer-fsdp2"), OLD, registry)) == (
        "accelerate-fsdp2-sharded-optimizer-load-fresh-template")


def test_the_trainer_plugins_are_declared_and_driven_alike():
    from pytest_freezecompat.adapters.hf import TRAINER_PLUGINS, ZERO_PLUGINS, trainer_loop

    zero = {plugin for plugin in ZERO_PLUGINS if plugin.startswith("trainer-")}
    assert set(TRAINER_PLUGINS) | zero == set(trainer_loop.TRAINER_PLUGINS)
