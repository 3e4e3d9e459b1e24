"""The head of a user's test file in the end-to-end tests of a project's own model: its imports and the residual
block its models stack (text: pytester writes it into the project)."""

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
