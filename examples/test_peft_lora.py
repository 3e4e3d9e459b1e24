"""LoRA through peft, the way most people freeze today: frozen base, trainable adapters.

    pytest examples/test_peft_lora.py
"""

import pytest

pytest.importorskip("transformers")

pytest.importorskip("peft")

from hf_common import VOCAB, causal_lm_loss, token_batch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_freezecompat import freeze_case


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], patterns={
    "lora": {"trainable": ["*.lora_A.*", "*.lora_B.*"]},
})
def tiny_llama_lora() -> nn.Module:
    base = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2))
    # init_lora_weights=False: lora_B starts non-zero, so lora_A gets a real gradient from step 1.
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
