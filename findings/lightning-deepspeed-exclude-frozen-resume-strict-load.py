"""Lightning cannot resume from its own DeepSpeed checkpoint once `exclude_frozen_parameters=True` leaves the frozen
params out of it.

What a user sees: a model with a frozen part, `Trainer(strategy=DeepSpeedStrategy(stage=2,
exclude_frozen_parameters=True))`, `trainer.fit(model)`, `trainer.save_checkpoint(path)`; the resume, a fresh model
and a fresh Trainer with the same strategy, `trainer.fit(model, ckpt_path=path)`, raises before its first step

    RuntimeError: Error(s) in loading state_dict for ...:
        Missing key(s) in state_dict: "frozen.weight", "frozen.bias".

and the run cannot go on. Fabric the same: `fabric.save(path, {"model": model, "optimizer": optimizer})` with
`DeepSpeedStrategy(..., exclude_frozen_parameters=True)`, then `fabric.load(path, state)` into a fresh setup raises
the same error. The frozen params are exactly the ones the option leaves out.

Mechanism: `exclude_frozen_parameters` (lightning 2.5.5, PR #21060, for issue #20949) is passed by both strategies'
`save_checkpoint` (lightning/pytorch/strategies/deepspeed.py and lightning/fabric/strategies/deepspeed.py,
`DeepSpeedStrategy.save_checkpoint`) to DeepSpeed's `engine.save_checkpoint`, whose `module` state dict then holds
only the params that require grad. Their `load_checkpoint` loads it back with `engine.load_checkpoint(...,
load_module_strict=...)`: the Trainer passes `self.lightning_module.strict_loading` (True unless the user sets it),
Fabric passes `fabric.load`'s `strict` (default True); DeepSpeed hands it to the module's `load_state_dict(...,
strict=...)`, which raises for every frozen param. Neither strategy loads non-strictly when it excluded the frozen
params itself, as mmengine's DeepSpeedStrategy does (`load_module_strict=not self.exclude_frozen_parameters`, PR
#1424).

Checks, for the Trainer and for Fabric: one step (nn.Linear `frozen` requires no grad, nn.Linear `trained` does,
AdamW over `trained`), save, and the checkpoint's `module` state dict listed; then a fresh model (the same frozen
weights, other trainable ones) resumed from it. Expected: the resume loads the checkpoint the same strategy wrote,
the trainable weights equal to the saved ones. Controls: the same resume with `strict_loading = False` on the
LightningModule (the Trainer) or `fabric.load(..., strict=False)` loads and restores the trainable weights equal to
the saved ones (the workaround). REPRODUCED (exit 0): for both the Trainer and Fabric, the module state dict lacks
the frozen params, the strict resume raises "Missing key(s) in state_dict" naming exactly them, and the non-strict
control restores the saved trainable weights. NOT REPRODUCED (exit 1): for both, the strict resume loads and restores
the saved weights. A release whose DeepSpeedStrategy has no `exclude_frozen_parameters` (lightning < 2.5.5) runs the
same checks without it (its checkpoints hold the frozen params): NOT REPRODUCED there. Anything else: exit 2 (the
script is broken here).

Run: python findings/lightning-deepspeed-exclude-frozen-resume-strict-load.py (one process; CPU with gloo, or one
GPU). Lightning's DeepSpeed strategies refuse any accelerator but CUDA, although DeepSpeed runs on its CPU
accelerator with gloo: without CUDA, `cpu_as_cuda_host` makes three patches, device plumbing only (each
strategy's CUDA-only check accepts the CPU accelerator; the check that each CUDA index is the local rank passes
for CPU devices, which have no index; DeepSpeed's engine takes its local rank when Lightning hands it
`device_rank=None`, the CPU device's index, as it does when given no args). Saving and loading run as shipped. On a
host with CUDA they are not applied.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import socket
import sys
import tempfile
import traceback
import warnings
from pathlib import Path
from typing import Any

# DeepSpeed's CPU accelerator compiles its shared-memory comm op at init_distributed unless it is cached: use the
# environment's cache where one was built (a user's own TORCH_EXTENSIONS_DIR wins).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

import deepspeed
import lightning
import lightning.fabric.strategies.deepspeed as fabric_deepspeed
import lightning.pytorch.strategies.deepspeed as trainer_deepspeed
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FROZEN = ["frozen.weight", "frozen.bias"]
MISSING = "Missing key(s) in state_dict"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_as_cuda_host() -> bool:
    """Device plumbing, without CUDA only: Lightning's DeepSpeed strategies on DeepSpeed's CPU accelerator (gloo)."""
    if torch.cuda.is_available():
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine
    from lightning.fabric.accelerators import CPUAccelerator as FabricCPU
    from lightning.pytorch.accelerators import CPUAccelerator as TrainerCPU

    # (a) setup_environment's `isinstance(self.accelerator, CUDAAccelerator)` check accepts the CPU accelerator
    trainer_deepspeed.CUDAAccelerator = TrainerCPU
    fabric_deepspeed.CUDAAccelerator = FabricCPU

    # (b) each CUDA device's index must be its local rank: a CPU device has no index
    def validate_device_index_selection(parallel_devices: list[torch.device], original: Any) -> None:
        if not all(device.type == "cpu" for device in parallel_devices):
            original(parallel_devices)

    for module in (trainer_deepspeed, fabric_deepspeed):
        original = module._validate_device_index_selection
        module._validate_device_index_selection = (
            lambda devices, original=original: validate_device_index_selection(devices, original))

    # (c) deepspeed.initialize(args=Namespace(device_rank=root_device.index)): None on the CPU, which the engine
    # compares with 0; without args it takes its local rank
    set_distributed_vars = DeepSpeedEngine._set_distributed_vars

    def distributed_vars(engine: DeepSpeedEngine, args: Any) -> Any:
        if isinstance(args, argparse.Namespace) and getattr(args, "device_rank", 0) is None:
            args = None
        return set_distributed_vars(engine, args)

    DeepSpeedEngine._set_distributed_vars = distributed_vars
    return True


class Model(LightningModule):
    """`frozen` (a pretrained part, requires no grad) then `trained`; AdamW over the params that require grad."""

    def __init__(self, trainable_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        torch.manual_seed(trainable_seed)
        self.trained = nn.Linear(4, 1)
        self.at_train_start: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trained(self.frozen(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.1)

    def on_train_start(self) -> None:  # after the resume loaded the checkpoint, before the next step
        self.at_train_start = trainable(self)


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if name.startswith("trained.")}


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def module_keys(folder: Path) -> list[str]:
    """The names in the checkpoint's `module` state dict (Lightning's wrapper prefixes stripped)."""
    states = next((folder / "checkpoint").glob("*mp_rank_00_model_states.pt"))
    saved = torch.load(states, map_location="cpu", weights_only=False)
    return sorted(key.removeprefix("_forward_module.").removeprefix("module.") for key in saved["module"])


def missing_keys(error: BaseException | None) -> list[str] | None:
    """The keys torch's load_state_dict says are missing, or None if the error is not that one."""
    if not isinstance(error, RuntimeError) or MISSING not in str(error):
        return None
    listed = str(error).split(MISSING + ":", 1)[1].split(".\n", 1)[0].split("Unexpected", 1)[0]
    return sorted(key.strip().strip('".').removeprefix("_forward_module.").removeprefix("module.")
                  for key in listed.split(",") if key.strip())


