"""Sampling with a KV cache: temperature, top-k and nucleus (top-p) filtering."""

from __future__ import annotations

import torch
from torch import Tensor

from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM, KVCache


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask logits [B, V] outside the top-k and outside the smallest set with probability >= top_p."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the first token always
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def new_tokens(max_seq_len: int, prompt_len: int, max_new_tokens: int, clamp: bool = False) -> int:
    """How many tokens to generate after a prompt of ``prompt_len`` tokens within the model's context
    (``max_seq_len``): ``max_new_tokens``, or with ``clamp`` as many of them as fit. ConfigError when the
    prompt alone fills the context, or (without ``clamp``) the new tokens do not fit after it."""
    room = max_seq_len - prompt_len
    if room < 0 or (room == 0 and max_new_tokens > 0):
        raise ConfigError("prompt", f"{prompt_len} tokens", f"fewer than max_seq_len={max_seq_len}")
    if max_new_tokens > room and not clamp:
        raise ConfigError("max_new_tokens", max_new_tokens, f"<= {room}: the prompt ({prompt_len} tokens) + the new "
                          f"tokens must fit model.max_seq_len={max_seq_len}")
    return min(max_new_tokens, room)


def scaled_logits(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` [B, V] for sampling, safe for any temperature > 0: computed as
    ``(logits - max) / temperature``, so the largest is 0 and the others are <= 0 (never ``inf - inf``):
    a tiny temperature (1e-300) gives -inf to every logit below the maximum, i.e. greedy decoding with
    ties shared; an infinite one gives 0 to every finite logit (uniform)."""
    shifted = (logits - logits.amax(-1, keepdim=True)).double()  # float32(1e-300) would be 0: 0 / 0
    out = (shifted / temperature).to(logits.dtype)
    return torch.where(out.isnan(), float("-inf"), out)  # -inf / inf


@torch.no_grad()
def generate(model: LM, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """Continue ``prompt`` [B, T0] by up to ``max_new_tokens`` tokens; temperature 0 = greedy.

    The prompt is run once (prefill) and every new token reuses the cached keys/values.
    Returns [B, T0 + n] token ids (stops early when every row produced ``eos_id``).
    """
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"invalid prompt shape {tuple(prompt.shape)}: allowed [B, T] with T >= 1")
    new_tokens(model.cfg.max_seq_len, prompt.shape[1], max_new_tokens)
    model.eval()
    cache = KVCache(model.cfg.n_layers, capacity=prompt.shape[1] + max_new_tokens)
    logits = model(prompt, cache=cache).logits[:, -1].float()
    out, done = [prompt], torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        if temperature <= 0:
            nxt = logits.argmax(-1)
        else:
            probs = filter_logits(scaled_logits(logits, temperature), top_k, top_p).softmax(-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        out.append(nxt[:, None])
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):
                break
        logits = model(nxt[:, None], cache=cache).logits[:, -1].float()
    return torch.cat(out, 1)
