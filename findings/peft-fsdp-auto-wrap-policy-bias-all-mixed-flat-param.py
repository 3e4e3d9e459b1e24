"""peft's `fsdp_auto_wrap_policy` leaves `LoraConfig(bias="all")` to FSDP1's flat-param refusal.

What a user sees: FSDP1 with flat params (`use_orig_params=False`, Accelerate's FSDP1 plugin default, which peft's
FSDP docs recommend together with this policy) around a LoRA model whose config trains the biases (`bias="all"`)
raises while wrapping:

    ValueError: Must flatten tensors with uniform requires_grad when use_orig_params=False

Mechanism: peft/utils/other.py, `fsdp_auto_wrap_policy`: its `lambda_policy_fn` gives a unit of its own only to a
leaf module whose `weight` requires grad (the LoRA A/B Linears), the rest goes to the decoder-layer units. With
`bias="all"` the frozen base Linear (`q_proj.base_layer`: weight frozen, bias trainable) is a leaf whose weight does
not require grad, so its trainable bias lands in the decoder layer's flat param beside frozen weights, which FSDP1
refuses (pytorch#91167). `bias="none"` (the control) wraps and runs.

Run: python findings/peft-fsdp-auto-wrap-policy-bias-all-mixed-flat-param.py (one CPU process, gloo).
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


def wrap(bias: str) -> tuple[str, list[str]]:
    """'wrapped' or the error FSDP1 raised, for a LoRA tiny Llama with LoraConfig(bias=bias) under peft's policy;
    and the leaf modules with a frozen weight and a trainable bias that the policy gives no unit of their own."""
    from peft import LoraConfig, get_peft_model
    from peft.utils.other import fsdp_auto_wrap_policy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, attention_bias=True))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], bias=bias))
    policy = fsdp_auto_wrap_policy(model)
    # other.py, fsdp_auto_wrap_policy's lambda_policy_fn: a unit only for a leaf whose `weight` requires grad
    mixed = [name for name, module in model.named_modules()
             if not list(module.children()) and getattr(module, "weight", None) is not None
             and getattr(module, "bias", None) is not None
             and not module.weight.requires_grad and module.bias.requires_grad
             and not policy(module=module, recurse=False, nonwrapped_numel=0)]
    try:
        FSDP(model, auto_wrap_policy=policy, use_orig_params=False, device_id=torch.device("cpu"))
    except ValueError as error:
        return f"raised: {error}", mixed
    return "wrapped", mixed


def main() -> int:
    warnings.simplefilter("ignore")
    import peft

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        (control, _), (biased, mixed) = wrap("none"), wrap("all")
    finally:
        dist.destroy_process_group()
    print(f"peft {peft.__version__}, torch {torch.__version__}: FSDP1 (use_orig_params=False) with peft's "
          "fsdp_auto_wrap_policy around a LoRA tiny Llama (attention biases)")
    print(f"bias='none': expected wrapped, actual {control}")
    print(f"bias='all': expected wrapped, actual {biased}")
    print(f"bias='all': leaves with a frozen weight and a trainable bias the policy does not wrap apart: {mixed}")
    # torch/distributed/fsdp/_flat_param.py, FlatParamHandle._validate_tensors_to_flatten
    refused = biased == "raised: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`"
    if control == "wrapped" and refused and any(name.endswith("q_proj.base_layer") for name in mixed):
        print("REPRODUCED: the policy leaves bias='all' biases in a flat param with frozen weights")
        return 0
    if control == "wrapped" and biased == "wrapped":
        print("NOT REPRODUCED: the policy wraps bias='all' apart")
        return 1
    print("the script is broken here: the control did not wrap, or bias='all' raised something else")
    return 2


if __name__ == "__main__":
    sys.exit(main())
