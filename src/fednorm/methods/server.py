"""Server updates: how the round's client replies become the next global state.

One object per run, fed the participants' replies one at a time (``add``) and asked for the next
global state at the end of the round (``finish``). The rules:

| rule           | next global state                                                           | paper            |
| -------------- | --------------------------------------------------------------------------- | ---------------- |
| ``mean``       | weighted mean of the clients' states (p_k)                                  | FedAvg           |
| ``fedavgm``    | v = beta v + Delta; x = x + eta v  (Delta = mean_k x_k - x)                 | Hsu et al. 2019  |
| ``fedadam``    | m = b1 m + (1-b1) Delta; v = b2 v + (1-b2) Delta^2; x = x + eta m/(sqrt v + tau) | Reddi et al. 2021 |
| ``fedyogi``    | as fedadam with v = v - (1-b2) Delta^2 sign(v - Delta^2)                    | Reddi et al. 2021 |
| ``fedadagrad`` | as fedadam with v = v + Delta^2                                             | Reddi et al. 2021 |
| ``fednova``    | x = x - tau_eff sum_k p_k (x - x_k)/a_k, tau_eff = sum_k p_k a_k            | Wang et al. 2020 |
| ``median``     | x = x - CWMed_k(x - x_k)                                                    | Yin et al. 2018  |
| ``trimmed_mean``| x = x - CWTM_f,k(x - x_k)                                                  | Yin et al. 2018  |
| ``krum``       | x = x - Krum_f,k(x - x_k)                                                   | Blanchard 2017   |

Server optimizers and FedNova act on the trainable parameters; buffers (BatchNorm running statistics)
take the weighted mean. Reddi et al. initialise v at tau^2 and apply no bias correction (unlike
``torch.optim.Adam``), which is what is done here (Algorithm 2; their experiments' code builds Keras' Adam, which
corrects the bias). Algorithm 2 gives FedAdagrad the first moment m too, so ``server.momentum`` (b1, default 0.9)
applies to it as to FedAdam; their code's FedAdagrad is Keras' Adagrad, without m (``server.momentum: 0`` for it).
Delta is the round's weighted mean of x_k - x with the federation's weights (``federation.weighting``, samples by
default, as FedAvg's p_k); Reddi et al.'s Algorithm 2 averages with 1/|S|: ``federation.weighting: uniform`` gives
theirs (the two agree on clients of equal size).

Robust rules act on the pseudo-gradients x - x_k (for DSGD, where every client takes one step from x,
x - x_k = lr * g_k: the robust rules, being translation- and scale-equivariant, give the same result as
robust aggregation of the gradients themselves), unweighted as in the Byzantine-ML literature,
optionally after nearest-neighbour mixing (NNM). The parameters form one vector; each BatchNorm layer's
running mean and running variance are aggregated apart (NNM per statistic tensor: the paper does not
say, and mixing them into the parameter vector would let the parameters' distances decide).

Running statistics of :mod:`fednorm.models.fbn` layers are combined with FBN's (RM) / (RV) (robustly
under a robust rule, see :func:`fednorm.methods.fbn_stats.aggregate_fbn`); other shared BatchNorm
statistics are averaged ("naive BN"). Integer counters take the maximum.

Byzantine clients (:class:`Threat`) are simulated at the server: their replies are replaced by the
attack computed from the honest replies of the round (an omniscient attacker, the usual threat model),
on the statistics (the FBN paper's Section 5: "3 adversarial clients ... attack the batch norm
statistics") and, if asked, on the parameters too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from .aggregation import DivergenceError, UpdateError, WeightedMean, all_finite
from .fbn_stats import aggregate_fbn, aggregate_fbn_weighted
from .robust import (ATTACKS, a_little_is_enough, attack_statistics, fall_of_empires, robust_aggregator,
                     sign_flip)

SERVER_OPTIMIZERS = ("fedavgm", "fedadam", "fedyogi", "fedadagrad")
ROBUST_RULES = ("median", "trimmed_mean", "krum")
SERVER_RULES = ("mean", *SERVER_OPTIMIZERS, "fednova", *ROBUST_RULES)
ROBUST_SCOPES = ("all", "statistics")
ATTACK_TARGETS = ("statistics", "parameters")


@dataclass(frozen=True)
class ServerSpec:
    """The server update of a method (see the module table)."""

    rule: str = "mean"
    lr: float = 1.0  # eta of the server optimizers
    momentum: float = 0.9  # FedAvgM's beta; beta1 of FedAdam / FedYogi / FedAdagrad
    beta2: float = 0.99
    tau: float = 1e-3  # adaptivity of FedAdam / FedYogi / FedAdagrad (Reddi et al.'s grid: 1e-3 is common)
    nnm: bool = False  # nearest-neighbour mixing before a robust rule (Allouah et al. 2023)
    robust_f: int | None = None  # f assumed by trimmed mean / Krum / NNM; None = the threat's Byzantine count
    # what a robust rule aggregates: "all" (the parameters' pseudo-gradients and the BN statistics: Robust-DSGD
    # with robust FBN), or "statistics" (only the BN statistics, parameters by the weighted mean: the reading
    # where only the statistics are attacked, FBN paper Section 5, which does not say which it used)
    robust_scope: str = "all"

    def __post_init__(self) -> None:
        if self.rule not in SERVER_RULES:
            raise ValueError(f"unknown server rule {self.rule!r}; choose one of {', '.join(SERVER_RULES)}")
        if self.lr <= 0:
            raise ValueError(f"server lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1 or not 0 <= self.beta2 < 1:
            raise ValueError(f"server momentum / beta2 must be in [0, 1), got {self.momentum}, {self.beta2}")
        if self.tau <= 0:
            raise ValueError(f"server tau must be > 0, got {self.tau}")
        if self.nnm and self.rule not in ROBUST_RULES:
            raise ValueError("nnm pre-processes a robust rule (median, trimmed_mean, krum)")
        if self.robust_scope not in ROBUST_SCOPES:
            raise ValueError(f"robust_scope must be one of {', '.join(ROBUST_SCOPES)}, got {self.robust_scope!r}")

    @property
    def robust(self) -> bool:
        return self.rule in ROBUST_RULES


@dataclass(frozen=True)
class Threat:
    """Simulated Byzantine clients: who they are, what they send instead of their honest reply."""

    attack: str | None = None  # sign_flip, fall_of_empires, a_little_is_enough; None: honest
    byzantine: tuple[str, ...] = ()  # client names
    targets: tuple[str, ...] = ("statistics",)
    foe_eps: float = 0.1
    alie_z: float | None = None  # None: Baruch et al.'s z_max for the round's n and f
    sign_flip_own: bool = False  # SF on statistics: each attacker's own mean (True) or the honest mean (False)

    def __post_init__(self) -> None:
        if self.attack is not None and self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose one of {', '.join(ATTACKS)}")
        bad = set(self.targets) - set(ATTACK_TARGETS)
        if bad:
            raise ValueError(f"unknown attack targets {sorted(bad)}; choose from {', '.join(ATTACK_TARGETS)}")

    @property
    def active(self) -> bool:
        return self.attack is not None and bool(self.byzantine)


@dataclass
class ClientReply:
    """What a client sends back: its shared entries, its aggregation weight and facts about its training."""

    client: str
    state: dict[str, Tensor]
    weight: float
    num_steps: int = 0
    bn_counts: dict[str, int] = field(default_factory=dict)  # FBN layer prefix -> K of its last batch


@dataclass(frozen=True)
class LocalSchedule:
    """The clients' local optimizer, which FedNova's normalization a_k depends on."""

    lr: float = 0.01
    momentum: float = 0.0
    prox_mu: float = 0.0


def fednova_norm(num_steps: int, schedule: LocalSchedule) -> float:
    """||a_k||_1 of FedNova (Wang et al. 2020, Sec. 4 and App.): tau for plain SGD;
    (tau - rho (1 - rho^tau)/(1 - rho)) / (1 - rho) with momentum rho; (1 - (1 - lr mu)^tau)/(lr mu) with
    FedProx's mu. With both, the momentum form is used (the paper gives no joint formula; the official code,
    JYWa/FedNova, has its own joint recursion for a solver that adds the proximal term after momentum, and takes
    tau_eff = sum_k p_k tau_k whenever mu != 0: not reproduced). An Adam client (momentum 0 in the schedule) is
    normalized as plain SGD, by tau (or by the FedProx form when mu > 0): FedNova defines a_k for SGD-type solvers
    only; this is our choice for HarmoFL's Adam presets. The momentum form assumes the momentum buffer starts each round at zero, as the
    official code resets it; with ``federation.persistent_optimizer`` (HarmoFL's presets, whose code keeps each
    client's optimizer) the carried-over buffer also moves the weights, so a_k is then an approximation."""
    tau, rho = num_steps, schedule.momentum
    if tau <= 0:
        raise UpdateError("FedNova needs the number of local steps of every client (got 0)")
    if rho > 0:
        return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)
    if schedule.prox_mu > 0:
        q = 1 - schedule.lr * schedule.prox_mu
        return (1 - q**tau) / (schedule.lr * schedule.prox_mu)
    return float(tau)


