"""A package that only some plugins import (TRL, DeepSpeed beside Accelerate) missing here: their cells are skipped
before any rank starts, saying what to install, and the run's summary says it once per package (pytester)."""

import importlib.util

import pytest
from test_user_cases import case

#: Hides TRL and DeepSpeed from the run as if they were not installed (`find_spec` answers None, `import` raises).
HIDE = 'import sys\n\nfor name in ("trl", "deepspeed"):\n    sys.modules[name] = None\n'


def test_plugins_whose_packages_are_missing_are_skips_with_the_pip_line_said_once_each(run_matrix, pytester):
    # Asked, not imported: pytester drops what a test imports, and torch imported twice in one process crashes it.
    if any(importlib.util.find_spec(module) is None for module in ("torch", "accelerate", "transformers", "peft")):
        pytest.skip("the hf row's own packages are not installed here")
    pytester.makeconftest(HIDE)
    pytester.makepyfile(test_mine=case('{"head-only": {"trainable": ["head.*"]}}', frameworks='["hf"]',
                                       plugins='["trl-sft-ddp", "trl-sft-zero3", "accelerate-zero2"]'))
    result, report = run_matrix("--freeze-matrix-builtin",
                                "--freeze-matrix-select=framework=hf,plugin=accelerate-zero2,plugin=trainer-zero3,"
                                "plugin=trl-sft-ddp,plugin=trl-sft-zero3,checkpoint=none,clip=clip,freeze=none,"
                                "freeze=head-only")
    cells = report["cells"]
    reasons = {(cell["model"], cell["plugin"], cell["freeze"]): cell["message"] for cell in cells}
    # The built-in model's ZeRO cells and the user's model's cells of each plugin, decided at planning.
    assert reasons == {
        **{("tiny-gpt", plugin, "none"): f"plugin {plugin} needs `deepspeed`: pip install deepspeed"
           for plugin in ("accelerate-zero2", "trainer-zero3")},
        **{("small-net", plugin, freeze): why for freeze in ("none", "head-only") for plugin, why in (
            ("trl-sft-ddp", "plugin trl-sft-ddp needs `trl`: pip install trl"),
            ("trl-sft-zero3", "plugin trl-sft-zero3 needs `trl` and `deepspeed`: pip install trl deepspeed"),
            ("accelerate-zero2", "plugin accelerate-zero2 needs `deepspeed`: pip install deepspeed"))}}
    assert {(cell["status"], cell["severity"], cell.get("cause")) for cell in cells} == {("skip", "skipped", None)}
    result.assert_outcomes(skipped=len(cells), deselected=1)  # test_mine's ordinary test
    result.stdout.fnmatch_lines(["how bad: 8 skipped",
                                 "skipped: 6 cells of hf/accelerate-zero2, hf/trainer-zero3, hf/trl-sft-zero3 need "
                                 "`deepspeed`: pip install deepspeed",
                                 "skipped: 4 cells of hf/trl-sft-ddp, hf/trl-sft-zero3 need `trl`: pip install trl"])
    out = result.stdout.str()
    assert out.count("pip install trl") == 1 and out.count("pip install deepspeed") == 1
