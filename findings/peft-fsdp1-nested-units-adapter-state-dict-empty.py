"""peft 0.21: get_peft_model_state_dict returns {} for a LoRA model wrapped in nested FSDP1 units (silent).

What a user sees: the Transformers Trainer with FSDP1 around a PeftModel wraps every decoder layer in its own FSDP
unit (and, through peft's fsdp_auto_wrap_policy, every LoRA Linear). On peft 0.21 its checkpoints hold no adapter:
adapter_model.safetensors and pytorch_model_fsdp.bin (accelerate's save_fsdp_model(adapter_only=True)) are empty,
nothing raises, and resume_from_checkpoint restarts the adapter from its init.

Mechanism (peft 0.21.2, peft/tuners/tuners_utils.py, _get_tuner_state_dict_key_prefixes, used by
BaseTuner._get_adapter_state_dict since PR #3490 "Refactor state dict handling"): the adapter's keys are selected
by prefixes built from model.named_modules(), and only a *leading* "_fsdp_wrapped_module." is removed
(`module_name.removeprefix("_fsdp_wrapped_module.")`). Inside a nested FSDP1 unit a tuner layer is named
"_fsdp_wrapped_module.base_model.model.layers.0._fsdp_wrapped_module.q_proj", while FSDP's state dict strips every
"_fsdp_wrapped_module." ("base_model.model.layers.0.q_proj.lora_A.default.weight"), so no prefix matches any key.
peft <= 0.20.0 selected keys by name ("lora_" in the key) and returns the adapter.

Checks: the adapter state dict of the unwrapped PeftModel (4 keys: lora_A/lora_B of q_proj and v_proj) is the
expected value. Under FSDP1 with one unit per Block plus peft's fsdp_auto_wrap_policy, it is taken the two ways the
Trainer takes it: get_peft_model_state_dict(fsdp_model) inside FSDP.state_dict_type(FULL_STATE_DICT) (accelerate's
save_fsdp_model with adapter_only=True), and get_peft_model_state_dict(peft_model, state_dict=<FSDP full state
dict>) (PeftModel.save_pretrained(state_dict=...), the Trainer's adapter_model.safetensors). A control wraps the
same model with peft's policy alone (the LoRA Linears nested, the Block not): its tuner layers carry only the
leading prefix, and the adapter state dict is the expected one on every release.
REPRODUCED (exit 0): both nested results are {} while the FSDP full state dict holds the 4 LoRA tensors and the
control returns the expected keys and values. NOT REPRODUCED (exit 1): both nested results equal the expected keys
and values. Anything else: exit 2 (the script is broken here).

Run (CPU, gloo, one process):   python findings/peft-fsdp1-nested-units-adapter-state-dict-empty.py
Run (CPU, gloo, two processes): torchrun --nproc_per_node 2 findings/peft-fsdp1-nested-units-adapter-state-dict-empty.py
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

EXPECTED = [f"base_model.model.layers.0.{proj}.{lora}.weight" for proj in ("q_proj", "v_proj")
            for lora in ("lora_A", "lora_B")]


class Block(nn.Module):  # stands for a decoder layer: the unit transformers' _no_split_modules names
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(8, 8)
        self.v_proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.v_proj(torch.relu(self.q_proj(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    warnings.simplefilter("ignore")
    import peft
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if "RANK" not in os.environ:  # plain `python`: one gloo process
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tag = f"[rank {rank}/{world}]"

    def peft_model() -> nn.Module:
        torch.manual_seed(0)
        # init_lora_weights=False: lora_B is not zero, so the values below are checked, not only the keys
        return get_peft_model(Net(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    def show(label: str, state: dict[str, torch.Tensor]) -> None:
        print(f"{tag} {label}: {len(state)} keys {sorted(state)}")

    print(f"{tag} peft {peft.__version__}, torch {torch.__version__}, gloo on cpu, world size {world}")
    try:
        reference = peft_model()
        expected = {k: v.detach().clone() for k, v in get_peft_model_state_dict(reference).items()}

        results = {}
        for case, block_units in (("nested", True), ("control", False)):
            model = peft_model()
            # FSDP_TRANSFORMER_CLS_TO_WRAP is peft's own knob (Accelerate's fsdp_transformer_layer_cls_to_wrap);
            # for a transformers model, peft takes the class from model._no_split_modules.
            os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = "Block" if block_units else ""
            wrapped = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
                           device_id=torch.device("cpu"))
            tuner_name = next(n for n, m in wrapped.named_modules() if isinstance(m, BaseTunerLayer))
            with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
                full = wrapped.state_dict()
                via_fsdp = get_peft_model_state_dict(wrapped)  # accelerate: save_fsdp_model(adapter_only=True)
            via_save_pretrained = get_peft_model_state_dict(wrapped.module, state_dict=full)  # save_pretrained
            results[case] = (via_fsdp, via_save_pretrained, full)
            print(f"{tag} {case}: FSDP1 units: root, {'Block, ' if block_units else ''}each LoRA Linear "
                  f"(peft's fsdp_auto_wrap_policy{' + Block' if block_units else ''})")
            print(f"{tag}   tuner layer name in named_modules(): {tuner_name}")
            print(f"{tag}   peft strips the leading prefix only:  {tuner_name.removeprefix('_fsdp_wrapped_module.')}")
            print(f"{tag}   FSDP full state dict, LoRA keys:      {sorted(k for k in full if '.lora_' in k)}")
            show("  get_peft_model_state_dict(fsdp_model)", via_fsdp)
            show("  get_peft_model_state_dict(peft_model, state_dict=full)", via_save_pretrained)
            del wrapped, model
    finally:
        dist.destroy_process_group()

    def matches(state: dict[str, torch.Tensor]) -> bool:
        return sorted(state) == EXPECTED and all(torch.equal(state[k], expected[k]) for k in EXPECTED)

    print(f"{tag} expected (unwrapped PeftModel): {len(expected)} keys {sorted(expected)}")
    if sorted(expected) != EXPECTED:
        print(f"{tag} the script is broken here: the unwrapped model's adapter state dict is {sorted(expected)}")
        return 2
    via_fsdp, via_save_pretrained, full = results["nested"]
    lora_in_full = [k for k in full if ".lora_" in k]
    control_ok = all(matches(state) for state in results["control"][:2])
    if via_fsdp == {} and via_save_pretrained == {} and len(lora_in_full) == len(EXPECTED) and control_ok:
        print(f"REPRODUCED: under nested FSDP1 units get_peft_model_state_dict returns {{}} both ways, expected "
              f"{len(EXPECTED)} lora_A/lora_B keys (FSDP's full state dict holds all {len(lora_in_full)}; the control, "
              f"whose tuner layers carry only the leading '_fsdp_wrapped_module.', returns them)")
        return 0
    if matches(via_fsdp) and matches(via_save_pretrained):
        print(f"NOT REPRODUCED: under nested FSDP1 units get_peft_model_state_dict returns the expected "
              f"{len(EXPECTED)} keys with the unwrapped model's values, both ways")
        return 1
    print(f"{tag} the script is broken here: neither {{}} nor the expected keys (control as expected: {control_ok})")
    return 2


if __name__ == "__main__":
    sys.exit(main())
