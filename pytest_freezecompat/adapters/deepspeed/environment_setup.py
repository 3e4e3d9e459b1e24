"""Run once when a DeepSpeed environment is made (`noxfile.py` runs an adapter's `environment_setup` module with the
environment's python right after the install): build DeepSpeed's C++ ops into the environment's cache."""

from __future__ import annotations

import sys
import time

from ..deepspeed_ops import extensions_dir, load_all


def main() -> int:
    started = time.perf_counter()
    seconds = load_all(verbose=False)
    print(f"deepspeed ops built into {extensions_dir()} in {time.perf_counter() - started:.0f} s: {seconds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
