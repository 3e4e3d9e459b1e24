"""A tiny token tagger with dropout 0.1 in every block and on the embeddings, as BERT, RoBERTa, ViT and GPT-2 ship.

    pytest examples/test_dropout_tagger.py

Under data parallelism each rank draws its own dropout masks for its own rows. A single process over the whole batch
draws other ones, so it cannot be a correct run's reference: the plugin finds that the forward draws random numbers,
names what draws them on the row, and replays each rank's rows from the generator state that rank drew from, grads
averaged. Where it cannot replay them (an accelerator's generator, micro-batches, ranks that drew apart) the row is
`unproven` and says why: held params are still judged, trained ones not.
"""

import torch
from torch import nn

from pytest_freezecompat import freeze_case

VOCAB, WIDTH, CONTEXT, TAGS, P = 32, 16, 8, 5, 0.1


class Block(nn.Module):
    """Post-norm self-attention and MLP with dropout on each residual branch (BERT's layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm_1 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.norm_2 = nn.LayerNorm(WIDTH)
        self.dropout = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = self.norm_1(x + self.dropout(self.proj(nn.functional.scaled_dot_product_attention(q, k, v))))
        return self.norm_2(x + self.dropout(self.mlp(x)))


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(CONTEXT, WIDTH)
        self.emb_dropout = nn.Dropout(P)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.classifier = nn.Linear(WIDTH, TAGS)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        x = self.emb_dropout(x)
        for block in self.blocks:
            x = block(x)
        return self.classifier(x)


def batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    """Deterministic per step; the plugin gives each rank its rows."""
    generator = torch.Generator().manual_seed(step)
    return {"tokens": torch.randint(0, VOCAB, (global_batch_size, CONTEXT), generator=generator),
            "tags": torch.randint(0, TAGS, (global_batch_size, CONTEXT), generator=generator)}


def tagging_loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b["tokens"]).flatten(0, 1), b["tags"].flatten())


# The plugin adds the control, `none` (nothing frozen), which tells dropout's own effect from freezing's.
@freeze_case(batch=batch, loss=tagging_loss, blocks=["Block"], patterns={
    # A new classifier on a frozen encoder (dropout still draws in the frozen blocks).
    "head-only": {"trainable": ["classifier.*"]},
    # The embeddings frozen, the encoder and classifier fine-tuned.
    "frozen-embeddings": {"frozen": ["tok_emb.*", "pos_emb.*"]},
})
def dropout_tagger() -> nn.Module:
    return Tagger()
