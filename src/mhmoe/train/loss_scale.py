"""Dynamic loss scaling for float16 training (``train.dtype=float16``).

float16 represents magnitudes from about 6e-8 (subnormal) to 65,504, so the gradients of an fp16 autocast backward
underflow to zero unless the loss is multiplied by a large factor first, and overflow when the factor is too large.
The rule is ``torch.amp.GradScaler``'s: the backward runs on ``loss * scale``, the gradients are divided by
``scale`` before clipping, a step whose gradients are not finite is skipped and halves the scale, and every
``interval`` finite steps in a row double it (defaults 2**16, 2, 0.5, 2000 as GradScaler's).

Why not GradScaler itself: it decides each skip from the gradients of its own process, while the trainer skips
from the global gradient norm (:meth:`mhmoe.train.parallelism.SingleProcess.finish_grads`, all-reduced under
torchrun; expert-parallel gradients differ between ranks until then). Driving the scale by that one flag keeps it
equal on every rank, so DDP averages gradients of the same scale, and the step skips on the device as every
non-finite step does (no host synchronisation). The state (scale, finite steps in a row) is checkpointed with
the trainer state, so a resumed run continues with the same scale, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

INIT_SCALE, GROWTH, BACKOFF, INTERVAL = 2.0**16, 2.0, 0.5, 2000


class LossScale:
    """The loss scale of a run: identity when not ``enabled`` (float32 and bfloat16 runs need none)."""

    def __init__(self, device: torch.device, enabled: bool, init: float | None = None, growth: float = GROWTH,
                 backoff: float = BACKOFF, interval: int = INTERVAL) -> None:
        self.enabled = enabled
        self.growth, self.backoff, self.interval = growth, backoff, interval
        init = INIT_SCALE if init is None else init
        self.scale = torch.full((), init, dtype=torch.float32, device=device)  # 0-dim
        self.finite_run = torch.zeros((), dtype=torch.int64, device=device)  # finite steps since the last change

    def scaled(self, loss: Tensor) -> Tensor:
        """The loss the backward runs on: ``loss * scale``."""
        return loss * self.scale if self.enabled else loss

    def unscale_(self, params: Iterable[nn.Parameter]) -> None:
        """Divide every gradient by the scale, in place (before clipping and the optimizer)."""
        if not self.enabled:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, self.scale.reciprocal())

    def update(self, finite: Tensor) -> None:
        """After the step: halve the scale if ``finite`` (0-dim bool, the same on every rank) is False, double it
        after ``interval`` finite steps in a row; on the device, no host synchronisation."""
        if not self.enabled:
            return
        run = torch.where(finite, self.finite_run + 1, 0)
        grow = run >= self.interval
        factor = torch.where(finite, torch.where(grow, self.growth, 1.0), self.backoff)
        self.scale.mul_(factor)
        self.finite_run.copy_(torch.where(grow, 0, run))

    def state_dict(self) -> dict[str, Tensor]:
        return {"scale": self.scale.detach().cpu().clone(), "finite_run": self.finite_run.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """``state`` as :meth:`state_dict` writes it (checked by :func:`mhmoe.checkpoint.read.check_trainer_state`)."""
        self.scale.copy_(state["scale"])
        self.finite_run.copy_(state["finite_run"])
