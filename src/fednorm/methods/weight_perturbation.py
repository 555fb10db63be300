"""HarmoFL client weight perturbation (Jiang et al. 2022, Sec. 3.3, Eqs. 6-7) as an optimizer wrapper.

For each batch, with the current weights theta:

    g       = grad l(theta)                          first forward/backward
    delta   = alpha * g / ||g||_2                    Eq. 6
    g_delta = grad l(theta + delta)                  second forward/backward
    theta   = base_step(theta, g_delta)              Eq. 7: the step starts from the UNperturbed theta

This is SAM (Foret et al. 2021, non-adaptive, rho = alpha) inside each client. Eq. 6 as printed
divides by the norm of the *loss*; it must be the gradient's norm (as in the official ``WPOptim``).
The paper does not say whether the norm is per layer or global: it is one global L2 norm over every
parameter that has a gradient, all parameter groups together (the official code), plus ``eps =
1e-12`` in the denominator (code). Each group may set its own ``alpha`` (default 0.05, the paper's
grid-search value). Parameters without a gradient in the first pass are not perturbed; the step is the base
optimizer's on the second pass's gradients (so a parameter that gets one only there is still stepped).

Each step costs **two forward and two backward passes**. With this wrapper alone, BatchNorm running
statistics (and anything else a forward pass updates in training mode) are updated by both passes;
the official code has no running statistics (``track_running_stats=False``), so it is silent on this.
:func:`fednorm.methods.local_update.train_locally` (every engine's client step) runs the second pass
inside :func:`~fednorm.models.norm.buffers_kept`, so only the first pass counts.

Usage, with any base optimizer (its momentum and weight decay then act on ``g_delta`` at the
restored weights, as in the code)::

    opt = WeightPerturbation(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), alpha=0.05)

    def closure():                      # no zero_grad needed: step() clears gradients before each call
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure, grad_hook=lambda: clip_unitwise_(params, 0.64))

``grad_hook`` runs after the second backward pass, at the restored weights, just before the base
step (gradient clipping, FedProx's proximal gradient, ...). Code in the closure after ``backward``
acts on both passes' gradients (so it also shapes the perturbation). For full control, call the
phases yourself: ``perturb()`` after the first backward, ``restore()`` after the second, then
``base_optimizer.step()``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.optim import Optimizer

DEFAULT_ALPHA = 0.05
WP_EPS = 1e-12


class WeightPerturbation(Optimizer):
    """Wraps ``base_optimizer`` (an optimizer instance) and shares its parameter groups.

    ``state_dict()`` / ``load_state_dict()`` are the base optimizer's (momentum buffers etc.; the
    groups also carry ``alpha``), so a checkpoint is interchangeable with the plain optimizer's.
    """

    def __init__(self, base_optimizer: Optimizer, alpha: float = DEFAULT_ALPHA, eps: float = WP_EPS) -> None:
        if not isinstance(base_optimizer, Optimizer):
            raise TypeError(
                "WeightPerturbation wraps an optimizer instance, e.g. "
                f"WeightPerturbation(torch.optim.SGD(model.parameters(), lr=0.01)), got {type(base_optimizer).__name__}"
            )
        if alpha < 0:
            raise ValueError(f"the perturbation radius alpha must be >= 0, got {alpha}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.base_optimizer = base_optimizer
        self.eps = float(eps)
        # the groups are the base optimizer's dicts: add_param_group only adds the "alpha" default
        super().__init__(base_optimizer.param_groups, dict(alpha=float(alpha)))
        self.param_groups = base_optimizer.param_groups
        self._backup: dict[torch.Tensor, torch.Tensor] = {}

    @property
    def perturbed(self) -> bool:
        """True between :meth:`perturb` and :meth:`restore`."""
        return bool(self._backup)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients, every group together (Eq. 6's ||g||_2)."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            raise RuntimeError("no parameter has a gradient: run the forward/backward pass before perturb()")
        device = grads[0].device
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads]))

    @torch.no_grad()
    def perturb(self) -> torch.Tensor:
        """theta <- theta + alpha * g / (||g||_2 + eps) from the current gradients (Eq. 6); returns ||g||_2."""
        if self._backup:
            raise RuntimeError("the weights are already perturbed: call restore() first")
        norm = self.grad_norm()
        for group in self.param_groups:
            scale = group["alpha"] / (norm + self.eps)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._backup[p] = p.detach().clone()  # exact restore, no p + d - d rounding
                p.add_(p.grad * scale.to(p.device, p.dtype))
        return norm

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the unperturbed weights theta (gradients, now g_delta, are left as they are)."""
        for p, saved in self._backup.items():
            p.copy_(saved)
        self._backup.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], torch.Tensor] | None = None,
        grad_hook: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One HarmoFL step: two closure calls, then the base optimizer's step; returns the loss at theta.

        ``closure`` computes the loss and calls ``backward()``; gradients are cleared before each
        call. ``grad_hook`` may modify the gradients g_delta before the base step.
        """
        if closure is None:
            raise RuntimeError(
                "WeightPerturbation.step needs a closure that computes the loss and calls backward(): "
                "the gradient is evaluated twice, at theta and at theta + delta"
            )
        if self._backup:
            raise RuntimeError("step() called while the weights are perturbed; call restore() first")
        self.zero_grad()
        with torch.enable_grad():
            loss = closure()
        self.perturb()
        try:
            self.zero_grad()
            with torch.enable_grad():
                closure()
        finally:
            self.restore()  # never leave the model perturbed, even if the second pass fails
        if grad_hook is not None:
            grad_hook()
        self.base_optimizer.step()
        return loss.detach() if isinstance(loss, torch.Tensor) else loss

    # checkpoints hold the base optimizer's state; the perturbation is transient
    def state_dict(self) -> dict:
        return self.base_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        self.param_groups = self.base_optimizer.param_groups
        for group in self.param_groups:
            group.setdefault("alpha", self.defaults["alpha"])

    def __repr__(self) -> str:
        alphas = sorted({g["alpha"] for g in self.param_groups})
        return f"WeightPerturbation(alpha={alphas[0] if len(alphas) == 1 else alphas}, base={self.base_optimizer!r})"
