"""A model that is valid at its own sizes but not at every smaller copy: a convolution of 64 channels in
16 groups, shrunk x1/8, has 8 channels in 16 groups (PyTorch refuses to build it)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, groups=16)

    def forward(self, x):
        return torch.relu(self.conv(x))


batch_size = 1024
channels = 64
size = 256


def get_inputs():
    return [torch.randn(batch_size, channels, size, size)]


def get_init_inputs():
    return [channels]
