"""The head of a user's test file in the end-to-end tests of a project's own model: its imports and the residual
block its models stack (text: pytester writes it into the project)."""

import os
import subprocess
import sys
from pathlib import Path

HEAD = '''
import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.mlp(x))
'''

#: The batch and loss of a tagger over 32 tokens, 4 per row (text, after a model's class).
TOKEN_DATA = '''

def batch(global_batch_size, step):
    tokens = torch.randint(0, 32, (global_batch_size, 4), generator=torch.Generator().manual_seed(step))
    return {"tokens": tokens, "targets": tokens.flip(-1)}


def loss(model, b):
    return nn.functional.cross_entropy(model(b["tokens"]).flatten(0, 1), b["targets"].flatten())
'''


def run_project(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Plain `pytest` in a scratch project, as its user runs it (no environment of this repository's nox)."""
    env = {k: v for k, v in os.environ.items() if k != "FREEZECOMPAT_ENVIRONMENT" and not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=path,
                          capture_output=True, text=True, env=env, check=False)
