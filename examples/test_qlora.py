"""QLoRA: a 4-bit frozen base (bitsandbytes NF4) with peft LoRA adapters on top, the way the QLoRA recipe writes it:
`from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`, then
`prepare_model_for_kbit_training` and `get_peft_model`.

    pytest examples/test_qlora.py

The tiny Llama is saved to a temporary folder and loaded back quantized: no download. Two storage dtypes of the packed
4-bit weights, the one setting that decides whether FSDP can shard them: `uint8` (bitsandbytes' default) and
`bfloat16` (the QLoRA + FSDP recipe's). Where bitsandbytes is not installed the module is skipped.
"""

import tempfile

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

import torch
from hf_common import causal_lm_loss, token_batch
from peft import get_peft_model, prepare_model_for_kbit_training
from safetensors.torch import save_file
from test_peft_lora import LORA, lora, tiny_llama
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from transformers.utils import logging

from pytest_freezecompat import freeze_case


def qlora(storage: torch.dtype) -> nn.Module:
    """fp32 compute, so that the cell is judged at fp32's tolerance: the 4-bit weights are what is quantized.
    Built on the CPU whatever device the caller asks for: bitsandbytes quantizes real weights (a meta model has
    none), and `device_map` places them."""
    logging.disable_progress_bar()  # each rank loads the tiny model for every cell: no bar each time
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    with torch.device("cpu"), tempfile.TemporaryDirectory() as folder:
        # the checkpoint a QLoRA run loads, written by each rank for itself: save_pretrained writes on rank 0 alone
        base = tiny_llama()
        base.config.save_pretrained(folder)
        save_file(base.state_dict(), f"{folder}/model.safetensors")
        model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization,
                                                     device_map={"": "cpu"}, dtype=torch.float32)
    # A training script's model.train(): from_pretrained returns it in eval mode, where bitsandbytes 0.50 may repack
    # a frozen 4-bit weight in place on its first no-grad forward (CPUs with AVX512-BF16). Activation checkpointing
    # is the cell's checkpoint axis, not prepare_model_for_kbit_training's.
    model.train()
    return get_peft_model(prepare_model_for_kbit_training(model, use_gradient_checkpointing=False), lora())


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["hf"],
             patterns={"qlora": {"trainable": LORA}})
def tiny_llama_qlora() -> nn.Module:
    return qlora(torch.uint8)


@freeze_case(batch=token_batch, loss=causal_lm_loss, init=["eager"], frameworks=["hf"],
             patterns={"qlora": {"trainable": LORA}})
def tiny_llama_qlora_bf16_storage() -> nn.Module:
    return qlora(torch.bfloat16)
