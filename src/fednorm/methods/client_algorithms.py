"""Client algorithms: what a client adds to plain local SGD, as hooks the local training loop calls.

A :class:`ClientAlgorithm` is stateless itself; the state it needs lives in a :class:`ClientContext`
that the engine builds for each client and round:

- ``server_state``: tensors the server broadcasts with the model (SCAFFOLD's control variate c);
- ``client_state``: tensors the client keeps between rounds (SCAFFOLD's c_i, MOON's previous model,
  FedDC's drift h_i), never sent to the server; a method with such state is stateful (not cross-device);
- the message ``on_end`` returns goes to the server, which folds the round's messages into the
  next ``server_state`` with ``update_server_state``.

Hooks, in the order :func:`fednorm.methods.local_update.train_locally` calls them: ``on_start`` (after
the client's model is loaded), per step ``loss_term`` (added to the loss) and ``on_gradients`` (after
backward, before clipping and the optimizer step), then ``on_end``. Every algorithm acts on the entries
the server aggregates (``ctx.shared_params``): with client-specific BN (UniFed's add-on, policy
``local_bn``) the BN parameters have no global counterpart and get no correction, so the add-on composes
with every algorithm without a second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ClientSpec:
    """Which client algorithm and its parameters (unused parameters are ignored by the others)."""

    name: str = "sgd"
    scaffold_option: str = "II"  # SCAFFOLD's control-variate update: "I" (gradient at x) or "II" (cheap)

    def __post_init__(self) -> None:
        if self.name not in CLIENT_ALGORITHMS:
            raise ValueError(f"unknown client algorithm {self.name!r}; choose one of {', '.join(CLIENT_ALGORITHMS)}")
        if self.scaffold_option not in ("I", "II"):
            raise ValueError(f"scaffold_option must be 'I' or 'II', got {self.scaffold_option!r}")

    def build(self) -> "ClientAlgorithm":
        return CLIENT_ALGORITHMS[self.name](self)


@dataclass
class ClientContext:
    """One client's view of one round, handed to every hook."""

    client: str
    lr: float
    shared_params: list[str]  # parameter names the server aggregates
    global_state: dict[str, Tensor]  # the round's global model (shared entries)
    server_state: dict[str, Tensor] = field(default_factory=dict)
    client_state: dict[str, Tensor] = field(default_factory=dict)
    data: object = None  # the client's training Split (SCAFFOLD option I's full gradient)
    prepare: object = None
    scratch: dict = field(default_factory=dict)


