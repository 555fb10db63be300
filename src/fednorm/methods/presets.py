"""Methods as named presets over the design axes (model normalization, norm state policy, client
update, server update).

A method is data, not a class hierarchy: ``Method(policy=..., prox_mu=..., ...)``. The papers'
methods are entries of :data:`PRESETS`; any other combination (FedProx + FedBN, AGC + FedBN, say) is
the same dataclass with other values, e.g. ``resolve_method("fedbn", prox_mu=0.01)``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from ..models.norm import check_norm
from .amplitude import INITS as AMPLITUDE_INITS
from .amplitude import VARIANTS as AMPLITUDE_VARIANTS
from .amplitude import AmplitudeNormalizer
from .policy import check_policy
from .client_algorithms import ClientSpec
from .server import ServerSpec

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
    # centralized BN of the FBN paper (Remark 4.1): one model, each step on the MERGE of the participants'
    # mini-batches of that step (batch n * b), so it sees exactly the batches the federated methods see
    union_batches: bool = False
    server: ServerSpec = ServerSpec()  # the server update (FedAvg's weighted mean by default)
    client: ClientSpec = ClientSpec()  # the client algorithm on top of local SGD (SCAFFOLD, MOON, ...)
    # HarmoFL (Jiang et al. 2022): weight perturbation radius alpha (0 = off, paper 0.05), usable with any method
    weight_perturbation: float = 0.0
    # HarmoFL's amplitude normalization of the inputs: None (off), "full" (the paper: whole spectrum,
    # decay 0.1) or "code" (the official code: DC coefficient only, running amplitude of the first batch)
    amplitude_norm: str | None = None
    # where the running amplitude starts (amplitude.py): "zero" (the paper, Eq. 3) or "first_batch" (the
    # official code); None = the variant's own (full: zero, code: first_batch)
    amplitude_init: str | None = None
    # the official code's FDA window ratio L for amplitude_norm "code" (amplitude.low_frequency_mask: half-width
    # floor(min(H, W) * L) around the DC term); None = the code's L = 0, the DC coefficient alone
    amplitude_band: float | None = None
    # the running amplitude's decay v (Eq. 3); None = the variant's own: 0.1 for full (the paper), 0 for code (the
    # code's Cython int truncation of its 0.1; amplitude_decay 0.1 gives the momentum the code intended)
    amplitude_decay: float | None = None
    # the model normalization the method needs (FedWon: "ws", FedAvg+GN: "gn"); None = the config's model.norm
    norm: str | None = None
    # adaptive gradient clipping threshold lambda (FedWon: 0.64 digits, 1.28 Office/DomainNet); 0 = off
    agc_clip: float = 0.0
    agc_exclude_head: bool = True
    # FixBN (Zhong et al. 2023): from this round on, BN normalizes with the shared running statistics in
    # training too and never updates them. A value < 1 is a fraction of the run's rounds, >= 1 a round index
    freeze_bn_stats_at: float | None = None
    paper: str = ""

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if self.prox_mu < 0:
            raise ValueError(f"prox_mu must be >= 0, got {self.prox_mu}")
        if self.norm is not None:
            check_norm(self.norm)
        if self.agc_clip < 0:
            raise ValueError(f"agc_clip must be >= 0 (0 turns AGC off), got {self.agc_clip}")
        if self.freeze_bn_stats_at is not None and self.freeze_bn_stats_at <= 0:
            raise ValueError(f"freeze_bn_stats_at must be > 0, got {self.freeze_bn_stats_at}")
        if self.weight_perturbation < 0:
            raise ValueError(f"weight_perturbation must be >= 0 (0 turns it off), got {self.weight_perturbation}")
        if self.amplitude_norm not in (None, "full", "code"):
            raise ValueError(f"amplitude_norm must be None, 'full' or 'code', got {self.amplitude_norm!r}")
        if self.amplitude_init is not None:
            if self.amplitude_init not in AMPLITUDE_INITS:
                raise ValueError(f"amplitude_init must be one of {', '.join(AMPLITUDE_INITS)}, got "
                                 f"{self.amplitude_init!r}")
            if self.amplitude_norm is None:
                raise ValueError(f"method {self.name!r} sets amplitude_init but amplitude normalization is off: "
                                 "remove amplitude_init, or set amplitude_norm: full or code")
        self._check_amplitude_options()
        if self.pooled and self.union_batches:
            raise ValueError("pooled and union_batches are two different centralized references; pick one")
        if self.union_batches:
            # centralized BN is one model stepping on the merged batch (FBN Remark 4.1): no clients to keep state,
            # no server rule, no client algorithm; these settings would be silently ignored
            ignored = [key for key, on in (
                ("policy", self.policy != "shared"), ("prox_mu", self.prox_mu > 0),
                ("freeze_bn_stats_at", self.freeze_bn_stats_at is not None), ("client", self.client.name != "sgd"),
                ("server", self.server.rule != "mean"), ("amplitude_norm", self.amplitude_norm is not None),
                ("weight_perturbation", self.weight_perturbation > 0)) if on]
            if ignored:
                raise ValueError(f"method {self.name!r} is centralized BN (one model on the merged batches of each "
                                 f"step), which has no use for {', '.join(ignored)}: remove them")
        if self.prox_schedule not in PROX_SCHEDULES:
            raise ValueError(f"prox_schedule must be one of {', '.join(PROX_SCHEDULES)}, got {self.prox_schedule!r}")

    def _check_amplitude_options(self) -> None:
        for key, value in (("amplitude_band", self.amplitude_band), ("amplitude_decay", self.amplitude_decay)):
            if value is not None and self.amplitude_norm is None:
                raise ValueError(f"method {self.name!r} sets {key} but amplitude normalization is off: remove {key}, "
                                 "or set amplitude_norm: full or code")
        if self.amplitude_norm is None:
            return
        if self.amplitude_band is not None and self.amplitude_norm != "code":
            raise ValueError(f"method {self.name!r}: amplitude_band is the official code's low-frequency window; "
                             "amplitude_norm full replaces the whole spectrum (the paper): set amplitude_norm: code, "
                             "or remove amplitude_band")
        settings = self.amplitude_settings()
        if settings["decay"] == 0.0 and settings["init"] == "zero":
            # the code variant's momentum is 0 unless amplitude_decay says otherwise
            raise ValueError(f"method {self.name!r}: a running amplitude with decay 0 (amplitude_norm "
                             f"{self.amplitude_norm}, amplitude_decay {self.amplitude_decay}) started at amplitude_init "
                             "zero would keep it at zero: use amplitude_init first_batch or a decay above 0"
                             + (", or amplitude_norm full for the paper's Eq. 3 from zero" if self.amplitude_decay is None
                                else ""))
        try:
            AmplitudeNormalizer(**settings)  # the normalizer's own checks: the window and decay ranges
        except ValueError as exc:
            raise ValueError(f"method {self.name!r}: {exc}") from None

    def amplitude_settings(self) -> dict:
        """The amplitude normalizer's settings (:class:`fednorm.methods.amplitude.AmplitudeNormalizer`): the
        variant's own (:data:`fednorm.methods.amplitude.VARIANTS`) with the method's amplitude_band /
        amplitude_decay / amplitude_init in their place where set."""
        if self.amplitude_norm is None:
            raise ValueError(f"method {self.name!r} has amplitude normalization off: it has no amplitude settings")
        own = {"band_ratio": self.amplitude_band, "decay": self.amplitude_decay, "init": self.amplitude_init}
        return {**AMPLITUDE_VARIANTS[self.amplitude_norm], **{k: v for k, v in own.items() if v is not None}}

    @property
    def communicates(self) -> bool:
        return self.policy != "local_all"

    def freeze_round(self, total_rounds: int) -> int | None:
        """The first round (0-based) in which BN statistics are frozen (FixBN), or None."""
        at = self.freeze_bn_stats_at
        if at is None:
            return None
        # a fraction of the rounds rounded half up, as the engine's sampled clients C K: Python's round() halves to
        # even, so 0.5 of 25 rounds was round 12 but 0.5 of 15 round 8 (before 2026-12-03: the recorded 25-round
        # FixBN cells of benchmarks/fedwon.md froze from 0-based round 12, a run now from 13)
        return math.floor(at * total_rounds + 0.5) if at < 1 else int(at)

    @property
    def stateful_clients(self) -> bool:
        """True when clients must keep state between rounds (so they cannot be anonymous devices)."""
        return self.policy != "shared" or self.client.build().stateful


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
        Method("fedwon", "FedWon: no normalization, WSConv convolutions, AGC (lambda 0.64), everything averaged",
               "shared", norm="ws", agc_clip=0.64, paper="Zhuang & Lyu 2024"),
        Method("fedavg_gn", "FedAvg+GN: FedAvg on a model with GroupNorm in place of BatchNorm", "shared",
               norm="gn", paper="Hsieh et al. 2020"),
        Method("fedavg_ln", "FedAvg+LN: FedAvg with layer norm as GroupNorm(1, C)", "shared", norm="ln",
               paper="FedWon baseline"),
        Method("fedavg_nobn", "FedAvg w/o BN: FedAvg on the model with every norm removed (plain convs)", "shared",
               norm="none", paper="FedWon Fig. 3"),
        Method("fixbn", "FixBN: FedAvg with BN; from half the rounds on, BN uses the frozen shared statistics",
               "shared", norm="bn", freeze_bn_stats_at=0.5, paper="Zhong et al. 2023"),
        Method("centralized", "Centralized: one model on the pooled training data (upper reference)", "shared",
               pooled=True, paper="FedBN App. E.3"),
        Method("fbn", "Federated BatchNorm: BN normalizes with the shared statistics, aggregated by (RM)/(RV) "
               "so they equal centralized BN's", "shared", norm="fbn", paper="Guerraoui et al. 2024"),
        Method("naive_bn", "Naive BN: standard BN on each client, the server averages every entry, statistics "
               "included (FedAvg's BN handling, named as in the FBN paper)", "shared", norm="bn",
               paper="FBN baseline"),
        Method("centralized_bn", "Centralized BN: one model, each step on the merge of the clients' batches of "
               "that step (batch n x b), standard BN; the attack-free reference under federation.byzantine (no client "
               "replies to attack)", "shared", norm="bn", union_batches=True,
               paper="FBN Remark 4.1"),
        Method("fedavgm", "FedAvgM: server momentum on the averaged update (beta 0.9, server lr 1)", "shared",
               server=ServerSpec("fedavgm", lr=1.0, momentum=0.9), paper="Hsu et al. 2019"),
        Method("fedadam", "FedAdam: Adam on the averaged update at the server (lr 0.01, b1 0.9, b2 0.99, tau 1e-3)",
               "shared", server=ServerSpec("fedadam", lr=0.01), paper="Reddi et al. 2021"),
        Method("fedyogi", "FedYogi: Yogi on the averaged update at the server", "shared",
               server=ServerSpec("fedyogi", lr=0.01), paper="Reddi et al. 2021"),
        Method("fedadagrad", "FedAdagrad: Adagrad on the averaged update at the server", "shared",
               server=ServerSpec("fedadagrad", lr=0.01), paper="Reddi et al. 2021"),
        Method("scaffold", "SCAFFOLD: local steps corrected by the control variates c - c_i (option II)", "shared",
               client=ClientSpec("scaffold"), paper="Karimireddy et al. 2020"),
        Method("harmofl", "HarmoFL: amplitude normalization of the inputs (averaged after round 1, then frozen) "
               "and weight perturbation (alpha 0.05) on FedAvg", "shared", weight_perturbation=0.05,
               amplitude_norm="full", paper="Jiang et al. AAAI 2022"),
        Method("fedavg_ampnorm", "FedAvg + amplitude normalization (HarmoFL ablation)", "shared",
               amplitude_norm="full", paper="HarmoFL Table 4"),
        Method("fedavg_wp", "FedAvg + weight perturbation alpha 0.05 (HarmoFL ablation)", "shared",
               weight_perturbation=0.05, paper="HarmoFL Table 4"),
        Method("moon", "MOON: cross-entropy plus mu * model-contrastive loss pulling z to the global model's and "
               "away from the previous local model's representation (mu 1, tau 0.5)", "shared",
               client=ClientSpec("moon"), paper="Li, He, Song CVPR 2021"),
        Method("feddc", "FedDC: local drift h_i, penalty (alpha/2)||theta_i + h_i - theta||^2 plus SCAFFOLD-style "
               "gradient correction; clients send theta_i + h_i (alpha 0.01)", "shared", client=ClientSpec("feddc"),
               paper="Gao et al. CVPR 2022"),
        Method("perfedavg", "Per-FedAvg (FO): MAML step on the two halves of each batch (alpha 0.01, beta = lr); "
               "one SGD step with alpha on 32 labelled test samples before evaluation", "shared",
               client=ClientSpec("perfedavg"), paper="Fallah et al. NeurIPS 2020"),
        Method("fednova", "FedNova: average of the local updates normalized by each client's step count",
               "shared", server=ServerSpec("fednova"), paper="Wang et al. 2020"),
    ]
}


def resolve_method(name: str, **overrides) -> Method:
    """The preset ``name`` with axis values replaced by ``overrides`` (None values are ignored).

    ``server`` may be a :class:`ServerSpec` or a dict of its fields, which then override the preset's own
    server fields (``fedadam`` with ``server={"lr": 0.1}`` keeps the rule fedadam)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(PRESETS)}") from None
    changes = {k: v for k, v in overrides.items() if v is not None}
    if isinstance(changes.get("server"), dict):
        changes["server"] = replace(base.server, **changes["server"])
    if isinstance(changes.get("client"), dict):
        changes["client"] = replace(base.client, **changes["client"])
    return replace(base, **changes) if changes else base
