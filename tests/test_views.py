"""The one name mapping: wrapped parameter names (and FSDP1 flat params) back to the bare model's."""

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pytest_freezecompat.adapters import views
from pytest_freezecompat.adapters.views import CHECKPOINT_WRAPPER_INFIXES


class _Flat(nn.Parameter):
    """Stands in for an FSDP1 FlatParameter: what matters to the mapping is `_fqns`."""


def _flat(fqns: list[str]) -> nn.Parameter:
    param = _Flat(torch.zeros(1))
    param._fqns = fqns
    return param


@pytest.mark.parametrize(("wrapped", "bare"), [
    ("blocks.0.ln1.weight", "blocks.0.ln1.weight"),  # DDP (read from shell.model) and FSDP2
    ("blocks.0._checkpoint_wrapped_module.ln1.weight", "blocks.0.ln1.weight"),  # FSDP2 + Composer's checkpointing
    ("_fsdp_wrapped_module.blocks.0._fsdp_wrapped_module.qkv.lora_a", "blocks.0.qkv.lora_a"),  # FSDP1 orig params
    ("_fsdp_wrapped_module.blocks.1._fsdp_wrapped_module._checkpoint_wrapped_module.fc1.bias", "blocks.1.fc1.bias"),
])
def test_wrapped_names_map_back_to_the_bare_model(wrapped: str, bare: str) -> None:
    assert views.original_names(wrapped, nn.Parameter(torch.zeros(1)), CHECKPOINT_WRAPPER_INFIXES) == [bare]


def test_a_flat_param_stands_for_every_param_folded_into_it() -> None:
    block = _flat(["ln1.weight", "_checkpoint_wrapped_module.fc1.bias"])
    root = _flat(["tok_emb.weight", "head.bias"])
    assert views.original_names("_fsdp_wrapped_module.blocks.2._fsdp_wrapped_module._flat_param", block,
                                CHECKPOINT_WRAPPER_INFIXES) == [
        "blocks.2.ln1.weight", "blocks.2.fc1.bias"]
    assert views.original_names("_fsdp_wrapped_module._flat_param", root) == ["tok_emb.weight", "head.bias"]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_each_ranks_dim0_shard_is_a_torch_chunk(ranks: int) -> None:
    for length in range(12):
        chunks = [len(chunk) for chunk in torch.arange(length).chunk(ranks)] if length else []
        assert views.dim0_shard_rows(length, ranks) == chunks + [0] * (ranks - len(chunks)), length


def _read_both_ways(rank: int, init_file: str, results: Any) -> None:
    """One rank of two: FSDP2 shards of uneven rows (3 and 1 over 2 ranks: one shard empty), a replicated DTensor
    (not batched) and a missing grad, read by `full_tensors` and by each DTensor's own `full_tensor()`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
        model[1].bias.requires_grad_(False)
        fully_shard(model)
        model(torch.randn(5, 4)).sum().backward()
        mesh = init_device_mesh("cpu", (2,))
        replicated = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh, [Replicate()])
        read = {**{n: p.detach() for n, p in model.named_parameters()}, "replicated": replicated,
                **{f"{n}.grad": p.grad for n, p in model.named_parameters()}}
        batched = views.full_tensors(read)
        one_by_one = {n: None if t is None else t.full_tensor() for n, t in read.items()}
        same = all((a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                                 and torch.equal(a, b)) for a, b in
                   zip(batched.values(), one_by_one.values()))
        results.put((rank, f"same={same} missing={[n for n, t in batched.items() if t is None]}"))
    finally:
        dist.destroy_process_group()


def test_dtensors_read_together_equal_each_read_alone(tmp_path: Path) -> None:
    import multiprocessing

    if not hasattr(pytest.importorskip("torch.distributed.fsdp"), "fully_shard"):
        pytest.skip("this torch has no torch.distributed.fsdp.fully_shard")
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_read_both_ways, args=(rank, str(tmp_path / "init"), results)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=60)
    assert [process.exitcode for process in ranks] == [0, 0]
    assert sorted(results.get(timeout=5) for _ in ranks) == [(0, "same=True missing=['1.bias.grad']"),
                                                             (1, "same=True missing=['1.bias.grad']")]
