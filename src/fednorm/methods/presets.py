"""Methods as named presets over the design axes (norm state policy, client update, server update).

A method is data, not a class hierarchy: ``Method(policy=..., prox_mu=..., ...)``. The papers'
methods are entries of :data:`PRESETS`; any other combination (FedProx + FedBN, say) is the same
dataclass with other values, e.g. ``resolve_method("fedbn", prox_mu=0.01)``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .policy import check_policy

PROX_SCHEDULES = ("paper", "fedbn_code")


@dataclass(frozen=True)
class Method:
    name: str
    summary: str
    policy: str = "shared"
    prox_mu: float = 0.0
    # "paper": the proximal term from the first step of the first round (FedProx / FedBN papers);
    # "fedbn_code": as FedBN's official digits script, no term in round 0 nor on each epoch's first step
    prox_schedule: str = "paper"
    pooled: bool = False  # centralized: one model trained on the union of all clients' training data
    paper: str = ""

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if self.prox_mu < 0:
            raise ValueError(f"prox_mu must be >= 0, got {self.prox_mu}")
        if self.prox_schedule not in PROX_SCHEDULES:
            raise ValueError(f"prox_schedule must be one of {', '.join(PROX_SCHEDULES)}, got {self.prox_schedule!r}")

    @property
    def communicates(self) -> bool:
        return self.policy != "local_all"

    @property
    def stateful_clients(self) -> bool:
        """True when clients must keep state between rounds (so they cannot be anonymous devices)."""
        return self.policy != "shared"


PRESETS: dict[str, Method] = {
    m.name: m
    for m in [
        Method("fedavg", "FedAvg: average every parameter and buffer, BN statistics included", "shared",
               paper="McMahan et al. 2017"),
        Method("fedprox", "FedProx: FedAvg plus (mu/2)||w - w_global||^2 in the local loss (mu=0.01)", "shared",
               prox_mu=0.01, paper="Li et al. 2020"),
        Method("fedbn", "FedBN: all BatchNorm state stays local, everything else is averaged", "local_bn",
               paper="Li et al. ICLR 2021"),
        Method("silobn", "SiloBN: BN running statistics stay local, BN weight/bias are averaged", "local_bn_stats",
               paper="Andreux et al. 2020"),
        Method("singleset", "SingleSet: each client trains alone on its own data, no communication", "local_all",
               paper="FedBN baseline"),
        Method("centralized", "Centralized: one model on the pooled training data (upper reference)", "shared",
               pooled=True, paper="FedBN App. E.3"),
    ]
}


def resolve_method(name: str, **overrides) -> Method:
    """The preset ``name`` with axis values replaced by ``overrides`` (None values are ignored)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    return replace(base, **changes) if changes else base