class ClientAlgorithm:
    """Plain local SGD: no hook does anything."""

    stateful = False  # keeps client_state between rounds

    def __init__(self, spec: ClientSpec | None = None) -> None:
        self.spec = spec or ClientSpec()

    def init_server_state(self, model: nn.Module, shared_params: list[str]) -> dict[str, Tensor]:
        return {}

    def on_start(self, ctx: ClientContext, model: nn.Module) -> None:
        pass

    def loss_term(self, ctx: ClientContext, model: nn.Module, x: Tensor, y: Tensor, logits: Tensor) -> Tensor | None:
        return None

    def compute_gradients(self, ctx: ClientContext, model: nn.Module, x: Tensor, y: Tensor,
                          forward) -> float | None:
        """Replace the step's forward and backward (Per-FedAvg's two-batch MAML step): fill ``p.grad`` of the
        parameters and return the step's loss, or return None to let the loop do its plain step.
        ``forward(x)`` runs the model under the loop's autocast settings."""
        return None

    def on_gradients(self, ctx: ClientContext, model: nn.Module) -> None:
        pass

    def reply_state(self, ctx: ClientContext, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """The shared entries the client sends (FedDC sends theta_i + h_i); by default its trained state."""
        return state

    def adapt_for_evaluation(self, model: nn.Module, data, prepare, lr: float) -> None:
        """Change the loaded model of a client in place just before it is evaluated (Per-FedAvg's
        personalization steps). By default nothing: the client is evaluated as it is."""

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        return {}

    def update_server_state(self, server_state: dict[str, Tensor], messages: list[dict[str, Tensor]],
                            num_clients: int) -> dict[str, Tensor]:
        return server_state


class Scaffold(ClientAlgorithm):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1): every local step uses g + c - c_i; after K steps
    c_i+ = c_i - c + (x - y_i) / (K lr) (option II) or the full local gradient at x (option I); the client
    sends Delta c_i = c_i+ - c_i and the server sets c = c + (|S| / N) mean_i Delta c_i. The model update
    itself is the server rule's (the paper's global step size 1 with the weighted mean is FedAvg's mean).
    c and c_i start at zero. Control variates cover the shared parameters only."""

    stateful = True

    def init_server_state(self, model: nn.Module, shared_params: list[str]) -> dict[str, Tensor]:
        params = dict(model.named_parameters())
        return {f"c.{k}": torch.zeros_like(params[k], dtype=torch.float32) for k in shared_params}

    def on_start(self, ctx: ClientContext, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        ctx.scratch["params"] = [(params[k], k) for k in ctx.shared_params]
        # c - c_i, fixed for the round
        ctx.scratch["correction"] = {
            k: (ctx.server_state[f"c.{k}"] - ctx.client_state.get(f"c_i.{k}", torch.zeros_like(ctx.server_state[f"c.{k}"])))
            .to(params[k].dtype) for k in ctx.shared_params}

    def on_gradients(self, ctx: ClientContext, model: nn.Module) -> None:
        correction = ctx.scratch["correction"]
        with torch.no_grad():
            for p, k in ctx.scratch["params"]:
                if p.grad is not None:
                    p.grad.add_(correction[k])

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        params = dict(model.named_parameters())
        if self.spec.scaffold_option == "I":
            new_ci = self._full_gradient_at_global(ctx, model)
        else:
            new_ci = {}
            for k in ctx.shared_params:
                c = ctx.server_state[f"c.{k}"]
                ci = ctx.client_state.get(f"c_i.{k}", torch.zeros_like(c))
                drift = (ctx.global_state[k].float() - params[k].detach().float()) / (num_steps * ctx.lr)
                new_ci[k] = ci - c + drift
        message = {}
        for k, value in new_ci.items():
            old = ctx.client_state.get(f"c_i.{k}", torch.zeros_like(value))
            message[f"c.{k}"] = value - old
            ctx.client_state[f"c_i.{k}"] = value
        return message

    def _full_gradient_at_global(self, ctx: ClientContext, model: nn.Module) -> dict[str, Tensor]:
        """Option I: the gradient of the client's loss at the global model x, over all its training data."""
        import torch.nn.functional as F

        current = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict({**current, **ctx.global_state}, strict=False)
        params = dict(model.named_parameters())
        model.zero_grad(set_to_none=True)
        data, n = ctx.data, len(ctx.data)
        was_training = model.training
        model.eval()  # the gradient at x without moving BN statistics
        for start in range(0, n, 500):
            x = ctx.prepare(data.x[start : start + 500])
            loss = F.cross_entropy(model(x).float(), data.y[start : start + 500], reduction="sum") / n
            loss.backward()
        grads = {k: (params[k].grad.detach().float().clone() if params[k].grad is not None
                     else torch.zeros_like(params[k], dtype=torch.float32)) for k in ctx.shared_params}
        model.zero_grad(set_to_none=True)
        model.load_state_dict(current)
        model.train(was_training)
        return grads

    def update_server_state(self, server_state: dict[str, Tensor], messages: list[dict[str, Tensor]],
                            num_clients: int) -> dict[str, Tensor]:
        if not messages:
            return server_state
        scale = len(messages) / num_clients  # |S| / N
        return {k: v + scale * torch.stack([m[k] for m in messages]).mean(dim=0) for k, v in server_state.items()}


CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {
    "sgd": ClientAlgorithm,
    "scaffold": Scaffold,
}
