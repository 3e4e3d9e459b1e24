"""LoRA through peft, the way most people freeze today: frozen base, trainable adapters.

    pytest examples/test_peft_lora.py

Two more peft configurations, in the Hugging Face row only: `bias="all"` (every bias trains under a frozen
weight) and `modules_to_save=["lm_head"]` (a trainable copy of the head beside the frozen original).
"""

import pytest

pytest.importorskip("transformers")

pytest.importorskip("peft")

from hf_common import VOCAB, causal_lm_loss, token_batch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_freezecompat import freeze_case

LORA = ["*.lora_A.*", "*.lora_B.*"]


def tiny_llama(**config: object) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                                        **config))


def lora(**config: object) -> LoraConfig:
    # init_lora_weights=False: lora_B starts non-zero, so lora_A gets a real gradient from step 1.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **config)


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], patterns={
    "lora": {"trainable": LORA},
})
def tiny_llama_lora() -> nn.Module:
    return get_peft_model(tiny_llama(), lora())


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["hf"], patterns={
    "lora-bias-all": {"trainable": [*LORA, "*.bias"]},
})
def tiny_llama_lora_bias_all() -> nn.Module:
    """attention_bias=True: a Llama has no bias to train otherwise."""
    return get_peft_model(tiny_llama(attention_bias=True), lora(bias="all"))


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["hf"], patterns={
    "lora-modules-to-save": {"trainable": [*LORA, "*.lm_head.modules_to_save.*"]},
})
def tiny_llama_lora_modules_to_save() -> nn.Module:
    return get_peft_model(tiny_llama(), lora(modules_to_save=["lm_head"]))


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["hf"], checkpoint=["none"], patterns={
    "lora-head-after-optimizer": {"trainable": [*LORA, "*.lm_head.*"]},
})
def tiny_llama_lora_head() -> nn.Module:
    """The head is meant to train beside the adapter but is unfrozen only after the optimizer was built (the hf row's
    rule says when: matrix/frameworks/hf.toml)."""
    return get_peft_model(tiny_llama(), lora())
