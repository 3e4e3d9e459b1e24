"""A tiny GPT-like LM whose output head IS its input embedding, as GPT-2, Llama 3.2 1B and Gemma ship.

    pytest examples/test_tied_lm.py

`head.weight` and `tok_emb.weight` are one tensor: `named_parameters()` lists it once, as `tok_emb.weight` (its
first name), so a pattern names the tie by that name. Freezing the embedding freezes the head; training the head
trains the embedding. Each row states the tie (`tied: head.weight = tok_emb.weight`); a stack or an init that makes
the two names two tensors is red with the reason.
"""

import torch
from torch import nn

from pytest_freezecompat import freeze_case

VOCAB, WIDTH, CONTEXT = 32, 16, 8


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.ln_2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln_1(x)).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.ln_2(x))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """One tensor for both (Hugging Face's `tie_weights()` does the same); call it again after `to_empty()`."""
        self.head.weight = self.tok_emb.weight

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
    logits = model(b["tokens"][:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), b["tokens"][:, 1:].flatten())


@freeze_case(batch=batch, loss=next_token_loss, blocks=["Block"], patterns={
    # The embedding frozen: the head, the same tensor, is frozen with it.
    "frozen-embeddings": {"frozen": ["tok_emb.*", "pos_emb.*"]},
    # `head.*` would match no parameter (the head is listed as `tok_emb.weight`): the head trains by that name,
    # and the input embedding trains with it; only untying the two would train one alone.
    "train-the-head": {"trainable": ["tok_emb.weight"]},
    # The transformer blocks alone: embedding, head and final norm frozen.
    "blocks-only": {"trainable": ["blocks.*"]},
})
def tied_lm() -> nn.Module:
    return TiedLM()
