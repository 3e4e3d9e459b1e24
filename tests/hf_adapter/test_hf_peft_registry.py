"""The registry ties the Trainer's FSDP checkpoint plugins, the peft patterns and the staged unfreeze, by release.

Pure, as test_hf_known_issues: cells written as the report writes them (the messages the matrix runs gave), matched
against `matrix/known_issues.toml` with each release's environment.
"""

from __future__ import annotations

import pytest
from test_hf_known_issues import NEW, OLD, UNIFORM, cell, tied

from pytest_freezecompat.spec import known_issues

LORA = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
NOT_RESTORED = f"after load, values differ from what was saved: {LORA} (max abs diff 1.02e-02)"
PR_4206 = "accelerate-fsdp2-peft-full-state-dict-adapter-only-rank0-shard"
NOT_SAVED = f"not in the saved files: {LORA} and 7 more; {NOT_RESTORED}"


@pytest.fixture(scope="module")
def registry() -> known_issues.Registry:
    return known_issues.load()


def resume_failure(plugin: str, message: str, kinds: list[str], model: str = "tiny-llama-lora",
                   freeze: str = "lora") -> dict:
    return cell(plugin, freeze, "fail", message, model=model, check="resume",
                failures=[{"check": "resume", "message": message, "params": [LORA], "kinds": kinds,
                           "params_kind": "trained"}])


def test_pr_4206_is_a_resume_failure_before_1_15_and_a_pass_from_it(registry):
    """The cross-release case: the Trainer's FSDP2 full save of a PeftModel (adapter_only=True)."""
    failing = resume_failure("trainer-fsdp2-full-state-dict", NOT_RESTORED, ["loaded-differs"])
    assert tied(known_issues.match(failing, OLD, registry)) == PR_4206
    entry = next(e for e in registry.entries if e.id == PR_4206)
    assert dict(entry.fixed_in) == {"hf": "1.15.0"}
    passing = cell("trainer-fsdp2-full-state-dict", "lora", "pass", "", model="tiny-llama-lora")
    assert known_issues.match(passing, NEW, registry) is None
    # tiny-gpt's own LoRA is no PeftModel: its full save is whole, the entry does not select it
    assert known_issues.match(cell("trainer-fsdp2-full-state-dict", "lora", "pass", ""), OLD, registry) is None


def test_trainer_fsdp1_empty_adapter_is_the_peft_finding_on_0_21_only(registry):
    failing = resume_failure("trainer-fsdp1", NOT_SAVED, ["not-saved", "loaded-differs"])
    assert tied(known_issues.match(failing, NEW, registry)) == "peft-fsdp1-nested-units-adapter-state-dict-empty"
    assert not tied(known_issues.match(failing, OLD, registry))  # peft 0.17.1 saves the adapter


def test_bias_all_under_peft_wrap_policy_is_our_finding(registry):
    refused = cell("accelerate-fsdp1", "lora-bias-all", "error", UNIFORM, model="tiny-llama-lora-bias-all",
                   raised_in="wrapping")
    for environment in (NEW, OLD):
        assert tied(known_issues.match(refused, environment, registry)) == (
            "peft-fsdp-auto-wrap-policy-bias-all-mixed-flat-param")


@pytest.mark.parametrize("plugin", ["accelerate-ddp", "trainer-ddp", "trainer-fsdp2"])
def test_a_block_unfrozen_after_the_optimizer_is_the_optimizers_rule(registry, plugin):
    message = "step 0: update differs from reference: blocks.2.fc1.bias, blocks.2.fc1.weight"
    failing = cell(plugin, "last-block-after-optimizer", "fail", message, check="update",
                   failures=[{"check": "update", "message": message, "kinds": ["update-differs"],
                              "params": ["blocks.2.fc1.bias", "blocks.2.fc1.weight"], "params_kind": "trained"}])
    assert tied(known_issues.match(failing, NEW, registry)) == "optimizer-built-before-unfreeze"
