"""Engines run a method over clients: in this process (the default) or, later, on Flower."""

from .simulation import Evaluation, Federation, InProcessEngine, derive_seed

__all__ = ["Evaluation", "Federation", "InProcessEngine", "derive_seed"]
