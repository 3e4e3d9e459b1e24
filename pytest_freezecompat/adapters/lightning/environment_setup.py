"""Run once when a Lightning environment is made (`spec.environments`: nox runs it after the install): build the
DeepSpeed op the `*-deepspeed*` plugins load (`zero.OPS`) into the environment's cache, as the DeepSpeed
environments do. Only DeepSpeed is imported: the build needs no Lightning."""

from __future__ import annotations

import sys

from ..deepspeed_ops import build

#: What `init_distributed` loads on a CPU accelerator; the cells step the user's AdamW and offload nothing.
OPS = ("ShareMemCommBuilder",)

if __name__ == "__main__":
    sys.exit(build(OPS))
