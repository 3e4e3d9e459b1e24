"""A vision-language model (Qwen2-VL, CASES C6) fed a text-only batch: the vision tower gets no input.

    pytest examples/test_hf_vlm.py
"""

import pytest

pytest.importorskip("transformers")

from hf_common import VOCAB, causal_lm_loss, token_batch
from torch import nn

try:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
except ImportError:  # transformers < 4.45 (colossalai 0.4.7 pins 4.39.3): no Qwen2-VL to build
    pytest.skip("this transformers has no Qwen2-VL (from 4.45)", allow_module_level=True)

from pytest_freezecompat import freeze_case


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["torch"], patterns={
    "text-only-batch": {"frozen": [], "unused": ["model.visual.*"]},   # tower trainable, but never reached
    "frozen-vision": {"frozen": ["model.visual.*"]},
})
def tiny_qwen2_vl() -> nn.Module:
    text = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, patch_size=2, spatial_merge_size=1,
                  temporal_patch_size=1, in_channels=3, mlp_ratio=2)
    return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))
