"""Tests run the real Triton kernels on the CPU through Triton's interpreter, which must be switched on
before triton is first imported."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
