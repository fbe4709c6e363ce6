"""Activation checkpointing: keep less for the backward, compute it again there.

``train.activation_checkpointing`` (:data:`mhmoe.config.train.Recompute`) picks what a training forward keeps:

- ``none``: every activation the backward needs (the default; fastest).
- ``moe``: the FFN sub-layer of every MoE block (its pre-norm, router, dispatch, experts, head and merge
  projections) keeps only its input and runs again in the backward. The MoE layer's activations are the large
  ones: routed rows, the experts' hidden pre-activations (S * K rows of F each), the head/merge projections'.
- ``blocks``: every transformer block keeps only its input (attention and FFN run again in the backward):
  the least memory, the most recomputation (about one more forward).

It is applied from outside the model code: :func:`set_activation_checkpointing` sets each block's ``recompute``
(:class:`~mhmoe.model.lm.Block` is a :class:`Recomputable`; its parameter names, and so checkpoints, stay the
same), and the block runs the chosen part under :func:`torch.utils.checkpoint.checkpoint` (non-reentrant: works
with DDP, FSDP2, expert parallelism, ``torch.compile`` and the custom autograd functions of every dispatch path)
only when it records a graph (a training forward with gradients); evaluation and generation run as before.

Recomputation reproduces the forward exactly: the global RNG (the noisy router's noise, X-MoE's coin flips)
is restored by ``torch.utils.checkpoint``; a router's own ``torch.Generator`` and the X-MoE code reading's
in-place rescale of its expert embeddings are handled by :func:`recompute_context`. So a run trains the
same weights, bit for bit on a CPU, whatever this setting (``tests/model/test_recompute.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mhmoe.moe.routers import XMoERouter

#: what a block runs again in the backward: nothing, the whole block, its FFN sub-layer
BlockRecompute = Literal["none", "block", "ffn"]


class Recomputable(nn.Module):
    """A transformer block (:class:`mhmoe.model.lm.Block`) as :func:`set_activation_checkpointing` sees it:
    ``recompute``, the part its training forward runs under activation checkpointing; ``is_moe``, whether its FFN
    is an MoE layer."""

    recompute: BlockRecompute = "none"
    is_moe: bool


def set_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Set what every block of ``model`` (a decoder LM or the encoder) recomputes in the backward: ``mode``
    ``none`` | ``moe`` (the FFN sub-layer of the MoE blocks) | ``blocks`` (every block). Returns the number of
    blocks that recompute something."""
    if mode not in ("none", "moe", "blocks"):
        raise ValueError(f"invalid activation checkpointing mode={mode!r}: allowed none | moe | blocks")
    n = 0
    for block in model.modules():
        if isinstance(block, Recomputable):
            part: BlockRecompute = "block" if mode == "blocks" else "ffn" if mode == "moe" and block.is_moe else "none"
            block.recompute = part
            n += part != "none"
    return n


def run_part(module: nn.Module, recompute: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; under :func:`torch.utils.checkpoint.checkpoint` when ``recompute`` and this forward records
    a graph (``module`` in training mode, gradients enabled): then nothing ``fn`` saves for the backward is kept,
    ``fn`` runs again there. ``module``: the part ``fn`` runs (its X-MoE routers get :func:`recompute_context`)."""
    if not (recompute and module.training and torch.is_grad_enabled()):
        return fn(*args)
    routers = [m for m in module.modules() if isinstance(m, XMoERouter) and (m.code or m.generator is not None)]
    if not routers:
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=lambda: recompute_context(routers))


def recompute_context(routers: list[XMoERouter]) -> tuple[contextlib.AbstractContextManager,
                                                          contextlib.AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a part with X-MoE routers: (the forward's context, the
    recomputation's). The forward's records each router's generator state; the recomputation's starts each
    generator from it (the same coin flips) and puts it back afterwards (the next forward continues where the
    first left it), and sets ``recomputing`` so that the code reading does not rescale its stored expert
    embeddings a second time."""
    states: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        for i, r in enumerate(routers):
            if r.generator is not None:
                states[i] = r.generator.get_state()
        yield

    @contextlib.contextmanager
    def again() -> Iterator[None]:
        now = {i: cast(torch.Generator, r.generator).get_state() for i, r in enumerate(routers) if i in states}
        for i, r in enumerate(routers):
            r.recomputing = True
            if i in states:
                cast(torch.Generator, r.generator).set_state(states[i])
        try:
            yield
        finally:
            for i, r in enumerate(routers):
                r.recomputing = False
                if i in now:
                    cast(torch.Generator, r.generator).set_state(now[i])

    return forward(), again()
