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

Algorithms: SCAFFOLD (Karimireddy et al. 2020), MOON (Li, He, Song CVPR 2021), FedDC (Gao et al. CVPR 2022)
and Per-FedAvg (Fallah et al. NeurIPS 2020), the client-side algorithms UniFed (Jiang et al.) combines with
client-specific BN. Each class docstring says which paper / official-code details it follows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..models.norm import buffers_kept
from ..models.projection import output_layer

PERFEDAVG_VARIANTS = ("fo", "hf")
PERFEDAVG_EVAL_DATA = ("test", "train")


@dataclass(frozen=True)
class ClientSpec:
    """Which client algorithm and its parameters (unused parameters are ignored by the others)."""

    name: str = "sgd"
    scaffold_option: str = "II"  # SCAFFOLD's control-variate update: "I" (gradient at x) or "II" (cheap)
    # option I's full gradient at x with BatchNorm in "eval" mode (the running statistics x carries, dropout off:
    # the gradient of the model the server evaluates; our default) or "batch" mode (train mode on consecutive
    # chunks of the training batch size, each normalized with its own batch statistics, running statistics left
    # as they were: the mean of the minibatch gradients the local steps take). The paper has no BatchNorm
    scaffold_gradient_bn: str = "eval"
    # option II's divisor K lr (SCAFFOLD and FedDC): K = the momentum-effective step count (True, our default: c_i
    # stays a gradient estimate under momentum), or the literal K of the papers' plain-SGD formula (False;
    # FedDC's official code divides by K lr whatever its momentum). The same without momentum
    scaffold_effective_steps: bool = True
    # MOON: loss weight mu and temperature tau. tau = 0.5 is the paper's; mu = 1 is the official code's default
    # (the paper tunes mu in {0.1, 1, 5, 10}: 5 best on CIFAR-10, 1 on CIFAR-100 / Tiny-ImageNet)
    moon_mu: float = 1.0
    moon_tau: float = 0.5
    # the module whose INPUT is MOON's representation z; None = the model's last nn.Linear (the output layer),
    # so z is what the output layer sees: the projection-head output with model.projection_dim (see Moon)
    moon_layer: str | None = None
    # FedDC: weight alpha of the penalty (alpha/2)||theta_i + h_i - theta||^2 (official CIFAR scripts: 1e-2)
    feddc_alpha: float = 0.01
    # Per-FedAvg: inner (personalization) step size alpha; the outer step size beta is the training lr
    perfedavg_alpha: float = 0.01
    perfedavg_variant: str = "fo"  # "fo": first-order (FO) approximation; "hf": Hessian-free (HF) variant
    perfedavg_delta: float = 0.001  # HF's finite-difference radius delta
    # Per-FedAvg at evaluation: this many SGD steps with lr alpha on perfedavg_eval_batch labelled samples of
    # the split being scored ("test": UniFed's "extra SGD update steps using several labeled test data" for the
    # test metric; the validation metric, which selects the reported round, adapts on validation samples, so no
    # test label reaches model selection; the engine leaves them out of that split's metric, see
    # evaluation_holdout) or of its "train" split (the alternative reading of Per-FedAvg's "one step of local
    # SGD at test time": the client's own training data, for every split)
    perfedavg_eval_steps: int = 1
    perfedavg_eval_batch: int = 32
    perfedavg_eval_data: str = "test"
    perfedavg_eval_seed: int = 0  # seeds which samples the evaluation steps use

    def __post_init__(self) -> None:
        if self.name not in CLIENT_ALGORITHMS:
            raise ValueError(f"unknown client algorithm {self.name!r}; choose one of {', '.join(CLIENT_ALGORITHMS)}")
        if self.scaffold_option not in ("I", "II"):
            raise ValueError(f"scaffold_option must be 'I' or 'II', got {self.scaffold_option!r}")
        if self.scaffold_gradient_bn not in ("eval", "batch"):
            raise ValueError(f"scaffold_gradient_bn must be 'eval' or 'batch', got {self.scaffold_gradient_bn!r}")
        if self.moon_mu < 0:
            raise ValueError(f"moon_mu must be >= 0, got {self.moon_mu}")
        if self.moon_tau <= 0:
            raise ValueError(f"moon_tau (MOON's temperature) must be > 0, got {self.moon_tau}")
        if self.feddc_alpha < 0:
            raise ValueError(f"feddc_alpha must be >= 0, got {self.feddc_alpha}")
        if self.perfedavg_alpha <= 0:
            raise ValueError(f"perfedavg_alpha (Per-FedAvg's inner step size) must be > 0, got {self.perfedavg_alpha}")
        if self.perfedavg_variant not in PERFEDAVG_VARIANTS:
            raise ValueError(f"perfedavg_variant must be one of {', '.join(PERFEDAVG_VARIANTS)}, "
                             f"got {self.perfedavg_variant!r}")
        if self.perfedavg_delta <= 0:
            raise ValueError(f"perfedavg_delta must be > 0, got {self.perfedavg_delta}")
        if self.perfedavg_eval_steps < 0:
            raise ValueError("perfedavg_eval_steps must be >= 0 (0 = no personalization), "
                             f"got {self.perfedavg_eval_steps}")
        if self.perfedavg_eval_batch < 1:
            raise ValueError(f"perfedavg_eval_batch must be >= 1, got {self.perfedavg_eval_batch}")
        if self.perfedavg_eval_data not in PERFEDAVG_EVAL_DATA:
            raise ValueError(f"perfedavg_eval_data must be one of {', '.join(PERFEDAVG_EVAL_DATA)}, "
                             f"got {self.perfedavg_eval_data!r}")

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
    momentum: float = 0.0  # the local SGD's momentum and its style (SCAFFOLD option II's effective step count)
    momentum_style: str = "pytorch"
    task: object = None  # the run's Task (loss and targets); None: classification
    batch_size: int = 500  # the local training batch size (SCAFFOLD option I's chunks in "batch" mode)


