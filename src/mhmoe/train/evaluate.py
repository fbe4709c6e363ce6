"""Evaluation: perplexity on every validation set, and measured forward FLOPs per token."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from mhmoe.data import iter_eval_batches
from mhmoe.model.lm import LM


@torch.no_grad()
def evaluate(model: LM, val: dict[str, np.ndarray], *, batch_size: int, seq_len: int, max_batches: int | None,
             device: torch.device | str = "cpu", dtype: str = "float32",
             on_batch: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """Token-weighted mean cross-entropy and perplexity per validation set.

    Returns ``{name: {"loss": nats/token, "ppl": exp(loss), "tokens": n}}``. Windows are
    non-overlapping and deterministic (:func:`mhmoe.data.iter_eval_batches`). ``on_batch`` is called
    after each batch (a progress bar).
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    out: dict[str, dict[str, float]] = {}
    for name, tokens in val.items():
        total, n = 0.0, 0
        for x, y in iter_eval_batches(tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches):
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                res = model(x, y, return_logits=False)
            total += float(res.loss) * y.numel()
            n += y.numel()
            if on_batch is not None:
                on_batch()
        if n:
            loss = total / n
            out[name] = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": n}
    model.train(was_training)
    return out


@torch.no_grad()
def forward_flops_per_token(model: LM, seq_len: int, device: torch.device | str = "cpu") -> float:
    """Matmul FLOPs of one forward pass per token, measured with FlopCounterMode (2*m*n*p per
    product; includes attention and the LM head). Dropless top-k routing makes it data-independent."""
    was_training = model.training
    model.eval()
    idx = torch.randint(0, model.cfg.vocab_size, (1, seq_len), device=device)
    with FlopCounterMode(display=False) as counter:
        model(idx)
    model.train(was_training)
    return counter.get_total_flops() / seq_len
