"""A transformer MLP block in KernelBench's format (written for maxkernel's tests)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    """LayerNorm, Linear -> GELU -> Linear, and the residual."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


batch_size = 512
dim = 1024
hidden = 4096


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [dim, hidden]
