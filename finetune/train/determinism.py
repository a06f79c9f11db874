"""The run's seed, given to every random generator it draws from."""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
