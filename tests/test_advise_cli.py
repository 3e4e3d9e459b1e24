"""`freezecompat advise`: one setup's verdict, why, and what to do instead, from a report; one line when it can't."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_freezecompat.cli import main as cli
from pytest_freezecompat.report import write

ROOT = Path(__file__).resolve().parent.parent
ENVS = {"colossalai-0.4.7": {"torch": "2.4.1", "frameworks": {"colossalai": "0.4.7"}},
        "colossalai": {"torch": "2.5.1", "frameworks": {"colossalai": "0.5.0"}}}
KNOWN = {"id": "colossalai-lazy-init-requires-grad", "expected": True, "fixed_in": {"colossalai": "0.4.8"},
         "links": ["https://github.com/hpcaitech/ColossalAI/issues/1", "https://example.org/second"]}


def cell(status="pass", plugin="gemini", init="eager", checkpoint="none", release="0.4.7", **extra):
    return {"id": f"tiny-gpt/colossalai@{release}/{plugin}/{init}/{checkpoint}/lora", "model": "tiny-gpt",
            "framework": "colossalai", "release": release, "plugin": plugin, "init": init, "checkpoint": checkpoint,
            "freeze": "lora", "clip": "clip", "environment": "colossalai" if release == "0.5.0" else "colossalai-0.4.7",
            "status": status, "check": None, "message": "", **extra}


@pytest.fixture
def report(tmp_path):
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps(write.build(ENVS, [
        cell("fail", init="lazy", message="requires_grad changed by wrapping: lora_a | step 1: more", known_issue=KNOWN,
             failures=[{"check": "update", "params": ["lora_a"]}]),
        cell(), cell(checkpoint="reentrant"), cell(plugin="gemini-auto", init="lazy"),
        cell(init="lazy", release="0.5.0"),
    ])))
    return str(path)


def test_a_red_setup_gets_its_reason_its_known_issue_and_the_nearest_safe_setups(report, capsys):
    assert cli(["advise", "--framework", "colossalai", "--plugin", "gemini", "--freeze", "lora", "--release", "0.4.7",
                "--init", "lazy", "--report", report]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "tiny-gpt/colossalai@0.4.7/gemini/lazy/none/lora: SILENT (fail): no error, yet the weights are wrong (a held "
        "param moves, a trained one learns wrongly or not at all, a resume loses state)",
        "  why         requires_grad changed by wrapping: lora_a",
        "  known       colossalai-lazy-init-requires-grad (upstream) https://github.com/hpcaitech/ColossalAI/issues/1",
        "  fixed in    colossalai 0.4.8",
        "  workaround  release>=0.4.8 (upgrade colossalai to 0.4.8 or later): holds here: "
        "tiny-gpt/colossalai@0.5.0/gemini/lazy/none/lora",
        "  instead     init lazy -> eager: tiny-gpt/colossalai@0.4.7/gemini/eager/none/lora (ok)",
        "              plugin gemini -> gemini-auto: tiny-gpt/colossalai@0.4.7/gemini-auto/lazy/none/lora (ok)",
    ]


def test_every_setup_of_a_box_when_none_is_named_the_bad_ones_in_full(report, capsys):
    assert cli(["advise", "--framework", "colossalai", "--plugin", "gemini", "--freeze", "lora", "--release", "0.4.7",
                "--report", report]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("colossalai 0.4.7 · gemini · freeze lora · model tiny-gpt: 3 setups: 1 silent, 2 ok; the bad "
                      "ones all have checkpoint=none, init=lazy; each bad one below")
    assert out[1].startswith("tiny-gpt/colossalai@0.4.7/gemini/lazy/none/lora: SILENT (fail)")
    assert not any(line.startswith("tiny-gpt/colossalai@0.4.7/gemini/eager/") for line in out)  # safe: counted only


def test_the_newest_release_by_default(report, capsys):
    assert cli(["advise", "--framework", "colossalai", "--plugin", "gemini", "--freeze", "lora", "--init", "lazy",
                "--report", report]) == 0
    assert capsys.readouterr().out == "tiny-gpt/colossalai@0.5.0/gemini/lazy/none/lora: OK (pass): every check held\n"


def test_advise_as_a_user_runs_it(pytester, report):
    """The installed console script, from another directory: the answer on stdout, a bad value in one line."""
    script = str(Path(sys.executable).with_name("freezecompat"))  # the environment's console script
    done = pytester.run(script, "advise", "--framework", "colossalai", "--plugin", "gemini", "--freeze",
                        "lora", "--release", "0.4.7", "--init", "lazy", "--report", report)
    assert done.ret == 0
    assert done.outlines[0].startswith("tiny-gpt/colossalai@0.4.7/gemini/lazy/none/lora: SILENT (fail)")
    assert "  instead     init lazy -> eager: tiny-gpt/colossalai@0.4.7/gemini/eager/none/lora (ok)" in done.outlines
    wrong = pytester.run(script, "advise", "--framework", "colossalai", "--plugin", "gemni", "--freeze",
                         "lora", "--release", "0.4.7", "--report", report)
    assert wrong.ret == 2 and wrong.outlines == []
    assert wrong.errlines == [f"freezecompat: {report}: no plugin 'gemni' for colossalai 0.4.7; it has: gemini, "
                              "gemini-auto"]


@pytest.mark.parametrize(("args", "error"), [
    (["--plugin", "gemni"], "no plugin 'gemni' for colossalai 0.4.7; it has: gemini, gemini-auto"),
    (["--plugin", "gemini", "--checkpoint", "full"],
     "no checkpoint 'full' for colossalai 0.4.7 plugin=gemini freeze=lora; it has: reentrant, none"),  # nearest first
])
def test_a_setup_the_report_does_not_hold_gets_one_line(report, capsys, args, error):
    assert cli(["advise", "--framework", "colossalai", "--freeze", "lora", "--release", "0.4.7", *args,
                "--report", report]) == 2
    assert capsys.readouterr().err == f"freezecompat: {report}: {error}\n"


def test_a_missing_report_gets_one_line(tmp_path, capsys):
    missing = str(tmp_path / "none.json")
    assert cli(["advise", "--framework", "torch", "--plugin", "ddp", "--freeze", "lora", "--report", missing]) == 2
    assert capsys.readouterr().err == f"freezecompat: {missing}: cannot read report (No such file or directory)\n"


def test_the_published_report_answers_lora_on_gemini_0_3_4():
    if not (ROOT / "reports" / "matrix.json").is_file():
        pytest.skip("no published report here (the sdist ships none)")
    done = subprocess.run([sys.executable, "-m", "pytest_freezecompat.cli", "advise", "--framework", "colossalai",
                           "--plugin", "gemini", "--freeze", "lora", "--release", "0.3.4"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("colossalai 0.3.4 · gemini · freeze lora · model tiny-gpt: ")
    assert "tiny-gpt/colossalai@0.3.4/gemini/eager/non-reentrant/lora: REFUSED (error): the stack raised or hung: " \
           "loud, the user knows" in lines
    assert "  same in     checkpoint=none init=eager, checkpoint=reentrant init=eager" in lines  # what varies
    assert any(line.startswith("  known       colossalai-gemini-frozen-param-hook (upstream)") for line in lines)
    assert "  fixed in    colossalai 0.3.5" in lines
    assert any(line.startswith("  workaround  ") for line in lines)
    # LowLevelZero on 0.3.4 reports no clip norm: its cell proves nothing; the upgrade does
    assert any(line.startswith("  workaround  plugin=low-level-zero-2 ") and "not proved here (that cell is unproven"
               in line for line in lines)
    assert any(line.strip().startswith("release>=0.3.5 ") and ": holds here: " in line for line in lines)
