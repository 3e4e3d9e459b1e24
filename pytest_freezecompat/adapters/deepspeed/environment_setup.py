"""Run once when a DeepSpeed environment is made (`noxfile.py` runs an adapter's `environment_setup` module with the
environment's python right after the install): build DeepSpeed's C++ ops into the environment's cache."""

from __future__ import annotations

import sys

from ..deepspeed_ops import build

if __name__ == "__main__":
    sys.exit(build())
