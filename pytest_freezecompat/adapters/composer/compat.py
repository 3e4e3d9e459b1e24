"""What differs between the Composer releases (and their pinned torch) the adapter runs on, 0.23.5 to 0.32.1.

Each difference is one named function, found by feature detection (an import or an attribute) rather than
by version number, so the adapter itself reads the same on every release. None of them touches what the
matrix judges: Composer's optimizer handling and FSDP wrapping run as each release ships them. Beside them, on every
release, one memo of a value Composer reads again and again from its own install (`remember_commit_hash`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

#: The first Composer release with FSDP2 (`FSDP2Config`, `fully_shard` under `parallelism_config`).
FSDP2_FROM = "0.31"


def is_dtensor(value: Any) -> bool:
    """`isinstance(value, DTensor)` wherever this torch keeps the class (public from torch 2.4 only)."""
    from ..materialize import DTensor

    return isinstance(value, DTensor)


def fsdp2_config_class() -> type | None:
    """Composer's `FSDP2Config`, or None on a release without FSDP2 (before 0.31): its FSDP cells are FSDP1.

    Rules in matrix/frameworks/composer.toml keep the fsdp2 plugins off those releases; the adapter refuses
    them with this reason if one is asked for anyway.
    """
    parallelism = importlib.import_module("composer.utils.parallelism")
    return getattr(parallelism, "FSDP2Config", None)


def fsdp2_module_classes() -> tuple[type, ...]:
    """FSDP2's `FSDPModule` (the base of the class `fully_shard` builds per module), as Composer's own
    `State.fsdp_enabled` imports it from torch 2.6 on; empty on the older torch of a release without FSDP2 (torch 2.3
    names it `FSDP`, under `_composable`), where no cell asks for it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return ()
    return (FSDPModule,)


def optimizer_load_decays_params() -> bool:
    """Whether this torch's `set_optimizer_state_dict` (Composer's optimizer load from torch 2.3) initializes a
    fresh optimizer by `step()` on zero grads at its real lr: AdamW's decoupled weight decay then shrinks every
    trainable param once more on resume (torch 2.3's `_init_optim_state`; later releases zero the lr first).
    Detected by doing it to one param; for the tests, which expect the `resume` check to see it."""
    import torch
    from torch.distributed.checkpoint import state_dict

    param = torch.nn.Parameter(torch.ones(1))
    state_dict._init_optim_state(torch.optim.AdamW([param], lr=0.1, weight_decay=0.1))
    return not torch.equal(param.detach(), torch.ones(1))


def composer_version() -> str:
    """The installed Composer release, for messages."""
    import composer

    return str(getattr(composer, "__version__", "unknown"))


def remember_commit_hash() -> None:
    """Let Composer read its own install's commit hash once per process instead of once per `Trainer`.

    `Trainer.__init__` and every checkpoint's metadata (`State._get_state_metadata`) call `get_composer_env_dict`,
    which calls `collect_env.get_composer_commit_hash`: it lists every file of Composer's distribution
    (`importlib_metadata.files`) to find `direct_url.json`, ~6% of a Composer rank's samples under py-spy
    (`benchmarks/profile_slice.py`). The answer is fixed by what is installed, so the function is memoized in place
    (the env dict reads the module's name at each call); what it returns, and all of the Trainer, are Composer's.
    """
    from composer.utils import collect_env

    if not hasattr(collect_env.get_composer_commit_hash, "cache_info"):
        collect_env.get_composer_commit_hash = functools.cache(collect_env.get_composer_commit_hash)
