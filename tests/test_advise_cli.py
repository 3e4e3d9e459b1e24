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
        "tiny-gpt/colossalai@0.4.7/gemini/lazy/none/lora: silent (fail)",
        "  why      requires_grad changed by wrapping: lora_a",
        "  known    colossalai-lazy-init-requires-grad (upstream) https://github.com/hpcaitech/ColossalAI/issues/1; "
        "fixed in colossalai 0.4.8",
        "  instead  init lazy -> eager: tiny-gpt/colossalai@0.4.7/gemini/eager/none/lora (ok)",
        "           plugin gemini -> gemini-auto: tiny-gpt/colossalai@0.4.7/gemini-auto/lazy/none/lora (ok)",
    ]


def test_the_newest_release_by_default(report, capsys):
    assert cli(["advise", "--framework", "colossalai", "--plugin", "gemini", "--freeze", "lora", "--init", "lazy",
                "--report", report]) == 0
    assert capsys.readouterr().out == "tiny-gpt/colossalai@0.5.0/gemini/lazy/none/lora: ok (pass)\n"


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
    assert lines[0] == "tiny-gpt/colossalai@0.3.4/gemini/eager/none/lora: refused (error)"
    assert any(line.startswith("  known    colossalai-gemini-frozen-param-hook (upstream)")
               and line.endswith("fixed in colossalai 0.3.5") for line in lines)
    assert any(line.startswith("  instead  plugin gemini -> ") for line in lines)
