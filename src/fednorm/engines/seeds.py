"""Random streams derived from (seed, round, client, stream...), never drawn in execution order, so that a run's
numbers do not depend on the order clients train in, nor on a resume from a checkpoint."""

from __future__ import annotations

import zlib

import numpy as np
import torch

# a client's training-time augmentation (training.augment), drawn apart from its batch order and dropout
AUGMENT_STREAM = 6
# the augmentation of a client's validation images at one evaluation (training.augment_validation)
VALIDATION_AUGMENT_STREAM = 7
# a client's augmentation draws made once for the whole run (flamby_isic's hole count)
CLIENT_AUGMENT_STREAM = 8


def derive_seed(*parts: int) -> int:
    """A 63-bit seed that depends only on the 32-bit words of ``parts`` (seed, round, client, stream...).

    Aliases (numpy's ``SeedSequence``): parts that differ only by trailing zeros give the same seed (it pads its
    entropy with zeros: ``derive_seed(1, 2) == derive_seed(1, 2, 0)``); an integer of 32 bits or more is split into
    32-bit words (``derive_seed(7, 3) == derive_seed(7 + 3 * 2**32)``); and the parts carry no names, so calls of
    different streams alias when their tuples coincide. Checked 2026-11-26 over the engines' and runner's calls:
    the engines end every call with a non-zero stream constant (1, 2, 5, 6, 7, 8); the runner's validation hold-out
    ``(split_seed, 4, partition)`` puts the partition last, so with ``data.split_seed`` equal to the run's seed it
    coincides with ``(seed, round 4, stream)`` for partition = stream: 1 (numpy's client-sampling generator of round
    4, another algorithm than the hold-out's torch generator), 2 (the torch seed of the centralized reference's
    round 4) and 5 (the diagnostics' dropout seed after round 4; a domain needs six clients for a partition 5),
    whose draws then start where the hold-out permutation's did. Left as it is: changing it would move every
    recorded validation split. A new stream should end with a new non-zero constant."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, dtype=np.uint64)[0] >> 1)


def augment_generator(client_seed: int) -> torch.Generator:
    """The generator of a client's augmentation draws in one round, from the round's client seed
    (``RoundInstructions.seed``): its own stream, so the batch order and dropout draw as without augmentation."""
    return torch.Generator().manual_seed(derive_seed(client_seed, AUGMENT_STREAM))


def client_augment_generator(seed: int, client: str) -> torch.Generator:
    """The generator of the augmentation draws a client makes once for the whole run (FLamby draws its hole count
    once per client dataset), from the run's seed and the client's name (CRC-32, as the validation stream): the same
    every round, on every engine and node, and after a resume."""
    return torch.Generator().manual_seed(derive_seed(seed, zlib.crc32(client.encode()), CLIENT_AUGMENT_STREAM))


def validation_augment_generator(seed: int, rounds_done: int, client: str) -> torch.Generator:
    """The generator of one evaluation's augmentation of ``client``'s validation images (``augment_validation``),
    from the run's seed, the rounds completed and the client's name (CRC-32: the same on every engine and node,
    whatever order clients are evaluated in)."""
    return torch.Generator().manual_seed(
        derive_seed(seed, rounds_done, zlib.crc32(client.encode()), VALIDATION_AUGMENT_STREAM))
