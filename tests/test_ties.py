"""Tied and shared params: found at setup, named where a pattern trips on them."""

import pytest
from torch import nn

from pytest_freezecompat.core import freeze, ties


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.tok_emb.weight


def test_ties_of_names_each_alias_with_its_tensors_first_name():
    model = TiedLM()
    assert ties.ties_of(model.named_parameters(remove_duplicate=False)) == {"head.weight": "tok_emb.weight"}
    assert ties.ties_of(nn.Linear(2, 2).named_parameters(remove_duplicate=False)) == {}


def test_a_shared_module_ties_every_param_it_holds():
    shared = nn.Linear(2, 2)
    model = nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared)])
    assert ties.ties_of(model.named_parameters(remove_duplicate=False)) == {"1.0.weight": "0.0.weight",
                                                                            "1.0.bias": "0.0.bias"}


def test_a_glob_that_names_only_an_alias_says_which_name_to_use():
    model = TiedLM()
    names = [n for n, _ in model.named_parameters()]
    tied = ties.ties_of(model.named_parameters(remove_duplicate=False))
    with pytest.raises(freeze.PatternError, match=r"^freeze pattern 'p': glob 'head\.\*' of group 'g' matches no "
                       r"parameter: head\.weight is tied to tok_emb\.weight \(one tensor, listed under its first "
                       r"name\); name tok_emb\.weight, which freezes or trains both$"):
        freeze.resolve(freeze.FreezePattern("p", trainable=("g",)), {"g": ("head.*",)}, names, tied)
    plan = freeze.resolve(freeze.FreezePattern("p", trainable=("g",)), {"g": ("tok_emb.*",)}, names, tied)
    assert plan.trainable == {"tok_emb.weight"}


def test_a_glob_that_matches_nothing_at_all_says_only_that():
    with pytest.raises(freeze.PatternError, match=r"glob 'ghost\.\*' of group 'g' matches no parameter$"):
        freeze.resolve(freeze.FreezePattern("p", frozen=("g",)), {"g": ("ghost.*",)}, ["tok_emb.weight"],
                       {"head.weight": "tok_emb.weight"})
