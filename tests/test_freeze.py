import pytest
import torch

from pytest_freezecompat import models
from pytest_freezecompat.adapters.base import apply_freeze, keep_rows
from pytest_freezecompat.core import freeze
from pytest_freezecompat.spec import matrix as spec

PATTERNS = spec.load().patterns
GROUPS = spec.load().models["tiny-gpt"]


def plan_for(pattern_id: str) -> freeze.FreezePlan:
    pattern = PATTERNS[pattern_id]
    model = models.build("tiny-gpt", seed=0, features=pattern.features)
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


def test_embedding_rows_trains_the_token_embedding_with_its_rows_masked():
    plan = plan_for("embedding-rows")
    assert plan.trainable == {"tok_emb.weight"} and plan.rows == {"tok_emb.weight": (-16, None)}
    model = models.build("tiny-gpt", seed=0)
    apply_freeze(plan, model)
    tokens = torch.arange(64).reshape(8, 8)
    models.loss_fn(model(tokens), tokens.roll(1, dims=1)).backward()
    grad = model.tok_emb.weight.grad
    assert torch.count_nonzero(grad[:-16]) == 0 and torch.count_nonzero(grad[-16:]) > 0
    assert model.head.weight.grad is None


@pytest.mark.parametrize(("text", "bounds"), [("-16:", (-16, None)), ("0:8", (0, 8)), (":8", (None, 8)),
                                              (" 2 : -2 ", (2, -2))])
def test_rows_are_a_slice_of_the_first_dimension(text, bounds):
    assert freeze.parse_rows(text) == bounds
    grad = torch.arange(1.0, 11.0)
    kept = keep_rows(bounds, grad)
    inside = torch.zeros(10, dtype=torch.bool)
    inside[slice(*bounds)] = True
    assert torch.equal(kept[inside], grad[inside]) and not kept[~inside].any()
    assert torch.equal(grad, torch.arange(1.0, 11.0))  # a hook must leave its input alone


@pytest.mark.parametrize("text", [":", "4", "a:b", "1:2:3", ""])
def test_a_malformed_row_range_is_an_error(text):
    with pytest.raises(freeze.PatternError, match="is not a row range"):
        freeze.parse_rows(text)


def test_rows_of_a_frozen_param_are_an_error():
    pattern = freeze.FreezePattern("x", trainable=(), rows={"w": "0:2"})
    with pytest.raises(freeze.PatternError, match=r"rows of group 'w' train in a\.weight, which the pattern freezes"):
        freeze.resolve(pattern, {"w": ("a.*",)}, ["a.weight"])


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
