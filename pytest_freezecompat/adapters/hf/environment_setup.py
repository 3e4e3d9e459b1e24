"""Run once when a Hugging Face environment is made (`spec.environments`: nox runs it after the install): build the
DeepSpeed ops the `*-zero*` plugins load into the environment's cache, as the DeepSpeed environments do."""

from __future__ import annotations

import sys

from ..deepspeed_ops import build

#: What Accelerate's DeepSpeed path loads on a CPU accelerator: the shared-memory comm op (`init_distributed`). The
#: cells step the user's AdamW (the Trainer's: `create_optimizer`) and offload nothing, so neither FusedAdam nor CPU
#: Adam: ~10 min of builds an environment spared.
OPS = ("ShareMemCommBuilder",)

if __name__ == "__main__":
    sys.exit(build(OPS))
