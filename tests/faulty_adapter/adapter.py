"""The misbehaving adapter: hangs, crashes a rank, raises on one rank, dies after replying, or trains with real DDP."""

from __future__ import annotations

import os
import signal
import sys
import time

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
        elif plugin == "die-while-leaving" and ctx.rank == 1:
            # The rank replies, then exits where it would leave the cell's group (the rank loop's own step).
            sys.modules["pytest_freezecompat.rank.main"]._leave_group = lambda: os._exit(3)
        elif plugin == "raise-on-rank-1":
            if ctx.rank == 1:
                raise RuntimeError("deliberate failure on rank 1")
            dist.barrier()  # rank 0 waits for a peer that will never come
        if plugin.startswith("ok") or plugin == "die-while-leaving":
            TorchAdapter().run_plugin(ctx, "ddp")  # real DDP training on the restarted pool
        else:
            dist.barrier()
