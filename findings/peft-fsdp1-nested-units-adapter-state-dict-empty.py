"""peft 0.21.2's get_peft_model_state_dict returns nothing for a model under nested FSDP1 units.

What a user sees: the Transformers Trainer with FSDP1 (`fsdp_config={"version": 1}`) around a PeftModel saves an empty
`adapter_model.safetensors` and an empty `pytorch_model_fsdp.bin` (its `save_fsdp_model(adapter_only=True)`), with no
error; `resume_from_checkpoint` then loads nothing and the adapter restarts from its init.

Mechanism: peft/tuners/tuners_utils.py, `_get_tuner_state_dict_key_prefixes` (used by
`BaseTuner._get_adapter_state_dict`, the structural selection of a method's keys that replaced matching "lora_" in
the key names) names each tuner layer from `model.named_modules()` and strips a *leading* "_fsdp_wrapped_module."
only (`removeprefix`). Under nested FSDP1 units (every decoder layer and, by peft's own `fsdp_auto_wrap_policy`,
every LoRA Linear in a unit of its own) the names keep inner "_fsdp_wrapped_module." infixes
(`...layers.0._fsdp_wrapped_module.self_attn.q_proj.lora_A`), while FSDP's state dict strips every one of them
(`...layers.0.self_attn.q_proj.lora_A.default.weight`): no prefix matches any key. peft 0.17.1 selected keys by name
("lora_" in the key) and returns the adapter.

Run: python findings/peft-fsdp1-nested-units-adapter-state-dict-empty.py (one CPU process, gloo).
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    warnings.simplefilter("ignore")
    import peft
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaConfig, LlamaForCausalLM

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=2))
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        unwrapped = sorted(get_peft_model_state_dict(model))
        # What the Trainer does for a PeftModel under FSDP1 (transformers' update_fsdp_plugin_peft).
        wrapped = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), use_orig_params=True,
                       device_id=torch.device("cpu"))
        with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
            lora_keys = [k for k in wrapped.state_dict() if "lora_" in k]
            saved = sorted(get_peft_model_state_dict(wrapped))
    finally:
        dist.destroy_process_group()
    print(f"peft {peft.__version__}, torch {torch.__version__}: a PeftModel (LoRA on q_proj, v_proj) wrapped in FSDP1 "
          f"with peft's fsdp_auto_wrap_policy; the full state dict holds {len(lora_keys)} LoRA keys")
    print(f"get_peft_model_state_dict: unwrapped {len(unwrapped)} keys, under FSDP1 {len(saved)} keys")
    if unwrapped and not saved and lora_keys:
        print("REPRODUCED: under nested FSDP1 units the adapter state dict is empty (the Trainer saves no adapter)")
        return 0
    if unwrapped and saved == unwrapped:
        print("NOT REPRODUCED: the adapter state dict under FSDP1 is the unwrapped model's")
        return 1
    print("the script is broken here: the unwrapped model's adapter state dict is empty or differs")
    return 2


if __name__ == "__main__":
    sys.exit(main())