def first_line(error: BaseException | None) -> str:
    if error is None:
        return "no error"
    return f"{type(error).__name__}: " + " ".join(str(error).split())[:220]


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.ones(2, 4)), batch_size=2)  # one step per epoch


def options(shimmed: bool, exclude: bool) -> dict[str, Any]:
    """DeepSpeedStrategy's keywords: the option under test where the release has it, gloo on the CPU."""
    return {**({"exclude_frozen_parameters": True} if exclude else {}),
            **({"process_group_backend": "gloo"} if shimmed else {})}


def trainer(shimmed: bool, exclude: bool, epochs: int) -> Trainer:
    strategy = trainer_deepspeed.DeepSpeedStrategy(stage=2, **options(shimmed, exclude))
    return Trainer(accelerator="cpu" if shimmed else "gpu", devices=1, strategy=strategy, max_epochs=epochs,
                   logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def trainer_round_trip(shimmed: bool, exclude: bool, folder: Path) -> dict[str, Any]:
    """fit one epoch, save_checkpoint; a fresh model + Trainer fit(ckpt_path=...) strictly, then non-strictly."""
    model = Model(trainable_seed=1)
    first = trainer(shimmed, exclude, epochs=1)
    first.fit(model, data())
    first.save_checkpoint(folder)
    out: dict[str, Any] = {"saved": trainable(model), "keys": module_keys(folder)}
    for strict in (True, False):
        fresh = Model(trainable_seed=2)
        if not strict:  # the workaround; otherwise LightningModule's default (strict_loading is True)
            fresh.strict_loading = False
        out[f"fresh {strict}"] = trainable(fresh)
        error = None
        try:
            trainer(shimmed, exclude, epochs=2).fit(fresh, data(), ckpt_path=folder)
        except RuntimeError as caught:
            error = caught
        out[f"error {strict}"], out[f"loaded {strict}"] = error, fresh.at_train_start
    return out


def fabric_round_trip(shimmed: bool, exclude: bool, folder: Path) -> dict[str, Any]:
    """setup, one step, fabric.save; a fresh Fabric + model setup, fabric.load strictly, then non-strictly."""

    def set_up(seed: int) -> tuple[Fabric, Any, Any]:
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                  "zero_allow_untested_optimizer": True}
        strategy = fabric_deepspeed.DeepSpeedStrategy(config=config, **options(shimmed, exclude))
        fabric = Fabric(accelerator="cpu" if shimmed else "gpu", devices=1, strategy=strategy)
        fabric.launch()
        model = Model(trainable_seed=seed)
        model, optimizer = fabric.setup(model, model.configure_optimizers())
        return fabric, model, optimizer

    fabric, model, optimizer = set_up(seed=1)
    fabric.backward(model(torch.ones(2, 4, device=fabric.device)).pow(2).mean())
    optimizer.step()
    fabric.save(folder, {"model": model, "optimizer": optimizer})
    out: dict[str, Any] = {"saved": trainable(model.module), "keys": module_keys(folder)}
    for strict in (True, False):
        fabric, model, optimizer = set_up(seed=2)
        out[f"fresh {strict}"] = trainable(model.module)
        error = None
        try:
            fabric.load(folder, {"model": model, "optimizer": optimizer}, strict=strict)
        except RuntimeError as caught:
            error = caught
        out[f"error {strict}"], out[f"loaded {strict}"] = error, trainable(model.module)
    return out


