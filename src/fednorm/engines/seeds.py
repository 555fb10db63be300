"""Random streams derived from (seed, round, client, stream...), never drawn in execution order, so that a run's
numbers do not depend on the order clients train in, nor on a resume from a checkpoint."""

from __future__ import annotations

import numpy as np
import torch

# a client's training-time augmentation (training.augment), drawn apart from its batch order and dropout
AUGMENT_STREAM = 6


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on ``parts`` (seed, round, client, stream...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


def augment_generator(client_seed: int) -> torch.Generator:
    """The generator of a client's augmentation draws in one round, from the round's client seed
    (``RoundInstructions.seed``): its own stream, so the batch order and dropout draw as without augmentation."""
    return torch.Generator().manual_seed(derive_seed(client_seed, AUGMENT_STREAM))
