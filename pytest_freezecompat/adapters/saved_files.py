"""What a model checkpoint holds, read back from its files: the `resume` check's view of the saved files.

Two formats cover the stacks: a `torch.save`d dict (a full state dict) and a `torch.distributed.checkpoint`
folder, whose metadata names every key without loading a tensor. Names come back as the bare model's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .loop import Saved

Rename = Callable[[str], str]


def _same(name: str) -> str:
    return name


def state_names(keys: Iterable[str], rename: Rename = _same) -> frozenset[str]:
    """`blocks.0.w.exp_avg` -> `blocks.0.w`: the params a flat key list of optimizer state stands for."""
    return frozenset(rename(key.rpartition(".")[0]) for key in keys)


def dcp_keys(directory: Path) -> list[str]:
    """Every key a `torch.distributed.checkpoint` folder holds (its metadata only; no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)


def dcp_contents(directory: Path, model_key: str = "model", optim_key: str = "optim",
                 rename: Rename = _same) -> Saved:
    """A DCP folder saved as `{model_key: model state dict, optim_key: optimizer state dict}` with the
    optimizer's state keyed by parameter name (`get_state_dict`, `FSDP.optim_state_dict`)."""
    keys = dcp_keys(directory)
    model, state = f"{model_key}.", f"{optim_key}.state."
    return Saved(frozenset(rename(k[len(model):]) for k in keys if k.startswith(model)),
                 state_names((k[len(state):] for k in keys if k.startswith(state)), rename))


def load_file(path: Path) -> Any:
    """A `torch.save`d checkpoint, on the CPU (ours, so its pickles are trusted; never one from a socket)."""
    return torch.load(path, map_location="cpu", weights_only=False)


def index_names(named: Mapping[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """A plain optimizer's state dict keys params by their index over its groups: index -> the name `named` gives
    that param (a param `named` lacks is shown by its shape, so that a check names it)."""
    names = {id(param): name for name, param in named.items()}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    return {i: names.get(id(p), f"<not a model param: {tuple(p.shape)}>") for i, p in enumerate(params)}


def full_contents(model_state: Mapping[str, Any], optim_state: Mapping[Any, Any], names_of: Mapping[Any, str],
                  rename: Rename = _same) -> Saved:
    """A full state dict and an optimizer's `state` (keyed by `names_of`'s keys: indices or names)."""
    return Saved(frozenset(rename(k) for k in model_state),
                 frozenset(rename(names_of.get(k, str(k))) for k, v in optim_state.items() if v))
