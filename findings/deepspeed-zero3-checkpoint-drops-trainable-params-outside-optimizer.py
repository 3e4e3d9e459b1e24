"""ZeRO-3's checkpoint holds a param that requires grad but is left out of the optimizer nowhere.

What a user sees: every param requires grad, the optimizer is given a subset (a second stage of training, a
head trained first, params the user steps by hand...). Under ZeRO-3, `engine.save_checkpoint` writes no copy of
the params outside the optimizer: the model-states file's `module` holds only ZeRO-3's empty placeholders, the
optimizer shards' flat fp32 partitions (`param_shapes`) hold the optimizer's params, and `frozen_param_fragments`
holds the params that do not require grad. `load_checkpoint` leaves them at whatever the fresh model has, and
`zero_to_fp32` (`get_fp32_state_dict_from_zero_checkpoint`) returns a state dict without them. Stages 0-2 keep them
in the `module` state dict (full tensors), so their round trip holds; `zero_to_fp32` still drops them at stages 1-2
(`deepspeed/utils/zero_to_fp32.py`, `_get_fp32_state_dict_from_zero2_checkpoint`, takes only buffers from `module`).

Mechanism: `deepspeed/runtime/engine.py`, `DeepSpeedEngine._get_zero_frozen_param_attributes` (what
`_save_checkpoint` stores as `frozen_param_fragments` when ZeRO partitions gradients) skips every param "owned by
the optimizer", and decides that from the param alone: DeepSpeed 0.19.2 `if param.requires_grad: continue`;
0.19.8 `if is_optimized_parameter(param): continue`, where `deepspeed/runtime/utils.py`'s
`is_optimized_parameter` is `param.requires_grad and numel > 0`. `param_shapes` (`_get_zero_param_shapes`) is
built from the optimizer's groups (`fp16_groups` at stage 3). A param that requires grad and is outside those
groups is in neither.

Workaround: set requires_grad=False on params the optimizer does not hold before `deepspeed.initialize` (they are
then saved as frozen fragments), or save them yourself (`GatheredParameters` + `torch.save`).

Run: python findings/deepspeed-zero3-checkpoint-drops-trainable-params-outside-optimizer.py (CPU, gloo, one
process).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

# DeepSpeed's CPU accelerator compiles its shared-memory comm op at init_distributed unless it is cached: use the
# environment's cache where one was built (a user's own TORCH_EXTENSIONS_DIR wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import deepspeed
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn

TAG = "step1"
HELD = "held.weight"


class Model(nn.Module):
    """Both Linears require grad; only `trained` goes to the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.held = nn.Linear(4, 4, bias=False)
        self.trained = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(self.held(x))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def names_in_files(folder: Path) -> dict[str, set[str]]:
    """Which param names each place of a DeepSpeed checkpoint holds (a tensor with elements, or a flat slot)."""
    states = next(folder.glob("*mp_rank_00_model_states.pt"))
    saved = torch.load(states, map_location="cpu", weights_only=False)
    module = {name for name, t in (saved.get("module") or {}).items() if t.numel() > 0}
    shapes = {name for group in (saved.get("param_shapes") or []) for name in group}
    frozen = set(saved.get("frozen_param_fragments") or {})
    return {f"{states.name}: module": module, f"{states.name}: param_shapes (optimizer shards)": shapes,
            f"{states.name}: frozen_param_fragments": frozen}


def save_one_step(stage: int, folder: Path) -> None:
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.AdamW(model.trained.parameters(), lr=0.1)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    assert all(p.requires_grad for p in engine.module.parameters())
    engine.backward(engine(torch.ones(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(str(folder), tag=TAG)
    engine.destroy()


def main() -> int:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    deepspeed.utils.logger.setLevel("WARNING")
    deepspeed.init_distributed(dist_backend="gloo")
    print(f"deepspeed {deepspeed.__version__}, torch {torch.__version__}; {HELD} requires grad, not in the optimizer")
    found: dict[int, bool] = {}
    optimizer_held: dict[int, bool] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (2, 3):
            folder = Path(tmp) / f"zero{stage}"
            save_one_step(stage, folder)
            places = names_in_files(folder / TAG)
            holding = [place for place, names in places.items() if HELD in names]
            consolidated = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=TAG)
            found[stage] = bool(holding)
            # control: the optimizer's own param is in the optimizer shards (param_shapes, from _get_zero_param_shapes)
            optimizer_held[stage] = any(place.endswith("param_shapes (optimizer shards)") and "trained.weight" in names
                                        for place, names in places.items())
            print(f"ZeRO stage {stage}: {HELD} expected in a checkpoint file, actual: saved in {holding or 'no file'}; "
                  f"trained.weight in param_shapes: {optimizer_held[stage]}; zero_to_fp32 state dict keys: "
                  f"{sorted(consolidated)}")
    if not optimizer_held[3]:
        raise AssertionError("unexpected state: the ZeRO-3 checkpoint's param_shapes lack trained.weight too")
    if not found[3]:
        print(f"REPRODUCED: under ZeRO-3, {HELD} (requires grad, outside the optimizer) is in no checkpoint file "
              f"and missing from zero_to_fp32's state dict (ZeRO-2: {'in' if found[2] else 'not in'} its module "
              f"state dict)")
        return 0
    print(f"NOT REPRODUCED: under ZeRO-3 the checkpoint holds {HELD}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
