"""A tiny LM whose frozen base is held in bfloat16 and whose LoRA adapters are float32, as PEFT keeps them.

    pytest examples/test_lora_bf16_base.py

The usual memory-saving LoRA setup: the base loaded in bf16 (`torch_dtype=torch.bfloat16`), the adapters in fp32
(PEFT's `autocast_adapter_dtype`). Each row states the dtypes the model holds (`model_dtypes: bf16 frozen, fp32
trained`) and is judged against a single-process run of the model as held, with the room its bf16 compute measured.
FSDP1 flattens a unit's params into one tensor of one dtype, so it refuses this model: the row says what to do.
"""

import torch
from torch import nn

from pytest_freezecompat import freeze_case

VOCAB, WIDTH, CONTEXT, RANK = 32, 16, 8, 4


class LoraLinear(nn.Module):
    """A bf16 base `nn.Linear` plus an fp32 low-rank update, computed as PEFT's `lora.Linear` does: the input cast
    to the adapters' dtype, their output cast back to the base's."""

    def __init__(self, features_in: int, features_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(features_in, features_out, dtype=torch.bfloat16)
        self.lora_A = nn.Linear(features_in, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, features_out, bias=False)
        # PEFT zeroes lora_B, which makes lora_A's first grads exactly zero; small values judge both from step 0.
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return self.base(x) + update.to(x.dtype)


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, LoRA on the attention's projections."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH, dtype=torch.bfloat16)
        self.qkv = LoraLinear(WIDTH, 3 * WIDTH)
        self.proj = LoraLinear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH, dtype=torch.bfloat16)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH, dtype=torch.bfloat16), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class LoraBf16LM(nn.Module):
    """Everything but the adapters in bf16: embeddings, norms, blocks and head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH, dtype=torch.bfloat16)
        self.pos_emb = nn.Embedding(CONTEXT, WIDTH, dtype=torch.bfloat16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH, dtype=torch.bfloat16)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False, dtype=torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    """Deterministic per step; the plugin gives each rank its rows."""
    tokens = torch.randint(0, VOCAB, (global_batch_size, CONTEXT + 1), generator=torch.Generator().manual_seed(step))
    return {"tokens": tokens}


def next_token_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss in fp32 from bf16 logits, as a mixed-precision trainer computes it."""
    logits = model(b["tokens"][:, :-1]).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), b["tokens"][:, 1:].flatten())


@freeze_case(batch=batch, loss=next_token_loss, blocks=["Block"], patterns={
    # Only the fp32 adapters train; the whole bf16 base is frozen (and must stay bit-identical).
    "lora-bf16-base": {"trainable": ["*.lora_*"]},
    # The adapters and the bf16 head: a trained bf16 param, judged with bf16's room.
    "lora-and-bf16-head": {"trainable": ["*.lora_*", "head.weight"]},
})
def lora_lm_bf16() -> nn.Module:
    return LoraBf16LM()
