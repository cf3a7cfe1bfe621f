"""Shared pytest setup for the K-FAC test suite.

The test machines have two shared CPU cores, so every test runs single-threaded, and
every test starts from the same RNG state so that failures reproduce exactly.
"""
import random

import numpy as np
import pytest
import torch

torch.set_num_threads(1)
try:  # may only be set once per process, before any inter-op work
    torch.set_num_interop_threads(1)
except RuntimeError:
    pass


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    yield
