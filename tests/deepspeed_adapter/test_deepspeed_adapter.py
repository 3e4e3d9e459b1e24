"""The DeepSpeed adapter's parts in one process: plugin ids, the config a cell hands to `deepspeed.initialize`,
the ops cache, and how the saved files are read back."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

import torch
from slices import matrix_cell

from pytest_freezecompat.adapters import deepspeed_ops as ops
from pytest_freezecompat.adapters import deepspeed_views
from pytest_freezecompat.adapters.deepspeed import DECLARATION
from pytest_freezecompat.adapters.deepspeed import adapter as ds
from pytest_freezecompat.core.cell import Cell


def cell(plugin: str, freeze: str, init: str = "eager", clip: str = "clip") -> Cell:
    return matrix_cell("deepspeed", plugin=plugin, init=init, checkpoint="none", freeze=freeze, clip=clip)


@pytest.mark.parametrize("plugin", DECLARATION.plugins)
def test_every_declared_plugin_parses(plugin: str) -> None:
    parsed = ds.parse_plugin(plugin)
    assert parsed.stage in (0, 1, 2, 3)
    assert parsed.offload == ("offload" in plugin) and parsed.config_optimizer == ("-config-optim" in plugin)
    assert parsed.bf16 == plugin.endswith("-bf16")


def test_an_unknown_plugin_is_refused() -> None:
    with pytest.raises(ValueError, match="no plugin 'zero4'"):
        ds.parse_plugin("zero4")


def test_the_config_of_a_clipped_stage_3_cell() -> None:
    c = cell("zero3", "embedding")
    config = ds.ds_config(c, ds.parse_plugin("zero3"), 2)
    assert config["zero_optimization"] == {"stage": 3, "stage3_param_persistence_threshold": 0}
    assert config["gradient_clipping"] == c.hyper.max_norm > 0
    assert config["train_batch_size"] == 2 * config["train_micro_batch_size_per_gpu"]
    assert "optimizer" not in config and config["zero_allow_untested_optimizer"] is True


def test_offloading_a_client_optimizer_asks_deepspeed_not_to_swap_it() -> None:
    c = cell("zero2-offload", "embedding", clip="no-clip")
    config = ds.ds_config(c, ds.parse_plugin("zero2-offload"), 2)
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["gradient_clipping"] == 0.0  # no-clip: the engine's clipping path is not taken


def test_the_optimizer_from_the_config_carries_the_cells_hyperparameters() -> None:
    c = cell("zero1-config-optim", "embedding")
    params = ds.ds_config(c, ds.parse_plugin("zero1-config-optim"), 2)["optimizer"]["params"]
    h = c.hyper
    assert params == {"lr": h.lr, "betas": list(h.betas), "eps": h.eps, "weight_decay": h.weight_decay}


def test_bf16_plugins_run_bf16_cells_against_the_mixed_reference() -> None:
    c = cell("zero3-bf16", "lora")
    assert c.precision == "bf16"
    assert ds.ds_config(c, ds.parse_plugin("zero3-bf16"), 2)["bf16"] == {"enabled": True}
    fp32 = cell("zero3", "lora")
    with pytest.raises(ValueError, match="needs precision bf16"):
        ds.ds_config(fp32, ds.parse_plugin("zero3-bf16"), 2)


def test_zero_init_cells_save_without_frozen_params() -> None:
    assert cell("zero3", "lora", init="zero-init").options == {
        ds.EXCLUDE_FROZEN: True}


def test_the_ops_are_built_in_the_environment_and_found_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ops.use_environment_cache()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(Path(sys.prefix) / ops.CACHE_NAME)
    assert ops.missing() == []  # built when the environment was made: a cell never compiles


def test_a_missing_op_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert ops.missing() == list(ops.OPS)


def test_moments_are_found_in_either_zero_layout() -> None:
    moment = {"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    assert deepspeed_views._holds_moments({"base_optimizer_state": [moment]})  # stages 1-2
    assert deepspeed_views._holds_moments({"optimizer_state_dict": {"state": {0: moment}}})  # stage 3
    assert not deepspeed_views._holds_moments({"optimizer_state_dict": {"state": {}}})
    assert not deepspeed_views._holds_moments({"state": {0: {"exp_avg": torch.empty(0)}}})


@pytest.mark.parametrize(("plugin", "reads"), [("zero0", "param.grad itself"), ("zero2", "_hp_mapping"),
                                               ("zero3", "get_fp32_grad_for_param")])
def test_the_grad_access_says_where_each_stage_keeps_grads(plugin: str, reads: str) -> None:
    assert reads in deepspeed_views.grad_access(ds.parse_plugin(plugin))


def test_the_cpu_is_asked_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU Adam asks py-cpuinfo at every construction, and each answer costs a new interpreter: after the template's
    warm-up the answer is remembered, equal to a fresh one, and a caller's edits do not reach the next caller."""
    import cpuinfo
    from deepspeed.ops.adam import cpu_adam

    fresh = cpuinfo.get_cpu_info()
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # undone after the test
    if hasattr(cpu_adam, "get_cpu_info"):  # 0.19.2 binds the name at import
        monkeypatch.setattr(cpu_adam, "get_cpu_info", cpuinfo.get_cpu_info)
    ops.remember_cpu_info()
    monkeypatch.setattr(cpuinfo, "get_cpu_info_json", lambda: pytest.fail("asked the machine again"))
    answer = cpuinfo.get_cpu_info()
    assert answer == fresh
    answer["flags"] = []
    assert cpuinfo.get_cpu_info() == fresh
    if hasattr(cpu_adam, "get_cpu_info"):
        assert cpu_adam.get_cpu_info is cpuinfo.get_cpu_info


def test_zero_3s_dropped_debug_message_summarizes_tensors_while_it_constructs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ZeRO-3's optimizer constructor a tensor's repr is short (its `locals()` message formats every param);
    the caller's print options come back afterwards, also when the constructor raises."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    seen: list[str] = []

    def construct(self: object, tensor: torch.Tensor, fail: bool = False) -> None:
        seen.append(repr(tensor))
        if fail:
            raise ValueError("refused")

    monkeypatch.setattr(Stage3, "__init__", construct)  # the wrapper wraps this; the original comes back after
    ops.summarize_stage_3_arguments()
    ops.summarize_stage_3_arguments()  # once per process: not wrapped twice
    before = repr(torch.arange(5000.0))
    Stage3.__init__(object.__new__(Stage3), torch.arange(5000.0))
    with pytest.raises(ValueError, match="refused"):
        Stage3.__init__(object.__new__(Stage3), torch.arange(5000.0), fail=True)
    assert len(seen[0]) < 60 and seen[0] == seen[1], seen
    assert len(before) > 60 and repr(torch.arange(5000.0)) == before
    assert Stage3.__init__.__wrapped__ is construct
