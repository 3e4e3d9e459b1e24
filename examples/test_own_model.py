"""The shortest use: your own nn.Module, frozen your way, under every stack installed here.

    pytest examples/test_own_model.py
"""

import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.mlp(x))


class TinyTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.body = nn.ModuleList([Block(), Block()])  # its blocks: FSDP units, activation-checkpointed one by one
        self.head = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.body:
            x = block(x)
        return self.head(x)


def batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    """Deterministic per step; the plugin gives each rank its rows."""
    tokens = torch.randint(0, 32, (global_batch_size, 6), generator=torch.Generator().manual_seed(step))
    return {"tokens": tokens, "targets": tokens.flip(-1)}


def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(b["tokens"]).flatten(0, 1), b["targets"].flatten())


def only_the_body(name: str) -> bool:
    return name.startswith("body.")


@freeze_case(batch=batch, loss=loss, patterns={
    "head-only": {"trainable": ["head.*"]},          # globs of what trains
    "frozen-embedding": {"frozen": ["embed.*"]},     # or of what is frozen
    "body-only": only_the_body,                      # or a function of the name
})
def tiny_tagger() -> nn.Module:
    return TinyTagger()
