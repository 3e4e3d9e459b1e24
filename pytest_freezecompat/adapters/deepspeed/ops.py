"""DeepSpeed's C++ ops, built once with the environment and cached inside it.

DeepSpeed compiles its ops on first use (torch's JIT `cpp_extension.load`): the shared-memory comm op at
`init_distributed` (~3.5 min on this 2-core machine), CPU FusedAdam for an optimizer from the config (~5 min),
CPU Adam for optimizer offload (~5 min). A cell must never pay that, so the environment builds them when it is
made (`python -m pytest_freezecompat.adapters.deepspeed.environment_setup`, run by nox right after the install)
into `<env>/torch_extensions`, and every DeepSpeed process of that environment points `TORCH_EXTENSIONS_DIR`
there before DeepSpeed is imported (`use_environment_cache`). Only the standard library is imported here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The op builders the matrix's cells load on a CPU accelerator (DeepSpeed's CPU builder classes).
OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")
#: Where the built ops live: inside the environment, so they are cached with it and dropped with it.
CACHE_NAME = "torch_extensions"


def extensions_dir() -> Path:
    return Path(sys.prefix) / CACHE_NAME


def use_environment_cache() -> None:
    """Point torch's JIT extension cache into this environment (a user's own TORCH_EXTENSIONS_DIR wins)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))


def load_all(verbose: bool = False) -> dict[str, float]:
    """Load (building where not cached) every op of `OPS`; seconds per op."""
    import time

    use_environment_cache()
    from deepspeed.accelerator import get_accelerator

    seconds = {}
    for name in OPS:
        started = time.perf_counter()
        get_accelerator().create_op_builder(name).load(verbose=verbose)
        seconds[name] = round(time.perf_counter() - started, 1)
    return seconds


def missing() -> list[str]:
    """The ops with no build in the environment's cache (a cell would compile them: refuse instead)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", extensions_dir()))
    names = {"ShareMemCommBuilder": "deepspeed_shm_comm", "FusedAdamBuilder": "fused_adam",
             "CPUAdamBuilder": "cpu_adam"}
    return [op for op, lib in names.items() if not any(root.glob(f"**/{lib}*.so"))]