def effective_steps(num_steps: int, momentum: float = 0.0, momentum_style: str = "pytorch") -> float:
    """How many gradient lengths K steps of the local SGD move the weights under a constant gradient, from a
    zero momentum buffer: K without momentum; ``pytorch`` (buf = momentum buf + g) up to K / (1 - momentum)
    (FedNova's ||a||_1); ``ema`` (buf = momentum buf + (1 - momentum) g, from 0) K - momentum (1 - momentum^K)
    / (1 - momentum), below K (:func:`fednorm.methods.local_update.build_optimizer`)."""
    gain = 1 - momentum if momentum_style == "ema" else 1.0
    buf = total = 0.0
    for _ in range(num_steps):
        buf = momentum * buf + gain
        total += buf
    return total


class ClientAlgorithm:
    """Plain local SGD: no hook does anything."""

    stateful = False  # keeps client_state between rounds
    kept_state = "nothing"  # what that state is, for messages (e.g. why a method cannot run cross-device)

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

    # whether adapt_for_evaluation changes the model: the engine then reloads the client before each split
    adapts_at_evaluation = False

    def adapt_for_evaluation(self, model: nn.Module, data, prepare, lr: float, split: str = "test",
                             task=None) -> None:
        """Change the loaded model of a client in place just before its ``split`` is evaluated (Per-FedAvg's
        personalization steps). By default nothing: the client is evaluated as it is."""

    def evaluation_holdout(self, data, split: str = "test") -> Tensor | None:
        """Indices of the samples of ``split`` that ``adapt_for_evaluation(..., split)`` learned from on the
        client ``data`` (a ClientData): the engine must leave them out of that split's metric. By default none."""
        return None

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        return {}

    def update_server_state(self, server_state: dict[str, Tensor], messages: list[dict[str, Tensor]],
                            num_clients: int) -> dict[str, Tensor]:
        return server_state


