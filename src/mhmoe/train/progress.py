"""What a user watching ``mhmoe train`` sees on stderr (rank 0): a header, a step bar, evaluation bars.

- :func:`run_header`: before the first step, a few lines with the resolved run (model, parameters, FLOPs,
  data tokens, schedule, evaluation, device, dtype, threads), so a mistake shows before minutes are spent.
- :class:`StepBar`: the optimizer-step bar (tqdm) with the training loss and tokens/s from step 1. The
  loss is read without waiting for the device: on a CPU a tensor is finished when the call returns, so
  reading it costs nothing; on CUDA it is copied to page-locked memory behind the step
  (``non_blocking``) with an event, and shown once the event has completed (:class:`LossReader`).
  Tokens/s is measured on the host over the last :data:`RATE_WINDOW` steps.
- :func:`eval_progress`: a bar over the evaluation batches of all validation sets, with its ETA; the
  evaluation's result is written as one line above the step bar (:meth:`StepBar.write`).

Bars are tqdm bars on stderr that disappear when done (``leave=False``); header and result lines are
plain lines, printed with or without bars (``--no-progress`` drops only the bars).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from mhmoe.train.optim import decay_start

RATE_WINDOW = 20  # steps over which the bar's tokens/s is measured
PINNED_SLOTS = 8  # CUDA: losses in flight to the host at most (further ones are not shown)


def _tqdm(**kwargs: Any):
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, dynamic_ncols=True, leave=False, **kwargs)


class LossReader:
    """The newest training loss the device has finished computing, read without a host sync."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.value: float | None = None
        self.in_flight: deque[tuple[Tensor, Any]] = deque()
        self.free: list[Tensor] = []
        if self.cuda:
            self.free = [torch.empty((), dtype=torch.float32, pin_memory=True) for _ in range(PINNED_SLOTS)]

    def push(self, loss: Tensor) -> None:
        """Start reading ``loss`` (0-dim tensor of the step just queued)."""
        if not self.cuda:
            self.value = float(loss)  # a CPU tensor is computed by the time the op returns: no wait
            return
        self.poll()
        if not self.free:  # the device is more than PINNED_SLOTS steps behind: skip this one
            return
        buf = self.free.pop()
        buf.copy_(loss.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.in_flight.append((buf, event))

    def poll(self) -> float | None:
        """The newest finished loss (None before the first one)."""
        while self.in_flight and self.in_flight[0][1].query():
            buf, _ = self.in_flight.popleft()
            self.value = float(buf)  # finished: a host read, no wait
            self.free.append(buf)
        return self.value


class StepBar:
    """The optimizer-step bar: ``step()`` after each step; loss and tokens/s in its postfix from step 1."""

    def __init__(self, total: int, initial: int, tokens_per_step: int, device: torch.device, enabled: bool,
                 desc: str = "") -> None:
        self.enabled, self.tokens_per_step = enabled, tokens_per_step
        self.bar = _tqdm(total=total, initial=initial, unit="step", desc=desc or None, disable=not enabled)
        self.loss = LossReader(device) if enabled else None
        self.times: deque[float] = deque([time.perf_counter()], maxlen=RATE_WINDOW + 1)

    def start(self) -> None:
        """The clock of the first step starts now (after set-up)."""
        self.times.clear()
        self.times.append(time.perf_counter())

    def tokens_per_s(self) -> float:
        """Tokens per second over the last :data:`RATE_WINDOW` steps (host clock)."""
        steps = len(self.times) - 1
        span = self.times[-1] - self.times[0]
        return steps * self.tokens_per_step / span if steps and span > 0 else 0.0

    def step(self, loss: Tensor) -> None:
        """One optimizer step was queued; ``loss`` is its training loss (device tensor)."""
        if not self.enabled or self.loss is None:
            return
        self.times.append(time.perf_counter())
        self.loss.push(loss)
        value = self.loss.poll()
        post = {"loss": f"{value:.3f}"} if value is not None else {}
        post["tok/s"] = f"{self.tokens_per_s():,.0f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def write(self, line: str) -> None:
        """A line above the bar (a plain stderr line when the bar is off)."""
        if self.enabled:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def eval_progress(total: int, desc: str, enabled: bool) -> Iterator[Callable[[], None]]:
    """A bar over ``total`` evaluation batches (with ETA); yields the callback to call after each batch."""
    bar = _tqdm(total=total, desc=desc, unit="batch", disable=not enabled or total <= 0)
    try:
        yield lambda: bar.update(1)
    finally:
        bar.close()


def format_eval(step: int, max_steps: int, res: dict[str, dict[str, float]], seconds: float) -> str:
    """``step 200/2000  val ppl kjv 123.4  pydocs 2,345.6  (eval 12 s)``."""
    cells = "  ".join(f"{k} {v['ppl']:,.1f}" for k, v in res.items())
    return f"step {step}/{max_steps}  val ppl {cells}  (eval {seconds:.0f} s)"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,.0f}"


