"""The Hugging Face adapter's pieces, in process: the state hygiene, the stack check and the CPU shim.

The environment-variable trap (HF-STACK.md §2): Accelerate writes `ACCELERATE_USE_FSDP=true` and
`AcceleratorState._reset_state(True)` leaves it, so the next `Accelerator()` of a warm process takes FSDP though
it passed no plugin. `test_the_trap_is_real_and_fresh_state_and_the_check_catch_it` shows it on this release, in a
one-process group, and that `state.fresh` prevents it and `state.check` refuses it.
"""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("accelerate.state")  # a module of the real package, not a namespace folder

import torch
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from conftest import ShimProbe
from hf_fixtures import one_process_group  # noqa: F401 (a fixture)
from torch import nn

from pytest_freezecompat.adapters.hf import DECLARATION, TRAINER_PLUGINS, TRL_PLUGINS, accelerate_loop, emulation, state

CPU = torch.device("cpu")
CELL: Any = SimpleNamespace(key=SimpleNamespace(plugin="accelerate-fsdp2"), emulation=True)


def test_clear_environment_removes_accelerate_and_fsdp_variables_but_what_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ACCELERATE_USE_FSDP", "FSDP_USE_ORIG_PARAMS", "ACCELERATE_TORCH_DEVICE", "FREEZECOMPAT_OTHER"):
        monkeypatch.setenv(name, "x")
    removed = state.clear_environment(keep=emulation.OWNED_ENV)
    assert removed == ["ACCELERATE_USE_FSDP", "FSDP_USE_ORIG_PARAMS"]
    assert os.environ["ACCELERATE_TORCH_DEVICE"] == "x" and os.environ["FREEZECOMPAT_OTHER"] == "x"


def test_a_leaked_fsdp_variable_changes_the_plugin_a_cell_builds_unless_cleared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin reads its defaults from FSDP_* variables: a leaked one would turn flat params into original ones."""
    monkeypatch.setenv("FSDP_USE_ORIG_PARAMS", "true")
    assert accelerate_loop.fsdp_plugin(1, None, ["Block"]).use_orig_params
    state.clear_environment()
    assert not accelerate_loop.fsdp_plugin(1, None, ["Block"]).use_orig_params


def test_check_names_what_was_asked_and_what_came() -> None:
    got = SimpleNamespace(distributed_type="DistributedType.MULTI_CPU", num_processes=2)
    state.check("accelerate-ddp", "MULTI_CPU", "Linear", got, nn.Linear(2, 2), 2)  # what was asked: no error
    with pytest.raises(state.StackMismatch, match=r"asked for distributed_type=FSDP.*gave distributed_type="
                                                  r"MULTI_CPU, num_processes=2, wrapper Linear"):
        state.check("accelerate-fsdp2", "FSDP", "fsdp2", got, nn.Linear(2, 2), 2)


def test_plugins_build_the_fsdp_configs_asked_for() -> None:
    flat, orig, two = (accelerate_loop.fsdp_plugin(v, o, ["Block"]) for v, o in ((1, None), (1, True), (2, None)))
    assert (flat.fsdp_version, flat.use_orig_params, orig.use_orig_params, two.fsdp_version) == (1, False, True, 2)
    assert flat.state_dict_type.name == accelerate_loop.FSDP1_STATE_DICT  # FULL segfaults on CPU, unpatched
    full = accelerate_loop.fsdp_plugin(1, None, ["Block"], full_state_dict=True)
    assert full.state_dict_type.name == "FULL_STATE_DICT"
    zero = {p for p in DECLARATION.plugins if "-zero" in p}  # the DeepSpeed plugins: test_hf_zero.py
    assert set(accelerate_loop.PLUGINS) == set(DECLARATION.plugins) - set(TRAINER_PLUGINS) - set(TRL_PLUGINS) - zero


def test_shim_answers_the_gpu_backend_and_cpu_device_only_inside_and_reports_it() -> None:
    probe = ShimProbe()
    original = PartialState._prepare_backend
    with emulation.SHIM.apply(CELL, probe, CPU):
        assert os.environ["ACCELERATE_TORCH_DEVICE"] == "cpu"
        backend, kind = PartialState._prepare_backend(SimpleNamespace(), cpu=True)
        assert (backend, str(kind).rpartition(".")[2]) == ("gloo", "MULTI_GPU")
    assert probe.emulated_patches == [emulation.BACKEND]  # the FSDP1 offload patches engage only in a full save
    assert PartialState._prepare_backend is original and "ACCELERATE_TORCH_DEVICE" not in os.environ


@pytest.mark.usefixtures("one_process_group")
def test_the_trap_is_real_and_fresh_state_and_the_check_catch_it() -> None:
    """After an FSDP Accelerator, a reset state plus `Accelerator()` with no plugin is FSDP again (the trap, real on
    this release); after `state.fresh` it is not; and the check refuses the trapped one by name."""
    with emulation.SHIM.apply(CELL, ShimProbe(), CPU):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        assert os.environ.get("ACCELERATE_USE_FSDP") == "true"  # what Accelerate leaves behind
        state.reset_state()  # the documented-internal reset alone
        trapped = Accelerator()
        assert str(trapped.distributed_type).endswith("FSDP")
        trap = r"asked for distributed_type=MULTI_GPU.*gave distributed_type=FSDP"
        with pytest.raises(state.StackMismatch, match=trap):
            state.check("accelerate-ddp", "MULTI_GPU", "Linear", trapped, nn.Linear(2, 2), 1)
        state.fresh(keep=emulation.OWNED_ENV)
        assert str(Accelerator().distributed_type).endswith("MULTI_GPU")


def test_the_rank_template_can_hold_the_trainer_and_deepspeed_and_still_fork() -> None:
    """The adapter's `warm_up` imports what a fresh rank's Trainer and ZeRO cells would import (seconds each): in
    the template's environment (one thread each for OpenMP and torch) it must leave no thread but those a fork may
    leave (pyarrow's jemalloc thread, once TRL's datasets is installed), or the pool cannot fork ranks from it."""
    import subprocess
    import sys

    script = ("import os, sys, torch; torch.set_num_threads(1)\n"
              "from pytest_freezecompat.adapters.hf import adapter\n"
              "adapter.warm_up()\n"
              "from pytest_freezecompat.rank.template import _other_thread_names\n"
              "print(1 + len(_other_thread_names()), 'transformers.trainer' in sys.modules, "
              "'deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    threads, trainer, deepspeed = done.stdout.split()[-3:]
    assert (threads, trainer) == ("1", "True")
    assert deepspeed == str(importlib.util.find_spec("deepspeed") is not None)
