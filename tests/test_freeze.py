import pytest

from pytest_freezecompat import models
from pytest_freezecompat.adapters.base import apply_freeze
from pytest_freezecompat.core import freeze
from pytest_freezecompat.spec import matrix as spec

PATTERNS = spec.load().patterns
GROUPS = spec.load().models["tiny-gpt"]


def plan_for(pattern_id: str) -> freeze.FreezePlan:
    pattern = PATTERNS[pattern_id]
    model = models.build("tiny-gpt", seed=0, lora="lora" in pattern.features, vision="vision" in pattern.features)
    return freeze.resolve(pattern, GROUPS, [n for n, _ in model.named_parameters()])


def test_embedding_pattern_freezes_only_embeddings():
    plan = plan_for("embedding")
    assert plan.frozen == {"tok_emb.weight", "pos_emb.weight"}
    assert plan.optimized == plan.trainable


def test_all_but_last_trains_only_the_last_block():
    plan = plan_for("all-but-last")
    assert plan.trainable and all(n.startswith("blocks.2.") for n in plan.trainable)


def test_lora_trains_only_adapters():
    plan = plan_for("lora")
    assert plan.trainable == {n for n in plan.names if "lora_" in n}
    assert len(plan.trainable) == 3 * 2 * 2  # 3 blocks x (qkv, proj) x (a, b)


def test_unused_branch_trains_everything_but_expects_no_grad_on_the_branch():
    plan = plan_for("unused-branch")
    assert plan.trainable == set(plan.names)
    assert plan.unused == {n for n in plan.names if n.startswith("vision.")}
    assert not plan.expect_grad & plan.unused


def test_optimizer_subset_keeps_grads_but_optimizes_a_subset():
    plan = plan_for("optimizer-subset")
    assert plan.trainable == set(plan.names)
    assert plan.optimized == {n for n in plan.names if n.startswith(("blocks.2.", "head."))}


def test_all_freezes_everything():
    plan = plan_for("all")
    assert not plan.trainable and not plan.optimized


def test_apply_sets_requires_grad_on_the_bare_model():
    model = models.build("tiny-gpt", seed=0)
    plan = freeze.resolve(PATTERNS["decoder"], GROUPS, [n for n, _ in model.named_parameters()])
    apply_freeze(plan, model)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == plan.frozen


def test_a_glob_that_matches_nothing_is_an_error():
    pattern = freeze.FreezePattern("x", frozen=("ghost",))
    with pytest.raises(freeze.PatternError, match=r"glob 'nothing\.\*' of group 'ghost' matches no parameter"):
        freeze.resolve(pattern, {"ghost": ("nothing.*",)}, ["a.weight"])


def test_deterministic_init_is_the_same_on_meta_and_eager():
    eager = models.build("tiny-gpt", seed=3)
    meta = models.build("tiny-gpt", seed=3, device="meta")
    meta.to_empty(device="cpu")
    models.init_weights(meta, 3)
    for (name, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters()):
        assert (a == b).all(), name
