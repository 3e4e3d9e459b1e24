"""A user's own model in their own CI: silent harm fails the run whether or not a registry entry explains it, the run
ends with what to do instead, the other severities follow `--freeze-matrix-fail-on`, and a model without a
checkpointing switch is checkpointed around its blocks (pytester, real 2-rank runs)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from own_project import HEAD

README = Path(__file__).parents[1] / "README.md"

MODEL = HEAD + '''

class Net(nn.Module):
    """No checkpointing switch, no _no_split_modules: its blocks are what its ModuleList holds."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 32)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(global_batch_size, step):
    tokens = torch.randint(0, 32, (global_batch_size, 4), generator=torch.Generator().manual_seed(step))
    return {"tokens": tokens, "targets": tokens.flip(-1)}


def loss(model, b):
    return nn.functional.cross_entropy(model(b["tokens"]).flatten(0, 1), b["targets"].flatten())


@freeze_case(batch=batch, loss=loss, patterns={"frozen-embedding": {"frozen": ["embed.*"]}},
             frameworks=["torch"], plugins=["ddp", "ddp-find-unused"], init=["eager"], checkpoint=["reentrant"])
def layered_net():
    return Net()
'''


@pytest.fixture
def outcome(pytester, run_user):
    """Reentrant checkpointing over a frozen embedding (C4): DDP with find_unused trains the blocks on nothing
    (silent), plain DDP raises (refused); of the nothing-frozen controls, DDP passes and DDP with find_unused refuses
    reentrant checkpointing whatever is frozen."""
    pytester.makepyfile(test_mine=MODEL)

    def run(*args):
        return run_user(*args)

    return run


def test_silent_harm_fails_the_run_and_the_end_says_what_to_do(outcome):
    result, report = outcome("-rx")
    assert result.ret == 1
    result.assert_outcomes(passed=1, failed=1, xfailed=2)
    severities = {c["plugin"]: c["severity"] for c in report["cells"] if c["freeze"] == "frozen-embedding"}
    assert severities == {"ddp-find-unused": "silent", "ddp": "refused"}
    # The summary counts as pytest did: the silent cell failed although an entry explains it, the refusal is known.
    result.stdout.fnmatch_lines(["framework/plugin *pass *fail *error *known",
                                 "torch/ddp-find-unused *0 *1 *0 *1"])
    text = result.stdout.str()
    assert "your models: not safe, why, and what to do instead" in text
    section = text.split("your models: not safe, why, and what to do instead", 1)[1]
    assert "layered-net/torch@" in section and "/ddp-find-unused/eager/reentrant/frozen-embedding: SILENT" in section
    assert "instead" in section  # the nearest proved setup (or that there is none), as advise says it
    assert ("refused (torch-reentrant-checkpoint-frozen-inputs): not in --freeze-matrix-fail-on=silent"
            in text)  # the xfail's reason: an entry explains it, and the project does not fail on refusals


def test_the_readmes_ci_step_fails_on_silent_harm(pytester, monkeypatch):
    """The GitHub Actions step as the README writes it, run in a project whose model trains silently wrong."""
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)
    step = re.search(r"- run: pytest (--freeze-matrix[^#\n]*)", README.read_text()).group(1).split()
    pytester.makepyfile(test_mine=MODEL)
    result = pytester.runpytest_subprocess(*step, "-p", "no:cacheprovider")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*your models: not safe, why, and what to do instead*",
                                 "*/ddp-find-unused/eager/reentrant/frozen-embedding: SILENT*"])


def test_refused_fails_the_run_where_the_project_says_so(outcome):
    result, _ = outcome("--freeze-matrix-fail-on=silent,refused")
    result.assert_outcomes(passed=1, failed=3)


def test_a_misspelt_severity_is_one_line(outcome):
    result, _ = outcome("--freeze-matrix-fail-on=silnet")
    assert result.ret == 4
    assert "--freeze-matrix-fail-on: silnet is not a severity a run can fail on" in result.stderr.str()


def test_a_model_without_blocks_or_switch_says_checkpointing_was_not_run(pytester, run_user):
    flat = (MODEL.replace("self.layers = nn.ModuleList([Block(), Block()])", "self.layer = Block()")
            .replace("for layer in self.layers:\n            x = layer(x)", "x = self.layer(x)")
            .replace(', checkpoint=["reentrant"]', ""))
    pytester.makepyfile(test_mine=flat)
    result, report = run_user("-k", "ddp/ and frozen-embedding")
    assert {c["checkpoint"] for c in report["cells"]} == {"none"}
    assert "freeze_case layered-net: activation checkpointing is not run and FSDP wraps the model as one unit" in (
        result.stdout.str())


def test_the_guide_and_advise_answer_on_the_projects_own_report(pytester, monkeypatch):
    """No --freeze-matrix-report: the run writes .freeze-matrix/, where `freezecompat advise` looks first."""
    monkeypatch.delenv("FREEZECOMPAT_ENVIRONMENT", raising=False)
    pytester.makepyfile(test_mine=MODEL)
    pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "frozen-embedding")
    guide = (pytester.path / ".freeze-matrix" / "guide.md").read_text()
    assert "| `frozen-embedding` | 🟧 refused [1] | 🟥 silent [1] |" in guide
    advised = subprocess.run([sys.executable, "-m", "pytest_freezecompat.cli", "advise", "--framework", "torch",
                              "--plugin", "ddp-find-unused", "--freeze", "frozen-embedding"],
                             cwd=pytester.path, capture_output=True, text=True, check=False)
    assert advised.returncode == 0, advised.stderr
    assert "/ddp-find-unused/eager/reentrant/frozen-embedding: SILENT" in advised.stdout
    listed = subprocess.run([sys.executable, "-m", "pytest_freezecompat.cli", "advise", "--framework", "torch"],
                            cwd=pytester.path, capture_output=True, text=True, check=False)
    assert "layered-net" in listed.stdout and "frozen-embedding" in listed.stdout


def test_each_cell_of_a_users_model_runs_its_own_round_trip(pytester, run_user):
    """Round-trip sharing rests on evidence from the built-in models: a user's non-reentrant cell once took the
    refused round trip of its reentrant twin (FSDP2's load asks for Adam state its grad-less blocks never had)."""
    pytester.makepyfile(test_mine=MODEL.replace('plugins=["ddp", "ddp-find-unused"]', 'plugins=["fsdp2"]')
                        .replace('checkpoint=["reentrant"]', 'checkpoint=["reentrant", "non-reentrant"]'))
    _, report = run_user("-k", "frozen-embedding")
    rows = {c["checkpoint"]: c for c in report["cells"]}
    assert rows["reentrant"]["severity"] == "silent"  # C4: the blocks train on nothing
    assert rows["non-reentrant"]["severity"] == "ok", rows["non-reentrant"]["message"]
    assert not any(c.get("round_trip_of") for c in report["cells"])
