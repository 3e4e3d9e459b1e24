"""Tied and shared params: found at setup, stated on the row, named where a pattern or a stack trips on them."""

import importlib.metadata

import pytest
from own_project import TOKEN_DATA
from torch import nn

from pytest_freezecompat.core import freeze, ties
from pytest_freezecompat.core.records import RankRecord
from pytest_freezecompat.verdict import checks

TORCH = importlib.metadata.version("torch").partition("+")[0]


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


def test_an_alias_trains_exactly_when_its_first_name_does():
    tied = {"head.weight": "tok_emb.weight"}
    assert ties.trains("head.weight", {"tok_emb.weight"}, tied)
    assert not ties.trains("head.weight", {"head.bias"}, tied)
    assert ties.stated(tied) == ["head.weight = tok_emb.weight"]


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


def _record(flags: dict[str, bool], observed: dict[str, str] | None = None) -> RankRecord:
    return RankRecord(rank=0, requires_grad=flags, tied={"head.weight": "tok_emb.weight"}, observed=observed or {})


@pytest.mark.parametrize(("init", "observed", "reason"), [
    ("meta", {}, "meta init: to_empty() allocates each param afresh and breaks the tie head.weight = tok_emb.weight: "
                 "call tie_weights() (or re-tie) after to_empty"),
    ("eager", {"wrapper": "FullyShardedDataParallel", "use_orig_params": "False"},
     "head.weight was tied to tok_emb.weight; FSDP(use_orig_params=False) flattens each unit's params into its own "
     "flat param, so a tie across two units becomes two tensors"),
])
def test_an_alias_listed_on_its_own_after_wrapping_is_named_with_what_untied_it(init, observed, reason):
    # The pattern trains the tied tensor; its split copy kept the flag: nothing but the tie changed.
    problem = checks._check_flags([_record({"tok_emb.weight": True, "head.weight": True}, observed)],
                                  {"tok_emb.weight"}, init)
    assert problem is not None and problem.text.startswith(reason)
    assert problem.params == ("head.weight",) and problem.kinds == ("untied",)


def test_a_tie_that_survives_wrapping_is_no_problem():
    assert checks._check_flags([_record({"tok_emb.weight": False})], set(), "meta") is None


REAL = '''
import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Head(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, 32, bias=False)

    def forward(self, x):
        return self.proj(x)


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.body = nn.Linear(8, 8)
        self.head = Head(8)
        self.head.proj.weight = self.embed.weight  # the head IS the embedding

    def forward(self, tokens):
        return self.head(torch.relu(self.body(self.embed(tokens))))

''' + TOKEN_DATA + '''


@freeze_case(batch=batch, loss=loss, patterns=PATTERNS, checkpoint=["none"], blocks=["Head"], plugins=PLUGINS,
             init=INIT)
def tied_net():
    return TiedNet()
'''


def tied_case(patterns: str, plugins: str = '["ddp"]', init: str = '["eager"]') -> str:
    return REAL.replace("PATTERNS", patterns).replace("PLUGINS", plugins).replace("INIT", init)


def test_a_head_frozen_through_its_embedding_is_stated_on_the_row(pytester, run_user):
    pytester.makepyfile(test_mine=tied_case('{"frozen-embedding": {"frozen": ["embed.*"]}}'))
    result, report = run_user()
    result.assert_outcomes(passed=2)  # the cell and its control: one tensor, frozen under either name
    assert {c["status"] for c in report["cells"]} == {"pass"}
    assert [c["tied"] for c in report["cells"]] == [["head.proj.weight = embed.weight"]] * 2


def test_a_pattern_naming_only_the_tied_head_names_the_tie_at_collection(pytester, run_user):
    pytester.makepyfile(test_mine=tied_case('{"head-only": {"trainable": ["head.*"]}}'))
    result, report = run_user("--collect-only")
    assert result.ret == 2 and report is None
    result.stdout.fnmatch_lines(["*freeze_case tied_net: freeze pattern 'head-only': glob 'head.*' of group "
                                 "'head-only.trainable' matches no parameter: head.proj.weight is tied to "
                                 "embed.weight (one tensor, listed under its first name); name embed.weight, "
                                 "which freezes or trains both"])


def test_what_untied_a_head_is_the_reason_of_its_red_cells(pytester, run_user):
    """The head is its own FSDP unit: flat FSDP1 flattens it apart from the embedding; meta init's `to_empty()`
    breaks the tie under DDP. Both make two tensors of one, and the row says which did it."""
    pytester.makepyfile(test_mine=tied_case('{"frozen-embedding": {"frozen": ["embed.*"]}}',
                                            plugins='["ddp", "fsdp1"]', init='["eager", "meta"]'))
    _, report = run_user("--freeze-matrix-select", "freeze=none")
    message = {(c["plugin"], c["init"]): c["message"] for c in report["cells"]}
    assert message[("ddp", "eager")] == ""
    assert message[("ddp", "meta")].startswith(
        "meta init: to_empty() allocates each param afresh and breaks the tie head.proj.weight = embed.weight")
    assert message[("fsdp1", "eager")].startswith(
        "head.proj.weight was tied to embed.weight; FSDP(use_orig_params=False) flattens each unit's params")