class Scaffold(ClientAlgorithm):
    """SCAFFOLD (Karimireddy et al. 2020, Algorithm 1): every local step uses g + c - c_i; after K steps
    c_i+ = c_i - c + (x - y_i) / (K lr) (option II) or the full local gradient at x (option I: x is the model the
    client started the round from, BatchNorm as ``scaffold_gradient_bn`` says, since the paper has none); the client
    sends Delta c_i = c_i+ - c_i and the server sets c = c + (|S| / N) mean_i Delta c_i. The model update
    itself is the server rule's (the paper's global step size 1 with the weighted mean is FedAvg's mean).
    c and c_i start at zero. Control variates cover the shared parameters only.

    The paper's local solver is plain SGD. With momentum, K steps move the weights about
    lr * g * effective_steps(K) (up to K / (1 - momentum)), so option II divides by that instead of K, which
    keeps c_i an estimate of the gradient (dividing by K inflates it up to 10x at momentum 0.9, and the
    corrected steps then diverge: measured on digits at lr 0.001). Without momentum both are K."""

    stateful = True
    kept_state = "its control variate c_i (SCAFFOLD)"

    def init_server_state(self, model: nn.Module, shared_params: list[str]) -> dict[str, Tensor]:
        params = dict(model.named_parameters())
        return {f"c.{k}": torch.zeros_like(params[k], dtype=torch.float32) for k in shared_params}

    def on_start(self, ctx: ClientContext, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        ctx.scratch["params"] = [(params[k], k) for k in ctx.shared_params]
        if self.option == "I":  # x: the client's model as the round starts (global entries and its own local ones)
            ctx.scratch["start"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
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

    @property
    def option(self) -> str:
        return self.spec.scaffold_option

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        params = dict(model.named_parameters())
        if self.option == "I":
            new_ci = self._full_gradient_at_global(ctx, model)
        else:
            new_ci = {}
            for k in ctx.shared_params:
                c = ctx.server_state[f"c.{k}"]
                ci = ctx.client_state.get(f"c_i.{k}", torch.zeros_like(c))
                steps = (effective_steps(num_steps, ctx.momentum, ctx.momentum_style)
                         if self.spec.scaffold_effective_steps else num_steps)
                drift = (ctx.global_state[k].float() - params[k].detach().float()) / (steps * ctx.lr)
                new_ci[k] = ci - c + drift
        message = {}
        for k, value in new_ci.items():
            old = ctx.client_state.get(f"c_i.{k}", torch.zeros_like(value))
            message[f"c.{k}"] = value - old
            ctx.client_state[f"c_i.{k}"] = value
        return message

    def _full_gradient_at_global(self, ctx: ClientContext, model: nn.Module) -> dict[str, Tensor]:
        """Option I: the gradient of the client's loss at x, over all its training data. x is the model the client
        started the round from: the global entries and, under client-specific BN, its own BN state of the round's
        start (not the one its local steps reached). BatchNorm as ``scaffold_gradient_bn`` says."""
        current = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(ctx.scratch["start"])
        params = dict(model.named_parameters())
        model.zero_grad(set_to_none=True)
        data, n = ctx.data, len(ctx.data)
        was_training = model.training
        batch_mode = self.spec.scaffold_gradient_bn == "batch"
        model.train(batch_mode)
        chunk = ctx.batch_size if batch_mode else 500  # eval mode: any chunking gives the same gradient
        bounds = list(range(0, n, chunk)) + [n]
        if batch_mode and len(bounds) > 2 and n - bounds[-2] == 1:
            del bounds[-2]  # no batch of one image in train mode (BatchNorm has no variance): it joins the one before
        # batch mode moves the running statistics; restoring ``current`` below puts back what the local steps left
        for start, stop in zip(bounds[:-1], bounds[1:]):
            x = ctx.prepare(data.x[start:stop])
            y = data.y[start:stop]
            if ctx.task is None:
                loss = F.cross_entropy(model(x).float(), y.to(x.device), reduction="sum") / n
            else:  # the task's batch-mean loss, weighted by the chunk's share of the data
                loss = ctx.task.loss(model(x), ctx.task.target(y).to(x.device)) * (len(y) / n)
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


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """MOON's model-contrastive loss l_con (Li et al. 2021, Eq. 2), averaged over the batch:
    -log(exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau))), sim = cosine similarity.
    It is the cross-entropy of the logits [sim(z, z_glob), sim(z, z_prev)] / tau with target 0, as in the
    official code. Representations are flattened per sample and compared in float32."""
    z, z_glob, z_prev = (t.flatten(1).float() for t in (z, z_glob, z_prev))
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def representation_module(model: nn.Module, name: str | None = None) -> tuple[str, nn.Module]:
    """The module whose input is MOON's representation z: the one named ``name``, or the model's last
    ``nn.Linear`` (in registration order: the output layer of every fednorm model)."""
    modules = dict(model.named_modules())
    if name is None:
        found = output_layer(model)
        if found is None:
            raise ValueError("MOON takes its representation z as the input of the model's last nn.Linear, but the "
                             "model has none; set ClientSpec.moon_layer to the module whose input is z")
        return found
    if name not in modules or name == "":
        raise ValueError(f"moon_layer {name!r} is not a submodule of the model; it must name the module whose input "
                         f"is z, one of {', '.join(n for n in modules if n)}")
    return name, modules[name]


class _Capture:
    """Forward pre-hook keeping the (first) input of a module: MOON's z."""

    def __init__(self) -> None:
        self.z: Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple) -> None:
        self.z = args[0]


def _frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` in eval mode without gradients (MOON's global and previous models)."""
    frozen = copy.deepcopy(model)
    frozen.eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
        p.grad = None
    return frozen


class Moon(ClientAlgorithm):
    """MOON (Li, He, Song CVPR 2021, Algorithm 1): each local step adds mu * l_con(z, z_glob, z_prev) to the
    cross-entropy, z from the model being trained, z_glob from the round's global model, z_prev from the
    client's model at the end of its previous round (kept in ``client_state`` as ``prev.<key>``: the full
    state, since under policy ``shared`` its BN statistics are overwritten by the server's).

    - The global model is a frozen copy of the client's model as loaded at the start of the round: the global
      shared entries plus the client's own local entries (its BN under ``local_bn``), so client-specific BN
      composes: z_glob is computed with the client's own BN, as UniFed needs.
    - The global and previous models run in eval mode (BN with running statistics), as in the official code.
    - z: MOON's model is base encoder -> projection head (a 2-layer MLP, out_dim 256) -> output layer, and z
      is the projection-head output, i.e. the output layer's input; z is taken as the input of the last
      nn.Linear. ``model.projection_dim: 256`` gives the model MOON's head (models/projection.py; part of the
      model, aggregated as any weight, for every method of the run); without it (the default, the model as the
      other methods have it) the output layer's input plays its part (for DigitCNN: the 512-d output of
      FC2 -> BN -> ReLU). ``moon_layer`` names another module whose input is z instead (e.g. "classifier.0" for
      the flattened conv features, the encoder output without a head).
    - First round of a client: it has no previous model; the previous model is then the global model
      (z_prev = z_glob), which makes l_con = log 2, a constant with zero gradient. The official code instead
      has an empty model pool in round 0 (l_con = 0): the same training, only the reported loss differs.
      Under partial participation (federation.fraction < 1) a client first sampled in a later round also gets
      z_prev = z_glob here, where the official code (``old_nets = copy.deepcopy(nets)``) contrasts with the
      client's never-trained, separately initialised network: a random negative we do not reproduce.
    - One previous model (the paper's and the code's default model_buffer_size 1).
    """

    stateful = True
    kept_state = "its model of the previous round (MOON's z_prev)"

    def on_start(self, ctx: ClientContext, model: nn.Module) -> None:
        name, _ = representation_module(model, self.spec.moon_layer)
        # copies first: a deepcopy would carry the working model's hook along
        glob = _frozen_copy(model)
        prev_state = {k[5:]: v for k, v in ctx.client_state.items() if k.startswith("prev.")}
        prev = None
        if prev_state:
            prev = _frozen_copy(model)
            prev.load_state_dict(prev_state)
        captures, handles = {}, []
        for role, net in (("z", model), ("glob", glob), ("prev", prev)):
            if net is None:
                continue
            captures[role] = _Capture()
            handles.append(dict(net.named_modules())[name].register_forward_pre_hook(captures[role]))
        ctx.scratch["moon"] = (glob, prev, captures, handles)

    def loss_term(self, ctx: ClientContext, model: nn.Module, x: Tensor, y: Tensor, logits: Tensor) -> Tensor | None:
        glob, prev, captures, _ = ctx.scratch["moon"]
        z = captures["z"].z
        if z is None:
            raise RuntimeError("MOON saw no representation in this step's forward pass: the module named by "
                               "moon_layer (or the last nn.Linear) was not called")
        captures["z"].z = None
        with torch.no_grad():
            glob(x)
            z_glob = captures["glob"].z
            z_prev = z_glob
            if prev is not None:
                prev(x)
                z_prev = captures["prev"].z
        return self.spec.moon_mu * model_contrastive_loss(z, z_glob, z_prev, self.spec.moon_tau)

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        _, _, _, handles = ctx.scratch.pop("moon")
        for handle in handles:
            handle.remove()
        for k, v in model.state_dict().items():
            ctx.client_state[f"prev.{k}"] = v.detach().clone()
        return {}


class FedDC(Scaffold):
    """FedDC (Gao et al. CVPR 2022), as in its official code (``train_FedDC`` / ``train_model_FedDC``).

    The client keeps a drift h_i and a gradient-correction state g_i; the server keeps g (the mean of the g_i).
    Each local step minimizes f_i(theta_i) + (alpha/2)||theta_i + h_i - theta||^2 + <theta_i, g - g_i>, i.e. the
    gradient gets + alpha (theta_i + h_i - theta) + (g - g_i) (added exactly in ``on_gradients``; like FedProx's
    term here, the penalty is not in the reported loss). After the K local steps:
    g_i+ = g_i - g + (theta - theta_i) / (K lr) (with momentum K is SCAFFOLD's ``effective_steps``, as for
    SCAFFOLD here; the official code divides by K lr whatever its momentum) and the client sends
    Delta g_i = g_i+ - g_i; the server sets
    g += (1/N) sum_i Delta g_i (the code's ``state_gadient_diffs``: this is SCAFFOLD's option II with c = g,
    c_i = g_i, so the keys are SCAFFOLD's ``c.<name>`` / ``c_i.<name>``); then h_i += theta_i - theta, and the
    client sends theta_i + h_i (with the updated h_i, as the code) for the server's weighted mean.
    h_i, g_i and g start at zero and cover the shared parameters only (client-specific BN gets plain SGD).

    Differences from the official code, named: (1) the code aggregates mean_{i in S}(theta_i) + mean_{all i}(h_i)
    (uniform means), which equals the mean of theta_i + h_i under full participation only; here the server
    averages what each participant sends (theta_i + h_i, the upload FedDC describes; its paper's text was not at
    hand to check Algorithm 1's exact server formula) with the federation's weighting ("uniform" = the code's); (2) with the client-size weight w_i = n_i / mean(n) (1 for equal sizes)
    the code uses alpha / w_i and g / w_i on client i and sends w_i Delta g_i; here w_i = 1; (3) the code's K is
    the number of local steps of an average-size client, here each client's own step count; (4) the code clips
    gradients at norm 10 (not part of the method: use the training config).
    """

    stateful = True
    kept_state = "its drift h_i and gradient correction g_i (FedDC)"

    @property
    def option(self) -> str:
        return "II"  # FedDC's g_i update is SCAFFOLD's option II

    def on_start(self, ctx: ClientContext, model: nn.Module) -> None:
        super().on_start(ctx, model)
        params = dict(model.named_parameters())
        anchor = {}
        for k in ctx.shared_params:
            target = ctx.global_state[k].to(params[k].dtype)
            h = ctx.client_state.get(f"h_i.{k}")
            anchor[k] = target - h.to(params[k].dtype) if h is not None else target
        ctx.scratch["anchor"] = anchor  # theta - h_i: the penalty pulls theta_i towards it

    def on_gradients(self, ctx: ClientContext, model: nn.Module) -> None:
        super().on_gradients(ctx, model)  # + (g - g_i)
        anchor, alpha = ctx.scratch["anchor"], self.spec.feddc_alpha
        with torch.no_grad():
            for p, k in ctx.scratch["params"]:
                if p.grad is not None:
                    p.grad.add_(p.detach() - anchor[k], alpha=alpha)

    def on_end(self, ctx: ClientContext, model: nn.Module, num_steps: int) -> dict[str, Tensor]:
        message = super().on_end(ctx, model, num_steps)
        params = dict(model.named_parameters())
        for k in ctx.shared_params:
            drift = params[k].detach().float() - ctx.global_state[k].float()
            old = ctx.client_state.get(f"h_i.{k}")
            ctx.client_state[f"h_i.{k}"] = drift if old is None else old + drift
        return message

    def reply_state(self, ctx: ClientContext, state: dict[str, Tensor]) -> dict[str, Tensor]:
        out = dict(state)
        for k in ctx.shared_params:
            h = ctx.client_state.get(f"h_i.{k}")
            if h is not None:
                out[k] = state[k] + h.to(state[k].dtype)
        return out


def _task_loss(task):
    """The run's training loss (focal loss, class weights, ...); cross-entropy where no task is given."""
    return F.cross_entropy if task is None else task.loss


def _bn_in_training(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) and m.training for m in model.modules())


class PerFedAvg(ClientAlgorithm):
    """Per-FedAvg (Fallah, Mokhtari, Ozdaglar NeurIPS 2020, Algorithm 1 and its FO / HF variants).

    Each local step splits the loop's mini-batch (already a random draw) into D and D' (first and second
    halves; thirds D, D', D'' for HF), takes the temporary step theta' = theta - alpha grad f(theta; D) and
    puts into ``p.grad``:

    - ``fo`` (Per-FedAvg (FO), default): grad f(theta'; D');
    - ``hf`` (Per-FedAvg (HF)): u - alpha d with u = grad f(theta'; D') and the finite-difference Hessian-vector
      product d = [grad f(theta + delta u; D'') - grad f(theta - delta u; D'')] / (2 delta).

    The loop's optimizer then steps theta with the training lr = the paper's beta. The paper draws D, D', D''
    independently, each of the full batch size; splitting one mini-batch keeps the loop's batch schedule
    (double training.batch_size for halves of the usual size). A batch too small to split (fewer than 2 samples
    per part for a BN model in training mode, fewer than 1 otherwise) is used whole for every part. The
    forwards on D and D' update BN running statistics as any training forward does; HF's perturbed forwards
    do not (buffers are restored). The step's reported loss is f(theta'; D'), the meta-objective. All trainable
    parameters take part (client-specific BN included: the personalization covers the whole local model). f is the
    run's training loss (``task.loss``: cross-entropy, or e.g. ISIC 2019's focal loss), in training and at evaluation.
    With weight perturbation (HarmoFL) the step's gradient is this meta-gradient at the perturbed weights.

    At evaluation (``adapt_for_evaluation``) the client's model takes ``perfedavg_eval_steps`` SGD steps with
    lr alpha, each on the same ``perfedavg_eval_batch`` labelled samples (a seeded draw) of the split being
    scored (UniFed's protocol: test samples for the test metric, validation samples for the validation
    metric) or of its training split (``perfedavg_eval_data="train"``), in training mode.
    Stateless between rounds.
    """

    @property
    def adapts_at_evaluation(self) -> bool:
        return self.spec.perfedavg_eval_steps > 0

    def compute_gradients(self, ctx: ClientContext, model: nn.Module, x: Tensor, y: Tensor, forward) -> float | None:
        spec = self.spec
        hf = spec.perfedavg_variant == "hf"
        parts = self.split_batch(model, x, y, 3 if hf else 2)
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        (x_d, y_d), (x_o, y_o) = parts[0], parts[1]
        loss = _task_loss(ctx.task)
        inner = loss(forward(x_d).float(), y_d)
        grads = torch.autograd.grad(inner, params, allow_unused=True)
        with torch.no_grad():
            for p, g in zip(params, grads):
                if g is not None:
                    p.sub_(g.to(p.dtype), alpha=spec.perfedavg_alpha)  # theta' = theta - alpha grad f(theta; D)
        outer = loss(forward(x_o).float(), y_o)
        u = torch.autograd.grad(outer, params, allow_unused=True)
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        if hf:
            d = self._hessian_vector(model, params, u, parts[2], forward, loss)
            u = [None if ui is None else ui - spec.perfedavg_alpha * di for ui, di in zip(u, d)]
        for p, g in zip(params, u):
            p.grad = None if g is None else g.detach().to(p.dtype)
        return float(outer.detach())

    @staticmethod
    def split_batch(model: nn.Module, x: Tensor, y: Tensor, parts: int) -> list[tuple[Tensor, Tensor]]:
        """The batch cut into ``parts`` consecutive pieces (sizes differ by at most one, the first larger)."""
        n = len(y)
        if n < parts * (2 if _bn_in_training(model) else 1):
            return [(x, y)] * parts
        return [(x[c], y[c]) for c in torch.tensor_split(torch.arange(n), parts)]

    def _hessian_vector(self, model, params, u, piece, forward, loss_fn) -> list[Tensor]:
        """HF's [grad f(theta + delta u; D'') - grad f(theta - delta u; D'')] / (2 delta), buffers untouched."""
        delta = self.spec.perfedavg_delta
        x_h, y_h = piece
        start = [p.detach().clone() for p in params]
        vectors = [torch.zeros_like(p) if ui is None else ui.detach() for p, ui in zip(params, u)]
        sides = []
        with buffers_kept(model):
            for sign in (1.0, -1.0):
                with torch.no_grad():
                    for p, s, v in zip(params, start, vectors):
                        p.copy_(s + sign * delta * v.to(p.dtype))
                loss = loss_fn(forward(x_h).float(), y_h)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                sides.append([torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)])
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        return [(gp - gm) / (2 * delta) for gp, gm in zip(*sides)]

    # ------------------------------------------------------------------ evaluation
    def adaptation_index(self, n: int) -> Tensor:
        """Which of a split's ``n`` samples the evaluation steps learn from (seeded, sorted)."""
        g = torch.Generator().manual_seed(self.spec.perfedavg_eval_seed)
        return torch.randperm(n, generator=g)[: min(self.spec.perfedavg_eval_batch, n)].sort().values

    def _adaptation_split(self, data, split: str):
        from ..data.domain import Split  # local import: data does not depend on methods

        if isinstance(data, Split):
            return data
        return getattr(data, split if self.spec.perfedavg_eval_data == "test" else "train", None)

    def adapt_for_evaluation(self, model: nn.Module, data, prepare, lr: float, split: str = "test",
                             task=None) -> None:
        """``perfedavg_eval_steps`` SGD steps with lr alpha (not the engine's ``lr``, which is beta) on the
        evaluation batch of ``data`` (a ClientData: its ``split``, or its train split with
        ``perfedavg_eval_data="train"``; a Split: that split)."""
        spec = self.spec
        name = split
        split = self._adaptation_split(data, name)
        if spec.perfedavg_eval_steps == 0 or split is None or len(split) == 0:
            return
        index = self.adaptation_index(len(split))
        has_bn = any(isinstance(m, _BatchNorm) for m in model.modules())
        if has_bn and len(index) < 2:
            raise ValueError("Per-FedAvg's evaluation step needs at least 2 labelled samples for a BatchNorm model "
                             f"(its {name if spec.perfedavg_eval_data == 'test' else 'train'} split gives {len(index)})")
        x = prepare(split.x[index])
        y = (split.y[index] if task is None else task.target(split.y[index])).to(x.device)
        loss = _task_loss(task)
        was_training = model.training
        model.train()  # a local SGD step: BN uses batch statistics and updates its running ones
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=spec.perfedavg_alpha)
        with torch.enable_grad():
            for _ in range(spec.perfedavg_eval_steps):
                optimizer.zero_grad(set_to_none=True)
                loss(model(x).float(), y).backward()
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.train(was_training)

    def evaluation_holdout(self, data, split: str = "test") -> Tensor | None:
        from ..data.domain import Split

        spec = self.spec
        if spec.perfedavg_eval_steps == 0 or spec.perfedavg_eval_data != "test" or isinstance(data, Split):
            return None
        samples = getattr(data, split, None)
        if samples is None or len(samples) == 0:
            return None
        return self.adaptation_index(len(samples))


CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {
    "sgd": ClientAlgorithm,
    "scaffold": Scaffold,
    "moon": Moon,
    "feddc": FedDC,
    "perfedavg": PerFedAvg,
}
