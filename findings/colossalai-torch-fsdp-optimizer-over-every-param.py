"""ColossalAI's TorchFSDPPlugin trains params the user left out of the optimizer: boost rebuilds it over every param.

What a user sees: an optimizer built over part of the model (`AdamW(model.head.parameters())`, the rest still
requiring grad, e.g. a body that should only pass gradients through, or stay fixed) is boosted with
`Booster(plugin=TorchFSDPPlugin())`. Every param of the model then moves at `optimizer.step()`, the ones outside
the optimizer too, with no error and no warning. TorchDDPPlugin, LowLevelZero, HybridParallel and Gemini keep the
user's subset.

Mechanism (colossalai/booster/plugin/torch_fsdp_plugin.py, `TorchFSDPPlugin.configure`, the same in 0.3.4, 0.4.7
and 0.5.0, and on the main branch): after wrapping the model in FSDP it re-initializes the user's optimizer in
place over the whole wrapped model,

    optimizer.__init__(fsdp_model.parameters(), **optimizer.defaults)

keeping only the optimizer's class and defaults. The one warning beside it ("TorchFSDPPlugin does not support
optimizer that use multi param groups", PR #3833) fires only for more than one param group; a single group over a
subset is widened silently. (With FSDP's default use_orig_params=False an optimizer could not hold a subset of
one flat unit anyway; here the plugin drops the subset before FSDP is asked, whatever use_orig_params says.)

Workaround: freeze what must not train (`requires_grad_(False)`; FSDP1 then needs uniformly frozen units or
use_orig_params=True), or use another plugin.

Run: python findings/colossalai-torch-fsdp-optimizer-over-every-param.py (CPU, gloo, one process). FSDP runs on
the CPU here: `torch.cuda.current_device()`, which the plugin passes to FSDP as `device_id`, answers the CPU while
`booster.boost` runs (the only stand-in; nothing of the plugin's optimizer handling is replaced).
"""

from __future__ import annotations

import os
import socket
import warnings

import torch
import torch.distributed as dist
from colossalai.booster import Booster
from colossalai.booster.plugin import TorchFSDPPlugin
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


class BodyAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boost_on_cpu(booster: Booster, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, object]:
    """`booster.boost`, with `torch.cuda.current_device()` answering the CPU (the plugin's FSDP `device_id`)."""
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        boosted, boosted_optimizer, *_ = booster.boost(model, optimizer)
    finally:
        torch.cuda.current_device = real  # type: ignore[assignment]
    return boosted, boosted_optimizer


def main() -> int:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    dist.init_process_group("gloo", rank=0, world_size=1)
    import colossalai

    torch.manual_seed(0)
    model = BodyAndHead()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=0.1)  # the user trains the head only
    head, whole = (sum(p.numel() for p in params) for params in (model.head.parameters(), model.parameters()))
    print(f"colossalai {colossalai.__version__}, torch {torch.__version__}; AdamW over head.* only; "
          f"param groups: {len(optimizer.param_groups)}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        booster = Booster(plugin=TorchFSDPPlugin())
        boosted, boosted_optimizer = boost_on_cpu(booster, model, optimizer)
    held_params = [p for g in boosted_optimizer.param_groups for p in g["params"]]
    held = sum(p.numel() for p in held_params)
    # torch_fsdp_plugin.py, TorchFSDPPlugin.configure: optimizer.__init__(fsdp_model.parameters(), **optimizer.defaults)
    rebuilt = (boosted_optimizer.optim is optimizer
               and [id(p) for p in held_params] == [id(p) for p in boosted.unwrap().parameters()])
    print(f"expected: the optimizer holds head.* only ({head} elements); actual: it holds {held} elements (whole "
          f"model: {whole}), {'exactly' if rebuilt else 'not'} the FSDP model's parameters(); warnings: "
          f"{[str(w.message)[:60] for w in caught]}")
    booster.backward(boosted(torch.ones(2, 4)).sum(), boosted_optimizer)
    boosted_optimizer.step()
    with FSDP.summon_full_params(boosted.module):
        after = {n: p.detach().clone() for n, p in boosted.unwrap().named_parameters()}
    moved = sorted(n.replace("_fsdp_wrapped_module.", "") for n, p in after.items()
                   if not torch.equal(p, before[n.replace("_fsdp_wrapped_module.", "")]))
    print(f"params that moved after one step: expected ['head.bias', 'head.weight'], actual {moved}")
    dist.destroy_process_group()
    everything = sorted(before)
    if rebuilt and held == whole and moved == everything:
        print("REPRODUCED: TorchFSDPPlugin re-initialized the optimizer over every param: body.*, left out of the "
              "optimizer, moved at optimizer.step() (no warning for a single param group)")
        return 0
    if not (held == head and moved == ["head.bias", "head.weight"]):
        raise AssertionError(f"unexpected state: optimizer holds {held} elements, moved {moved}")
    print("NOT REPRODUCED: only the params given to the optimizer moved")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
