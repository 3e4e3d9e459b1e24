"""Batch and loss shared by the Hugging Face examples: next-token prediction on random ids."""

import torch
from torch import nn

VOCAB = 64
SEQ = 8


def token_batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (global_batch_size, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids}


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