def _ffn(run: Any) -> str:
    moe, m = run.model.moe, run.model
    if moe.kind == "dense":
        return f"dense {m.d_ff}"
    text = f"{moe.n_experts}x{moe.d_expert} top-{moe.top_k} {moe.router}/{moe.ffn}"
    text = (f"MH-MoE h={moe.heads} " if moe.heads > 1 else "MoE ") + text
    text += f" +{moe.n_shared} shared" if moe.n_shared else ""
    return text + (f", every {m.moe_every} layers" if m.moe_every > 1 else "")


def device_text(device: torch.device, dtype: str) -> str:
    """``cpu (AMD EPYC 7B13, 2 threads), float32`` / ``cuda:0 (NVIDIA H100), bfloat16``."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return f"{device} ({name}), {dtype}"
    from mhmoe.runtime.cpu import cpu_info

    threads = torch.get_num_threads()
    return f"{device.type} ({cpu_info()[0]}, {threads} thread{'s' if threads != 1 else ''}), {dtype}"


def run_header(run: Any, run_dir: Any, params: int, flops_per_token: float, data: str, device: torch.device,
               world_size: int = 1, start_step: int = 0, branched: bool = False) -> list[str]:
    """The lines printed before the first step (see the module docstring); ``branched``: the run continues another
    run's checkpoint of ``start_step`` (``--branch-from``) rather than its own."""
    m, t = run.model, run.train
    tokens = t.tokens_per_step * world_size
    todo = max(0, t.max_steps - start_step)
    sets = "at the end" if not t.eval_every else f"every {t.eval_every} steps and at the end"
    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    lines = [
        f"mhmoe train: {run.name} -> {run_dir}"
        + (f" ({'branched' if branched else 'resumed'} at step {start_step})" if start_step else ""),
        f"  model   {m.arch}, d={m.d_model} L={m.n_layers} heads={m.n_heads}"
        + (f" (kv {m.kv_heads})" if m.kv_heads != m.n_heads else "") + f"; FFN {_ffn(run)}",
        f"          {params:,} parameters, {_count(flops_per_token)} forward FLOPs/token",
        f"  data    {data}",
        f"  train   {t.max_steps:,} steps x {tokens:,} tokens (batch {t.batch_size} x seq {t.seq_len}"
        f"{f' x accum {t.grad_accum}' if t.grad_accum > 1 else ''}{ranks}) = {_count(t.max_steps * tokens)} tokens"
        + (f", {todo:,} to go" if start_step else "")
        + f"; lr {t.lr:g} {t.schedule}, warm-up {t.warmup_steps}"
        + (f", {t.cooldown_shape} cooldown from step {decay_start(t) + 1:,}" if t.schedule == "wsd" else ""),
        f"  eval    {sets}, <= {t.eval_batches} batches per validation set; checkpoints every "
        f"{t.ckpt_every or t.max_steps} steps (keep {t.keep_last})",
        f"  device  {device_text(device, t.dtype)}"
        + (f"; activation checkpointing: {t.activation_checkpointing}" if t.activation_checkpointing != "none"
           else ""),
    ]
    return lines
