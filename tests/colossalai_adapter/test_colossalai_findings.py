"""Each colossalai finding's standalone reproducer, run with this environment's python: it must show the failure on a
release inside its registry entry's range and not outside it (tests/findings_run.py)."""

import importlib.util

import pytest
from findings_run import OUTCOMES, ROOT, check_reproducer, findings


@pytest.mark.parametrize("entry", findings("colossalai"), ids=lambda entry: entry.id)
def test_the_finding_reproduces_where_the_registry_says(entry):
    check_reproducer("colossalai", entry)


def _reproducer(name: str):
    """A reproducer loaded by path (its name is not an identifier): its pure verdicts, no CUDA and no framework."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), ROOT / "findings" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("error", "want"), [
    # 0.3.4 on a GPU: the fused Adam kernel's device checks (multi_tensor_apply.cuh), the cells' message
    (RuntimeError("A tensor was not on the same device as the first tensor"), "REPRODUCED"),
    (RuntimeError("expected input to be on cuda"), "REPRODUCED"),
    # a step that fails for a reason of its own is not the finding
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.11 GiB total capacity)"),
     "NOT REPRODUCED"),
    (AssertionError("A tensor was not on the same device as the first tensor"), "NOT REPRODUCED"),
])
def test_unused_chunk_reproducer_reproduces_only_on_the_mixed_device_refusal(error, want):
    verdict = _reproducer("colossalai-gemini-unused-chunk-stepped-with-weights").verdict_of_step_error
    code, line = verdict(error)
    assert (OUTCOMES[code], line.split(":")[0]) == (want, want)
    assert "expected RuntimeError from multi_tensor_apply.cuh" in line and f"actual {type(error).__name__}: " in line
    assert str(error) in line
