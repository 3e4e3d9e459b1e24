"""A real Hugging Face architecture (Llama) from a tiny config built in code: no download.

    pytest examples/test_hf_causal_lm.py
"""

import pytest

pytest.importorskip("transformers")

from hf_common import VOCAB, causal_lm_loss, token_batch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from pytest_freezecompat import freeze_case


@freeze_case(batch=token_batch, loss=causal_lm_loss, patterns={
    "head-only": {"trainable": ["lm_head.*"]},
    "frozen-embeddings": {"frozen": ["model.embed_tokens.*"]},
    "last-layer": {"trainable": ["model.layers.1.*"]},
})
def tiny_llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2))