def report(name: str, load: str, out: dict[str, Any]) -> int:
    """Print expected against actual; 0 reproduced, 1 not reproduced, 2 neither."""
    excluded = [key for key in FROZEN if key not in out["keys"]]
    print(f"{name}: the checkpoint's module state dict holds {out['keys']} (frozen params left out: {excluded})")
    loaded = "" if out["error True"] else (
        f"; trainable weights equal to the saved ones: {equal(out['loaded True'], out['saved'])}")
    print(f"{name}: {load}, strict (the default), expected: loads, the trainable weights equal to the saved ones; "
          f"actual: {first_line(out['error True'])}{loaded}")
    control = out["error False"] is None and equal(out["loaded False"], out["saved"]) and not equal(
        out["fresh False"], out["saved"])
    print(f"{name}: control, {load} non-strict: {first_line(out['error False'])}; trainable weights equal to the "
          f"saved ones: {equal(out['loaded False'], out['saved'])} (before the load: "
          f"{equal(out['fresh False'], out['saved'])})")
    if not control:
        return 2
    if excluded == FROZEN and missing_keys(out["error True"]) == sorted(FROZEN):
        return 0
    if out["error True"] is None and equal(out["loaded True"], out["saved"]):
        return 1
    return 2


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    print(f"lightning {lightning.__version__}, deepspeed {deepspeed.__version__}, torch {torch.__version__}; "
          f"nn.Linear `frozen` (requires no grad) -> nn.Linear `trained`, AdamW over `trained`")
    has_option = {name: "exclude_frozen_parameters" in inspect.signature(module.DeepSpeedStrategy.__init__).parameters
                  for name, module in (("the Trainer", trainer_deepspeed), ("Fabric", fabric_deepspeed))}
    if len(set(has_option.values())) != 1:
        print(f"the script is broken here: exclude_frozen_parameters in DeepSpeedStrategy: {has_option}")
        return 2
    exclude = has_option["the Trainer"]
    shimmed = cpu_as_cuda_host()
    print(f"device: {'CPU, gloo (cpu_as_cuda_host: device plumbing only)' if shimmed else 'one CUDA GPU'}; "
          + ("DeepSpeedStrategy(stage 2, exclude_frozen_parameters=True)" if exclude else
             "DeepSpeedStrategy(stage 2): this release has no exclude_frozen_parameters (added in 2.5.5, PR #21060)"))
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    deepspeed.utils.logger.setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = {
            "Trainer": report("Trainer", "fit(fresh_model, ckpt_path=...)",
                              trainer_round_trip(shimmed, exclude, Path(tmp) / "trainer")),
            "Fabric": report("Fabric", "fabric.load(path, state)",
                             fabric_round_trip(shimmed, exclude, Path(tmp) / "fabric")),
        }
    if set(outcomes.values()) == {0}:
        print(f"REPRODUCED: with DeepSpeedStrategy(exclude_frozen_parameters=True) the checkpoint lacks the frozen "
              f"params {FROZEN}, and both the Trainer's fit(ckpt_path=...) and fabric.load(path, state) load it "
              f"strictly and raise RuntimeError '{MISSING}' for exactly them (non-strict loads resume with the saved "
              "weights)")
        return 0
    if set(outcomes.values()) == {1}:
        print("NOT REPRODUCED: the Trainer's fit(ckpt_path=...) and fabric.load(path, state) resume strictly from "
              + ("the checkpoint DeepSpeedStrategy(exclude_frozen_parameters=True) wrote" if exclude else
                 f"DeepSpeedStrategy's checkpoint (lightning {lightning.__version__} has no exclude_frozen_parameters: "
                 "the checkpoint holds the frozen params)") + ", with the saved weights")
        return 1
    print(f"the script is broken here: outcomes {outcomes} (0 reproduced, 1 not, 2 neither: a control that did not "
          "restore the saved weights, or another error than the frozen params' missing keys)")
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # an unexpected error is the script broken here, not a verdict
        traceback.print_exc()
        print("the script is broken here: an unexpected error (traceback above)")
        sys.exit(2)
