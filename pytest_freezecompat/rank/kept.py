"""What a rank keeps from one clean cell to the next: its default process group and a framework's parallel state.

A rank joins its default group at its first cell and keeps it while cells end cleanly, or in a refusal every
rank raised alike (`controller.pool.refused_alike`); after any other error, a crash, timeout or disagreement the
controller replaces the rank (a fork: milliseconds), so nothing of a bad cell survives. Between kept cells `tidy`
removes what a cell may leave: the groups
it made (other than the world and kept framework state), its garbage, and the torch globals a cell can
change. `collectives` is the proof the controller asks for before keeping a group: every rank ran the
same number of collectives on every group it shares (a stray op would meet the next cell's first one).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..adapters.views import settle_groups


def _groups() -> list[dist.ProcessGroup]:
    return list(c10d._world.pg_map)


def collectives() -> dict[str, int]:
    """Group name -> collectives this rank issued on it (the group's sequence number), for every live group."""
    if not dist.is_initialized():
        return {}
    return {c10d._world.pg_names[group]: group._get_sequence_number_for_group() for group in _groups()}


class KeptState:
    """Framework state that lives as long as the rank's default group, one entry per name, rebuilt when its
    key changes (Megatron's model-parallel groups for a (tp, pp) layout). `RunContext.kept` hands it to adapters."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Hashable, Callable[[], None], set[dist.ProcessGroup]]] = {}

    @property
    def groups(self) -> set[dist.ProcessGroup]:
        """The groups made while creating kept state: `tidy` leaves them."""
        return {group for _, _, groups in self._entries.values() for group in groups}

    def ensure(self, name: str, key: Hashable, create: Callable[[], None], release: Callable[[], None]) -> bool:
        """Create the state `name` for `key` unless it is already there for that key; True when it was kept.
        State for another key is released first (its groups are then destroyed when the cell is tidied)."""
        entry = self._entries.get(name)
        if entry is not None and entry[0] == key:
            return True
        if entry is not None:
            entry[1]()
            del self._entries[name]
        before = set(_groups())
        create()
        self._entries[name] = (key, release, set(_groups()) - before)
        return False


def tidy(kept: KeptState) -> None:
    """After a kept cell (clean, or refused alike): let the groups settle (`settle_groups`) where it made any,
    collect the cell's garbage (a framework object's finalizer may destroy its own groups), then destroy the groups
    it made, and put back the torch globals a cell may have changed. Every rank tidies at once (a collective).

    What survives the collection lives on with the rank (caches, lazy imports, a framework's registries): it is
    frozen out of the collector's sight as the template's imports are, so the next cell's collections (this one's,
    and those a framework makes: DeepSpeed's ZeRO-3 `defragment` calls `gc.collect()` at every engine's
    construction) scan only what that cell made. In a ZeRO-3 slice those two collections took a third of the
    ranks' CPU under py-spy: 128.6 -> 109.3 s of cell time for its 260 cells, the ranks' peak RSS unchanged."""
    world = c10d._get_default_group()

    def made() -> list[dist.ProcessGroup]:
        """The cell's groups still alive (a finalizer may destroy some during the collection): the same on every
        rank."""
        return [group for group in _groups() if group is not world and group not in kept.groups]

    if made():
        settle_groups()  # (torch < 2.8: a barrier per group and a sleep) only where a group is to be destroyed
    gc.collect()
    gc.freeze()
    for group in made():
        dist.destroy_process_group(group)
    torch.set_grad_enabled(True)
    torch.set_default_dtype(torch.float32)
