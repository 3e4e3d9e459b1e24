"""The misbehaving adapter: hangs, crashes a rank, raises on one rank, dies after replying, leaves state behind
after a clean cell, or trains with real DDP."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from pytest_freezecompat.adapters.base import AdapterBase, RunContext
from pytest_freezecompat.adapters.torch_native.adapter import TorchAdapter


def wait_for_ever_in_sleep() -> None:
    while True:
        time.sleep(0.1)


class FaultyAdapter(AdapterBase):
    def run(self, ctx: RunContext) -> None:
        plugin = ctx.cell.key.plugin
        ctx.probe.phase(f"misbehave: {plugin}")
        if plugin == "hang":
            wait_for_ever_in_sleep()
        elif plugin == "crash" and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGSEGV)
        elif plugin == "die-while-tidying" and ctx.rank == 1:
            # The rank replies, then exits where it would tidy the cell away (the rank loop's own step).
            sys.modules["pytest_freezecompat.rank.main"].tidy = lambda kept: os._exit(3)
        elif plugin == "raise-on-rank-1":
            if ctx.rank == 1:
                raise RuntimeError("deliberate failure on rank 1")
            dist.barrier()  # rank 0 waits for a peer that will never come
        if plugin.startswith("ok") or plugin in ("die-while-tidying", "pollute", "stray-collective"):
            TorchAdapter().run_plugin(ctx, "ddp")  # real DDP training on the restarted pool
        else:
            dist.barrier()
        if plugin == "pollute":  # a clean cell that leaves what a kept group must not pass on
            dist.new_group(list(range(ctx.world_size)))
            if ctx.rank == 1:  # rank 0 still runs the reference after this
                torch.set_default_dtype(torch.float64)
                torch.set_grad_enabled(False)
        elif plugin == "stray-collective" and ctx.rank == 0:  # one collective more than its peer, never waited
            dist.all_reduce(torch.ones(1), async_op=True)
