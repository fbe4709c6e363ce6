"""EleutherAI LM Evaluation Harness backend ``mhmoe`` (optional extra: ``pip install 'mhmoe[lmeval]'``).

:class:`MHMoEHarnessLM` scores requests with our own :class:`~mhmoe.model.LM` and tokenizer -- no
transformers hub machinery, so the harness runs fully offline::

    mhmoe eval --checkpoint runs/x --tasks mhmoe_kjv_cloze,mhmoe_kjv_ppl

    import lm_eval, mhmoe.integrations.lmeval      # the import registers the backend
    lm_eval.simple_evaluate(model="mhmoe", model_args={"checkpoint": "runs/x"}, tasks=[...])

(the ``lm_eval`` command line cannot import third-party backends; use the Python API or ``mhmoe eval``).

Scoring (shapes: B batch, T <= max_seq_len, V vocabulary):

- ``loglikelihood``: (context, continuation) pairs are encoded by the harness' ``TemplateLM`` rules
  (the whole string, split at the context's token count); ``context + continuation`` is
  left-truncated to ``max_seq_len + 1`` tokens; requests are sorted by length, right-padded into
  batches of ``batch_size`` rows and run as one forward each (pad tokens are masked out of routing);
  log-softmax logits [B, T, V] are gathered at the continuation positions.
- ``loglikelihood_rolling``: every token of the text is predicted once, in disjoint rolling windows
  of ``max_seq_len`` tokens (the first window conditions on EOS), scored like ``loglikelihood``.
- ``generate_until``: :func:`mhmoe.model.generate.generate` (KV cache) one request at a time, context
  left-truncated to leave room for ``max_gen_toks``; greedy unless ``do_sample``/``temperature`` ask
  otherwise; the text is cut at the first stop string.

Progress: the harness' own "Tokenizing inputs" bars are off; ``progress=True`` shows one bar over the
scored rows instead.

Importing this module registers the backend name ``mhmoe`` with the harness (its global registry).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mhmoe.data import Tokenizer
from mhmoe.model.generate import generate
from mhmoe.model.lm import LM

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


@register_model("mhmoe")
class MHMoEHarnessLM(TemplateLM):
    """lm-eval backend over our model: ``MHMoEHarnessLM(checkpoint=DIR)`` or ``(model=LM, tokenizer=Tokenizer)``."""

    def __init__(self, checkpoint: str | None = None, model: LM | None = None, tokenizer: Tokenizer | None = None,
                 batch_size: int | str | None = 8, device: str | None = "cpu", max_length: int | str | None = None,
                 progress: bool = False, **kwargs: Any) -> None:
        super().__init__()
        device = device or "cpu"
        if (checkpoint is None) == (model is None):
            raise ValueError("mhmoe harness backend: give either checkpoint=DIR or model= and tokenizer=")
        if checkpoint is not None:
            from mhmoe.loading.checkpoint import load_latest

            ck = load_latest(checkpoint, device)
            model, tokenizer = ck.model, ck.tokenizer
        if tokenizer is None:
            raise ValueError("mhmoe harness backend: model= needs tokenizer=")
        if getattr(model, "cfg", None) is not None and model.cfg.arch != "decoder":
            raise ValueError(f"mhmoe harness backend: model.arch={model.cfg.arch}; the harness scores causal LMs")
        assert model is not None
        self.model: LM = model.eval()
        self.tok = tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = min(int(max_length), model.cfg.max_seq_len) if max_length else model.cfg.max_seq_len
        self._device = next(model.parameters()).device
        self.progress = progress

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MHMoEHarnessLM:
        """``lm_eval --model mhmoe --model_args checkpoint=DIR,batch_size=16``."""
        args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k in ("batch_size", "device")}
        return cls(**{**args, **extra})

    # ---- TemplateLM hooks -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.tok.decode(tokens)

    @property
    def tokenizer_name(self) -> str:
        return self.tok.name

    # ---- scoring ----------------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # our bar is over the scoring (_score)

    @torch.no_grad()
    def _score(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether greedy decoding reproduces it) per pair."""
        from tqdm.auto import tqdm

        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        with tqdm(total=len(order), desc="lm-eval: scoring", unit="row", leave=False, disable=not self.progress,
                  file=sys.stderr, dynamic_ncols=True) as bar:
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                self._score_rows(pairs, rows, out)
                bar.update(len(rows))
        return [o if o is not None else (0.0, True) for o in out]

    def _score_rows(self, pairs: list[Pair], rows: list[int], out: list[tuple[float, bool] | None]) -> None:
        """Score ``pairs[i]`` for ``i`` in ``rows`` as one right-padded batch [B, T] into ``out[i]``."""
        seqs, conts = [], []
        for i in rows:
            ctx, cont = pairs[i]
            if not cont:
                out[i] = (0.0, True)
                continue
            whole = (ctx + cont)[-(self.max_length + 1):]
            seqs.append((i, whole[:-1]))
            conts.append(cont[-len(whole) + 1:] if len(cont) >= len(whole) else cont)
        if not seqs:
            return
        T = max(len(s) for _, s in seqs)
        idx = torch.full((len(seqs), T), self.tok.eos_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.bool)
        for r, (_, s) in enumerate(seqs):
            idx[r, :len(s)] = torch.tensor(s)
            mask[r, :len(s)] = True
        idx, mask = idx.to(self._device), mask.to(self._device)
        logp = F.log_softmax(self.model(idx, mask=None if bool(mask.all()) else mask).logits.float(), -1)
        for r, ((i, s), cont) in enumerate(zip(seqs, conts, strict=True)):
            n = len(cont)
            lp = logp[r, len(s) - n:len(s)]  # [n, V]: predictions of the continuation tokens
            target = torch.tensor(cont, device=lp.device)
            out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              **kwargs: Any) -> list[tuple[float, bool]]:
        return self._score([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        pairs, owner = [], []
        for n, req in enumerate(requests):
            (text,) = req.args
            windows = get_rolling_token_windows(self.tok_encode(text), self.eot_token_id, self.max_length, 1)
            for w in windows:
                pairs.append(make_disjoint_window(w))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, self._score(pairs), strict=True):
            totals[n] += lp
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        results = []
        for req in requests:
            context, gen_kwargs = req.args
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or [self.tok.decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = max(1, min(int(kw.pop("max_gen_toks", 256)), self.max_length - 1))
            temperature = float(kw.pop("temperature", 0.0)) if kw.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            prompt = torch.tensor([ids], device=self._device)
            out = generate(self.model, prompt, max_new, temperature=temperature, eos_id=self.eot_token_id)
            text = self.tok.decode(out[0, len(ids):].tolist())
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            results.append(text)
        return results
