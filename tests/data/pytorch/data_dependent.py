"""Branches on a tensor's value in forward (written for maxkernel's tests)."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return -x


def get_inputs():
    return [torch.randn(64, 128)]


def get_init_inputs():
    return []
