"""An entry whose mechanism exists only on our CPU runs (gloo, CPU devices) says so in every format and beside its
"instead", and a shared entry says one fixed-in release to every framework it spans."""

import pytest

from pytest_freezecompat import advice
from pytest_freezecompat.advice.answer import lines
from pytest_freezecompat.core.names import cpu_only, fixed_in_words
from pytest_freezecompat.report import guide, html, markdown, write

GLOO = {"id": "torch-fsdp2-gloo-grad-sum", "expected": True, "fixed_in": {"torch": "2.9.0"},
        "summary": "FSDP2 on gloo summed grads. More.", "links": ["https://github.com/pytorch/pytorch/issues/162338"],
        "only_on": {"backend": "gloo", "elsewhere": "NCCL averages"},
        "workarounds": [{"change": {"plugin": "ddp"}, "says": "DDP"}]}
ENVIRONMENTS = {"torch-2.8": {"frameworks": {"torch": "2.8.0"}}, "composer": {"frameworks": {"composer": "0.32.1"}}}


def row(framework, release, plugin, severity, environment, known=None):
    axes = {"model": "tiny-gpt", "framework": framework, "release": release, "plugin": plugin, "init": "eager",
            "checkpoint": "none", "freeze": "bias-only", "clip": "clip"}
    status = "fail" if severity == "silent" else "pass"
    return {**axes, "id": f"tiny-gpt/{framework}@{release}/{plugin}/eager/none/bias-only", "status": status,
            "severity": severity, "check": "grads" if status == "fail" else None, "message": "grads 2x",
            "environment": environment, **({"known_issue": known} if known else {})}


@pytest.fixture(scope="module")
def report():
    cells = [row("torch", "2.8.0", "fsdp2", "silent", "torch-2.8", GLOO),
             row("torch", "2.8.0", "ddp", "ok", "torch-2.8"),
             row("composer", "0.32.1", "fsdp2-no-avg-shim", "silent", "composer", GLOO),
             row("composer", "0.32.1", "ddp", "ok", "composer")]
    return advice.annotate(write.build(ENVIRONMENTS, cells))


def test_the_words_name_the_backend_and_what_a_gpu_run_sees():
    assert cpu_only(GLOO) == "Only on gloo (CPU process groups); on GPU: NCCL averages"
    assert cpu_only({"id": "x"}) is None


def test_every_format_says_it_is_cpu_only(report):
    said = cpu_only(GLOO)
    assert said in markdown.render(report)
    assert said in guide.render(report)
    assert said in html.render(report)
    (silent,) = [cell for cell in report["cells"] if cell["framework"] == "torch" and cell["severity"] == "silent"]
    assert any(said in line for line in lines(silent))


def test_a_shared_entry_says_the_same_fixed_release_on_every_framework(report):
    text = guide.render(report)
    harm_lines = [line for line in text.splitlines() if "torch-fsdp2-gloo-grad-sum" in line and "silent" in line]
    assert len(harm_lines) == 2, harm_lines
    assert all("**fixed in torch 2.9.0**" in line for line in harm_lines)
    assert "no fixed release" not in " ".join(harm_lines)
    assert fixed_in_words(GLOO) == "torch 2.9.0"