def _bn_stat_prefixes(keys) -> list[str]:
    return sorted(k[: -len(".running_mean")] for k in keys if k.endswith(".running_mean"))


class ServerUpdate:
    """The server side of a method for one run: ``begin`` / ``add`` per client / ``finish`` each round."""

    def __init__(
        self,
        spec: ServerSpec,
        shared_state: dict[str, Tensor],
        param_keys: set[str],
        fbn_layers: dict[str, float] | None = None,
        schedule: LocalSchedule = LocalSchedule(),
        threat: Threat = Threat(),
    ) -> None:
        self.spec, self.schedule, self.threat = spec, schedule, threat
        self.keys = list(shared_state)
        self.fbn_layers = {p: b for p, b in (fbn_layers or {}).items() if f"{p}.running_mean" in shared_state}
        self.bn_prefixes = _bn_stat_prefixes(shared_state)
        stat_keys = {f"{p}.{s}" for p in self.bn_prefixes for s in ("running_mean", "running_var")}
        self.fbn_keys = {f"{p}.{s}" for p in self.fbn_layers for s in ("running_mean", "running_var")}
        self.param_keys = [k for k in self.keys if k in param_keys and shared_state[k].is_floating_point()]
        self.vector_keys = [k for k in self.keys if shared_state[k].is_floating_point() and k not in stat_keys]
        self.stat_keys = stat_keys
        self.robust_f = spec.robust_f if spec.robust_f is not None else len(threat.byzantine)
        self.collecting = spec.robust or threat.active
        self.optimizer_state: dict[str, dict[str, Tensor]] = {}
        self._global: dict[str, Tensor] = {}
        self._participants: int | None = None

    # ------------------------------------------------------------------ round protocol
    def begin(self, global_state: dict[str, Tensor], lr: float | None = None, participants: int | None = None) -> None:
        """Start a round from ``global_state``; ``lr`` is the clients' learning rate this round (a decaying
        schedule), which FedNova's ||a_k||_1 under FedProx depends on; ``participants`` the number of clients the
        round sent out (the n in the FBN clients' Kn/(Kn-1)), when some replies may not be aggregated."""
        self._participants = participants
        if lr is not None and lr != self.schedule.lr:
            self.schedule = replace(self.schedule, lr=lr)
        self._global = {k: global_state[k] for k in self.keys}
        self._replies: list[ClientReply] = []
        self._fbn_rows: dict[str, list[tuple[Tensor, Tensor, int]]] = {p: [] for p in self.fbn_layers}
        self._mean = WeightedMean({k: v for k, v in self._global.items() if k not in self.fbn_keys})
        self._nova: dict[str, Tensor] = {}
        self._nova_tau = 0.0

    def add(self, reply: ClientReply) -> None:
        if self.collecting:
            self._check(reply)
            self._replies.append(reply)
            return
        self._mean.add({k: v for k, v in reply.state.items() if k not in self.fbn_keys}, reply.weight, reply.client)
        for prefix in self.fbn_layers:
            self._fbn_rows[prefix].append(self._fbn_row(reply, prefix))
        if self.spec.rule == "fednova":
            a = fednova_norm(reply.num_steps, self.schedule)
            self._nova_tau += reply.weight * a
            for k in self.param_keys:
                d = (self._global[k].to(torch.float64) - reply.state[k].to(torch.float64)) * (reply.weight / a)
                self._nova[k] = d if k not in self._nova else self._nova[k].add_(d)

    def validate(self, reply: ClientReply) -> None:
        """Raise :class:`UpdateError` if ``reply`` cannot be aggregated this round: missing or unexpected
        entries, a wrong shape or dtype, NaN or Inf values, no FBN batch size, no step count for FedNova.
        Changes nothing, so an engine can check every reply of a round before adding any (``add`` may
        have summed part of a reply when it fails). Call it between ``begin`` and ``finish``."""
        if not hasattr(self, "_mean"):
            raise RuntimeError("ServerUpdate.validate needs the round's global state: call begin() first")
        who = f"client {reply.client!r}"
        missing = [k for k in self.keys if k not in reply.state]
        extra = sorted(set(reply.state) - set(self.keys))
        if missing or extra:
            raise UpdateError(f"{who} sent the wrong entries: missing {missing[:5]}, unexpected {extra[:5]}")
        for k in self.keys:
            v, ref = reply.state[k], self._global[k]
            if not isinstance(v, Tensor):
                raise UpdateError(f"{who} sent {k!r} as {type(v).__name__}, expected a tensor")
            if v.shape != ref.shape:
                raise UpdateError(f"{who} sent {k!r} with shape {tuple(v.shape)}, expected {tuple(ref.shape)}")
            if v.dtype != ref.dtype:
                raise UpdateError(f"{who} sent {k!r} as {v.dtype}, expected {ref.dtype}")
            if v.is_floating_point() and not all_finite(v):
                raise DivergenceError(f"{who} sent non-finite values in {k!r} (NaN or inf): its local training "
                                  "diverged; lower the learning rate or check its data")
        for prefix in self.fbn_layers:
            count = reply.bn_counts.get(prefix)
            if not isinstance(count, int) or count <= 0:
                raise UpdateError(f"{who} sent no batch size for its FBN layer {prefix!r}")
        if self.spec.rule == "fednova" and (not isinstance(reply.num_steps, int) or reply.num_steps <= 0):
            raise UpdateError(f"{who} sent {reply.num_steps!r} local steps; FedNova needs a positive count")
        if not math.isfinite(reply.weight) or reply.weight <= 0:
            raise UpdateError(f"{who} has aggregation weight {reply.weight!r}; expected a positive number")

    def finish(self) -> dict[str, Tensor]:
        if self.collecting:
            return self._finish_collected()
        new = self._mean.result()
        rule = self.spec.rule
        if rule in SERVER_OPTIMIZERS:
            self._server_optimizer_step(new)
        elif rule == "fednova":
            for k in self.param_keys:
                new[k] = (self._global[k].to(torch.float64) - self._nova_tau * self._nova[k]).to(self._global[k].dtype)
        for prefix, beta in self.fbn_layers.items():
            rows = self._fbn_rows[prefix]
            means = torch.stack([r[0] for r in rows])
            vars_ = torch.stack([r[1] for r in rows])
            m, v = self._fbn(prefix, means, vars_, beta, [r[2] for r in rows], None)
            new[f"{prefix}.running_mean"], new[f"{prefix}.running_var"] = m, v
        return self._cast(new)

    # ------------------------------------------------------------------ pieces
    def _cast(self, new: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: new[k].to(self._global[k].dtype) for k in self.keys}

    def _fbn_row(self, reply: ClientReply, prefix: str) -> tuple[Tensor, Tensor, int]:
        count = reply.bn_counts.get(prefix)
        if not count:
            raise UpdateError(f"client {reply.client!r} sent no batch size for its FBN layer {prefix!r}; "
                              "it did not train in FBN mode (a client must train at least one step)")
        mean, var = reply.state[f"{prefix}.running_mean"], reply.state[f"{prefix}.running_var"]
        for name, t in (("running_mean", mean), ("running_var", var)):
            if not all_finite(t):
                raise DivergenceError(f"client {reply.client!r} sent non-finite values in {prefix}.{name}")
        # copies: the reply may hold the live buffers of the working model, which the next client overwrites
        return mean.to(torch.float64, copy=True), var.to(torch.float64, copy=True), int(count)

    def _fbn(self, prefix: str, means: Tensor, vars_: Tensor, beta: float, counts: list[int],
             aggregator) -> tuple[Tensor, Tensor]:
        # the clients unbiased with the n of the round's participants: fewer rows (a reply left out after its client
        # trained) take the exact path below, which takes each client's own factor back out
        short = aggregator is None and self._participants not in (None, len(counts))
        if len(set(counts)) == 1 and not short:
            return aggregate_fbn(means, vars_, beta, counts[0], aggregator)
        if aggregator is not None:
            # unequal K under a robust rule: the robust formula with the mean K (no exact form exists)
            return aggregate_fbn(means, vars_, beta, max(1, round(sum(counts) / len(counts))), aggregator)
        # exact against centralized BN: the shared variance the clients started from undoes their own unbiasing
        # (one step per round, DSGD; after several local steps the counts are each client's last batch and the
        # undoing assumes a single EMA step from ``previous``: an approximation, see models/fbn.py)
        previous = self._global[f"{prefix}.running_var"].to(torch.float64)
        return aggregate_fbn_weighted(means, vars_, beta, counts, previous_var=previous,
                                      num_clients=self._participants)

    def _server_optimizer_step(self, new: dict[str, Tensor]) -> None:
        s, rule = self.spec, self.spec.rule
        for k in self.param_keys:
            x = self._global[k].to(torch.float64)
            delta = new[k].to(torch.float64) - x
            st = self.optimizer_state.setdefault(k, {})
            if rule == "fedavgm":
                v = st.get("v", torch.zeros_like(delta)).mul(s.momentum).add_(delta)
                st["v"] = v
                new[k] = x + s.lr * v
                continue
            m = st.get("m", torch.zeros_like(delta)).mul(s.momentum).add_(delta, alpha=1 - s.momentum)
            v = st.get("v", torch.full_like(delta, s.tau**2))
            d2 = delta * delta
            if rule == "fedadam":
                v = v.mul(s.beta2).add_(d2, alpha=1 - s.beta2)
            elif rule == "fedyogi":
                v = v - (1 - s.beta2) * d2 * torch.sign(v - d2)
            else:  # fedadagrad
                v = v + d2
            st["m"], st["v"] = m, v
            new[k] = x + s.lr * m / (v.sqrt() + s.tau)

    def _check(self, reply: ClientReply) -> None:
        missing = [k for k in self.keys if k not in reply.state]
        if missing:
            raise UpdateError(f"client {reply.client!r} sent no {missing[:3]}")
        for k in self.keys:
            v, ref = reply.state[k], self._global[k]
            if v.shape != ref.shape:
                raise UpdateError(f"client {reply.client!r} sent {k!r} with shape {tuple(v.shape)}, expected "
                                  f"{tuple(ref.shape)}")
            if v.is_floating_point() and not all_finite(v):
                raise DivergenceError(f"client {reply.client!r} sent non-finite values in {k!r} (NaN or inf): its local "
                                  "training diverged; lower the learning rate or check its data")

    def _aggregator(self):
        return robust_aggregator(self.spec.rule, self.robust_f, self.spec.nnm) if self.spec.robust else None

    def _finish_collected(self) -> dict[str, Tensor]:
        replies = self._replies
        if not replies:
            raise UpdateError("no client update to aggregate")
        byz = [i for i, r in enumerate(replies) if self.threat.active and r.client in self.threat.byzantine]
        honest = [i for i in range(len(replies)) if i not in byz]
        if byz and not honest:
            raise UpdateError("every client of the round is Byzantine; nothing honest to aggregate")
        n = len(replies)
        agg = self._aggregator()
        weights = torch.tensor([r.weight for r in replies], dtype=torch.float64)

        def reduce(rows: Tensor, robust: bool = True) -> Tensor:
            if agg is not None and robust:
                return agg(rows)
            w = weights.to(rows.device, rows.dtype).reshape(-1, *([1] * (rows.dim() - 1)))
            return (w * rows).sum(dim=0) / w.sum()

        new: dict[str, Tensor] = {}
        # parameters (and other float entries): pseudo-gradients x - x_k, one flat vector per client
        if self.vector_keys:
            x = torch.cat([self._global[k].reshape(-1).to(torch.float64) for k in self.vector_keys])
            g = torch.stack([x - torch.cat([r.state[k].reshape(-1).to(torch.float64) for k in self.vector_keys])
                             for r in replies])
            if byz and "parameters" in self.threat.targets:
                g[byz] = self._attack(g[honest], len(byz), n)
            nova = self.spec.rule == "fednova"
            if nova:
                # FedNova on the (possibly attacked, robustly reduced) pseudo-gradients: each client's
                # parameter entries divided by its ||a_k||_1, the reduced direction scaled by tau_eff
                a = torch.tensor([fednova_norm(r.num_steps, self.schedule) for r in replies], dtype=torch.float64)
                columns = torch.cat([torch.full((self._global[k].numel(),), k in self.param_keys) for k in self.vector_keys])
                g[:, columns] /= a.unsqueeze(1)
            step = reduce(g, robust=self.spec.robust_scope == "all")
            if nova:
                step[columns] *= float((weights * a).sum() / weights.sum())
            flat = x - step
            offset = 0
            for k in self.vector_keys:
                size = self._global[k].numel()
                new[k] = flat[offset : offset + size].reshape(self._global[k].shape)
                offset += size
        # BatchNorm statistics, layer by layer
        for prefix in self.bn_prefixes:
            mk, vk = f"{prefix}.running_mean", f"{prefix}.running_var"
            means = torch.stack([r.state[mk].to(torch.float64) for r in replies])
            vars_ = torch.stack([r.state[vk].to(torch.float64) for r in replies])
            if byz and "statistics" in self.threat.targets:
                self._byz_means, self._byz_vars = means[byz].clone(), vars_[byz].clone()
                bm, bv = self._attack_stats(means[honest], vars_[honest], len(byz), n)
                means[byz], vars_[byz] = bm, bv
            if prefix in self.fbn_layers:
                counts = [r.bn_counts.get(prefix, 0) for r in replies]
                if not all(counts):
                    raise UpdateError(f"a client sent no batch size for the FBN layer {prefix!r}")
                new[mk], new[vk] = self._fbn(prefix, means, vars_, self.fbn_layers[prefix], counts, agg)
            else:
                new[mk], new[vk] = reduce(means), reduce(vars_).clamp(min=0)
        for k in self.keys:
            if k not in new:  # integer counters
                new[k] = torch.stack([r.state[k] for r in replies]).amax(dim=0)
        if self.spec.rule in SERVER_OPTIMIZERS:
            # the server optimizer steps on the collected mean (or robust aggregate) as on the plain one
            self._server_optimizer_step(new)
        return self._cast(new)

    def _attack(self, honest: Tensor, f: int, n: int) -> Tensor:
        t = self.threat
        if t.attack == "sign_flip":
            return sign_flip(honest, f)
        if t.attack == "fall_of_empires":
            return fall_of_empires(honest, f, eps=t.foe_eps)
        return a_little_is_enough(honest, n, f, z=t.alie_z)

    def _attack_stats(self, means: Tensor, vars_: Tensor, f: int, n: int) -> tuple[Tensor, Tensor]:
        t = self.threat
        if t.attack == "sign_flip" and t.sign_flip_own:
            # each attacker flips its OWN honest running mean (they trained honestly in the simulation)
            return -self._byz_means, self._byz_vars
        if t.attack == "sign_flip":
            return attack_statistics("sign_flip", means, vars_, f)
        if t.attack == "fall_of_empires":
            return attack_statistics("fall_of_empires", means, vars_, f, eps=t.foe_eps)
        return attack_statistics("a_little_is_enough", means, vars_, f, n=n, z=t.alie_z)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        return {"optimizer_state": self.optimizer_state}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer_state = state.get("optimizer_state", {})
