"""Uses an op torchax has no lowering for (written for maxkernel's tests)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        y = x * 2
        return torch.special.airy_ai(y)


def get_inputs():
    return [torch.randn(64, 128)]


def get_init_inputs():
    return []
