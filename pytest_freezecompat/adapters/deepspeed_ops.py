"""DeepSpeed's C++ ops, built once with the environment and cached inside it (for the deepspeed adapter and the hf
adapter's ZeRO plugins: each one's `environment_setup` builds the ops its cells load).

DeepSpeed compiles its ops on first use (torch's JIT `cpp_extension.load`): the shared-memory comm op at
`init_distributed` (~3.5 min on this 2-core machine), CPU FusedAdam for an optimizer from the config (~5 min),
CPU Adam for optimizer offload (~5 min). A cell must never pay that, so the environment builds them when it is
made (`python -m pytest_freezecompat.adapters.deepspeed.environment_setup`, run by nox right after the install)
into `<env>/torch_extensions`, and every DeepSpeed process of that environment points `TORCH_EXTENSIONS_DIR`
there before DeepSpeed is imported (`use_environment_cache`). DeepSpeed is imported only inside the functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch

#: The op builders the matrix's cells load: the shared-memory comm op (`init_distributed` on a CPU accelerator),
#: FusedAdam (an optimizer from the config), CPU Adam (optimizer offload). Each accelerator has its own builder
#: class under these names; one it lacks (a CUDA accelerator has no shared-memory comm op) is not needed there.
OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")
#: Where the built ops live: inside the environment, so they are cached with it and dropped with it.
CACHE_NAME = "torch_extensions"


def extensions_dir() -> Path:
    return Path(sys.prefix) / CACHE_NAME


def use_environment_cache() -> None:
    """Point torch's JIT extension cache into this environment (a user's own TORCH_EXTENSIONS_DIR wins)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


@functools.cache
def _builders(names: tuple[str, ...] = OPS) -> dict[str, Any]:
    """This process's accelerator's builders of `names` that exist and can build here (DeepSpeed's own test; once
    per process: a CUDA builder's test asks nvcc)."""
    from deepspeed.accelerator import get_accelerator

    found = {name: get_accelerator().create_op_builder(name) for name in names}
    return {name: builder for name, builder in found.items() if builder is not None and builder.is_compatible()}


def load_all(verbose: bool = False, names: tuple[str, ...] = OPS) -> dict[str, float]:
    """Load (building where not cached) every op of `names` this accelerator needs; seconds per op."""
    import time

    use_environment_cache()
    seconds = {}
    for name, builder in _builders(names).items():
        started = time.perf_counter()
        builder.load(verbose=verbose)
        seconds[name] = round(time.perf_counter() - started, 1)
    return seconds


def build(names: tuple[str, ...] = OPS) -> int:
    """An environment's setup (`<adapter>.environment_setup`): build the ops of `names` into its cache, say how long."""
    import time

    started = time.perf_counter()
    seconds = load_all(verbose=False, names=names)
    print(f"deepspeed ops built into {extensions_dir()} in {time.perf_counter() - started:.0f} s: {seconds}")
    return 0


def missing(names: tuple[str, ...] = OPS) -> list[str]:
    """The ops of `names` this accelerator needs that are neither installed prebuilt nor built in the environment's
    cache (a cell would compile them: refuse instead)."""
    from deepspeed.git_version_info import installed_ops

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir()))
    return [name for name, builder in _builders(names).items()
            if not installed_ops.get(builder.NAME) and not any(root.glob(f"**/{builder.NAME}*.so"))]


def remember_cpu_info() -> None:
    """Ask py-cpuinfo once per rank template. Its `get_cpu_info()` answers from a new interpreter each time (~1 s on
    this machine), and DeepSpeed's CPU Adam asks at every construction (`DeepSpeedCPUAdam.__init__`, for the vendor):
    a second of every offloaded config-optimizer cell and again in its round trip. The machine does not change
    between cells; each caller gets its own copy of the same answer. (0.19.2 binds the name at import: its modules
    that did are pointed at the same function.)"""
    import copy

    import cpuinfo

    asked = cpuinfo.get_cpu_info
    if getattr(asked, "remembered", False):
        return
    answer = asked()

    def get_cpu_info() -> dict[str, Any]:
        return copy.deepcopy(answer)

    get_cpu_info.remembered = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed") and getattr(module, "get_cpu_info", None) is asked:
            module.get_cpu_info = get_cpu_info  # type: ignore[attr-defined]


def summarize_stage_3_arguments() -> None:
    """ZeRO-3's optimizer formats its constructor's arguments into a debug message that it then drops
    (`DeepSpeedZeroOptimizer_Stage3.__init__`: `print_rank_0(f"... with args: {locals()}", force=False)`), and
    `param_names` prints every param's values, not yet partitioned when the model was built eagerly: ~40 ms of
    every such engine for tiny-gpt, 7% of the ranks' CPU in ZeRO-3 cells. Inside that constructor a tensor's repr
    shows an element at each end only; what it builds is unchanged."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    construct = Stage3.__init__
    if getattr(construct, "summarized", False):
        return

    @functools.wraps(construct)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        options = torch._tensor_str.PRINT_OPTS
        threshold, edgeitems = options.threshold, options.edgeitems
        torch.set_printoptions(threshold=0, edgeitems=1)
        try:
            construct(self, *args, **kwargs)
        finally:
            torch.set_printoptions(threshold=threshold, edgeitems=edgeitems)

    __init__.summarized = True  # type: ignore[attr-defined]
    Stage3.__init__ = __init__


def warm_up(names: tuple[str, ...] = OPS) -> None:
    """Once in each rank template (a fork then has it all): ask py-cpuinfo, summarize ZeRO-3's dropped debug
    message, load the environment's built ops of `names` (never builds), and make the import every engine's first
    optimizer check makes: 0.19.8's `is_zero_supported_optimizer` imports its Muon optimizer on first call, whose
    `torch.compile` decorator loads inductor (~1 s of every fresh rank's first cell)."""
    if missing(names):
        return  # the cell says so, in one line
    remember_cpu_info()  # first: each op's load asks twice (its compile flags)
    summarize_stage_3_arguments()
    load_all(names=names)
    with contextlib.suppress(ImportError):  # 0.19.2 imports it with deepspeed itself
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
