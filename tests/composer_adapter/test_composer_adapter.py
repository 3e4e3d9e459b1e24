"""The Composer adapter's pieces, in process: parallelism configs, the CUDA-on-CPU shim, the clip-norm tap."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("composer.core")  # a module of the real package, not a namespace folder

import torch
from conftest import ShimProbe
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from pytest_freezecompat.adapters.composer import adapter, compat, emulation

CPU = torch.device("cpu")
#: The shim reads only the plugin id of its cell.
CELL: Any = SimpleNamespace(key=SimpleNamespace(plugin="fsdp2"))
needs_fsdp2 = pytest.mark.skipif(compat.fsdp2_config_class() is None,
                                 reason=f"Composer {compat.composer_version()} has no FSDP2 (from {compat.FSDP2_FROM})")


@pytest.mark.parametrize(("plugin", "fsdp"), [("ddp", None), ("fsdp1", "FSDPConfig"),
                                              pytest.param("fsdp2", "FSDP2Config", marks=needs_fsdp2)])
def test_plugins_map_to_composer_parallelism_configs(plugin: str, fsdp: str | None) -> None:
    config = adapter._parallelism(plugin, framework_ac=True)
    assert (None if config is None else type(config["fsdp"]).__name__) == fsdp
    if config is not None:
        assert config["fsdp"].activation_checkpointing


def test_fsdp1_variants_set_sharding_and_orig_params() -> None:
    flat, orig, grad_op = (adapter._parallelism(p, framework_ac=False)["fsdp"]
                           for p in ("fsdp1", "fsdp1-orig-params", "fsdp1-shard-grad-op"))
    assert (flat.use_orig_params, orig.use_orig_params, grad_op.use_orig_params) == (False, True, True)
    assert (flat.sharding_strategy, grad_op.sharding_strategy) == ("FULL_SHARD", "SHARD_GRAD_OP")
    with pytest.raises(ValueError, match="no plugin"):
        adapter._parallelism("deepspeed", framework_ac=False)


def test_a_release_without_fsdp2_refuses_the_plugin_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before 0.31 `composer.utils.parallelism` has no FSDP2Config: the adapter says so instead of an ImportError."""
    import composer.utils.parallelism as parallelism

    monkeypatch.delattr(parallelism, "FSDP2Config", raising=False)
    assert compat.fsdp2_config_class() is None
    with pytest.raises(NotImplementedError, match="has no FSDP2Config"):
        adapter._parallelism("fsdp2", framework_ac=False)
    assert adapter._parallelism("fsdp1", framework_ac=False) is not None


def test_the_commit_hash_is_read_once_and_the_env_dict_keeps_composers_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from composer.utils import collect_env

    original = collect_env.get_composer_commit_hash
    monkeypatch.setattr(collect_env, "get_composer_commit_hash", original)  # undone after the test
    reads = []
    monkeypatch.setattr(collect_env.importlib_metadata, "files",
                        lambda name, real=collect_env.importlib_metadata.files: reads.append(name) or real(name))
    compat.remember_commit_hash()
    compat.remember_commit_hash()  # twice, as a template that warms up again would: still one memo
    first = collect_env.get_composer_env_dict()["composer_commit_hash"]
    assert collect_env.get_composer_env_dict()["composer_commit_hash"] == first == original()
    assert len(reads) == 2  # the memo's one read, then `original()`'s own: none for the second env dict
    assert collect_env.get_composer_commit_hash.__wrapped__ is original


def test_dtensor_and_meta_init_resolve_on_this_torch() -> None:
    """torch < 2.4 keeps DTensor under torch.distributed._tensor only: the harness finds it either way."""
    from pytest_freezecompat.adapters.materialize import DTensor, MetaInit

    assert DTensor.__name__ == "DTensor" and MetaInit.__name__ == "MetaInit"
    assert not compat.is_dtensor(torch.ones(1))


def test_shim_redirects_cuda_requests_only_inside_and_reports_what_it_used() -> None:
    probe = ShimProbe()
    current_device, to_empty = torch.cuda.current_device, nn.Module.to_empty
    with emulation.SHIM.apply(CELL, probe, CPU):
        assert torch.cuda.current_device() == torch.device("cpu")
        module = nn.Linear(2, 2, device="meta").to_empty(device=f"cuda:{torch.cuda.current_device()}")
        assert module.weight.device.type == "cpu"
        nn.Linear(2, 2, device="meta").to_empty(device="cpu")  # a CPU request is left alone
    assert sorted(set(probe.emulated_patches)) == sorted([emulation.CURRENT_DEVICE, emulation.TO_EMPTY])
    assert (torch.cuda.current_device, nn.Module.to_empty) == (current_device, to_empty)


def test_shim_is_undone_when_the_wrapped_code_raises() -> None:
    to_empty = nn.Module.to_empty
    with pytest.raises(RuntimeError, match="boom"), emulation.SHIM.apply(CELL, ShimProbe(), CPU):
        raise RuntimeError("boom")
    assert nn.Module.to_empty is to_empty


def test_norm_tap_keeps_the_outermost_norm_and_restores_both_functions() -> None:
    tap = adapter._NormTap()
    clip, fsdp_clip = torch.nn.utils.clip_grad_norm_, FSDP.clip_grad_norm_
    param = nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    with tap.installed():
        returned = torch.nn.utils.clip_grad_norm_([param], max_norm=1.0)
    norm, source = tap.take()
    assert norm == pytest.approx(6.0) and float(returned) == pytest.approx(6.0)
    assert "torch.nn.utils.clip_grad_norm_" in source
    assert torch.allclose(param.grad.norm(), torch.tensor(1.0), atol=1e-5)  # it still clipped
    assert tap.take()[0] is None  # one value per step
    assert (torch.nn.utils.clip_grad_norm_, FSDP.clip_grad_norm_) == (clip, fsdp_clip)


class FactProbe:
    """Records what the adapter reports observing, as the rank's Recorder does (str of each value)."""

    def __init__(self) -> None:
        self.facts: dict[str, str] = {}

    def observed(self, fact: str, value: object) -> None:
        self.facts[fact] = str(value)


@pytest.mark.parametrize(("precision", "named"), [("fp32", "fp32"), ("amp_fp16", "fp16"), ("amp_bf16", "bf16")])
def test_observed_precision_is_what_the_model_computes_in(precision: str, named: str) -> None:
    """Under AMP the params stay fp32 but autocast computes in the AMP dtype: the cell's precision names that (the
    Trainer picks amp_fp16 by itself on a GPU when it is given no precision). Nothing wrapped: the bare class."""
    from composer.core import Precision

    probe = FactProbe()
    state: Any = SimpleNamespace(model=nn.Linear(2, 2), precision=Precision(precision),
                                 optimizers=[torch.optim.AdamW(nn.Linear(2, 2).parameters())], fsdp_enabled=False)
    adapter._observe(probe, state)
    assert probe.facts == {"wrapper": "Linear", "precision": named, "optimizer": "AdamW",
                           "framework_activation_checkpointing": "False"}
