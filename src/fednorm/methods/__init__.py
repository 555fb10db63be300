"""Methods: norm state policies, client updates, server updates and the papers' presets."""

from .aggregation import WEIGHTINGS, UpdateError, WeightedMean, client_weights
from .local_update import LocalResult, LocalTraining, train_locally
from .policy import POLICIES, local_state_keys, shared_state_keys
from .presets import PRESETS, Method, resolve_method

__all__ = [
    "WEIGHTINGS", "UpdateError", "WeightedMean", "client_weights",
    "LocalResult", "LocalTraining", "train_locally",
    "POLICIES", "local_state_keys", "shared_state_keys",
    "PRESETS", "Method", "resolve_method",
]
