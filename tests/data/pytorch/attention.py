"""A small causal self-attention layer, as a named module with example inputs (written for maxkernel's tests)."""

import math

import torch
import torch.nn as nn


class SelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        out = (probs @ v).transpose(1, 2).reshape(b, s, d)
        return self.proj(out)


batch = 4
seq = 512
dim = 512
heads = 8


def get_inputs():
    return [torch.randn(batch, seq, dim)]


def get_init_inputs():
    return [dim, heads]
