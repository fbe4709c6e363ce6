"""The training loop: AdamW, warm-up + decay schedules, gradient accumulation and clipping, bf16
autocast, periodic evaluation, atomic checkpoints and bit-exact resume.

Reading order: :func:`train` builds a :class:`Trainer`; :meth:`Trainer.run` calls, per optimizer step,
:meth:`~Trainer.train_step` (forward/backward of every micro-batch, gradient reduction and clipping,
optimizer and scheduler step), then :meth:`~Trainer.log_step`, :meth:`~Trainer.evaluate` and
:meth:`~Trainer.save` when they are due, and :meth:`~Trainer.finish` at the end.

What is trained is an objective (:mod:`mhmoe.train.objectives`, chosen by ``data.task``): it prepares the data,
draws each micro-batch, runs the model's training forward and evaluates; the loop is the same for the
causal LM and the masked multi-modal encoder.

Exact resume on CPU: the batch of (step, micro-step) is a pure function of the seed
(:class:`mhmoe.data.BatchSampler`); the optimizer, scheduler and RNG states are checkpointed; so a
run stopped at step k and resumed produces the same losses, bit for bit, as an uninterrupted run.
Parallelism comes from outside through a :class:`~mhmoe.train.parallelism.SingleProcess`-like object.

Signals: in a single process, Ctrl-C (SIGINT) and SIGTERM are recorded, not raised
(:class:`mhmoe.runtime.signals.StopRequests`); the loop acts on them at the next step boundary, so the
checkpoint it saves there holds exactly the state of its step number, then raises
:class:`~mhmoe.runtime.signals.Interrupted` (exit status 130 / 143 in the CLI). A second signal aborts at
once, without saving. Under torchrun a signal raises where it lands and nothing is saved (a sharded
checkpoint needs every rank). The run directory is locked for the whole run (:mod:`mhmoe.train.lock`).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mhmoe.checkpoint.format import list_checkpoints, remove_stale_temporaries
from mhmoe.checkpoint.layout import CONFIG_FILE, EVAL_FILE, RESULTS_FILE
from mhmoe.config.flops import model_flops_per_token
from mhmoe.config.run import RunConfig
from mhmoe.errors import ConfigError, TrainingStopped
from mhmoe.model import build_model
from mhmoe.model.recompute import set_activation_checkpointing
from mhmoe.moe.layers import RoutingStats
from mhmoe.runtime.device import autocast_ctx, resolve_device
from mhmoe.runtime.files import atomic_write
from mhmoe.runtime.signals import Interrupted, StopRequests, signal_name
from mhmoe.train.lock import RunDirLock
from mhmoe.train.loss_scale import LossScale
from mhmoe.train.metrics import MetricsWriter, routing_summary, sum_routing
from mhmoe.train.objectives import Objective, build_objective
from mhmoe.train.optim import build_optimizer, continue_schedule, lr_lambda, weight_decay_at
from mhmoe.train.parallelism import SingleProcess
from mhmoe.train.plots import update_run_plot
from mhmoe.train.progress import StepBar, eval_progress, format_eval, run_header
from mhmoe.train.resume import LAUNCH_FIELDS
from mhmoe.train.run_dir import check_run_paths
from mhmoe.train.start import start_point


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    eval: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens_per_s: float = 0.0
    params: int = 0
    flops_per_token: float = 0.0
    nan_skips: int = 0
    wall_s: float = 0.0
    rank: int = 0  # torchrun rank (only rank 0 writes metrics and results.json)


@dataclass
class Progress:
    """Counters that survive a resume (checkpointed in the trainer state)."""

    step: int = 0
    nan_total: int = 0
    tokens_seen: int = 0
    train_s: float = 0.0
    scale_skips: int = 0  # float16: steps skipped for a gradient overflow at the loss scale (mhmoe.train.loss_scale)


@dataclass
class StepResult:
    """What one optimizer step produced, as device tensors (read at logging time): losses are means
    over its micro-batches; ``finite`` False = the step was skipped."""

    step: int
    finite: Tensor
    loss_finite: Tensor
    lm_loss: Tensor
    aux_loss: Tensor
    grad_norm: Tensor
    lr: float
    routing: list[RoutingStats] = field(default_factory=list)


#: float16 gradient overflows in a row that stop a run: the loss scale has halved this many times (2**16 -> 2**-34)
MAX_SCALE_SKIPS = 50


def train(run: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          stop_after: int | None = None, parallelism: SingleProcess | None = None,
          launch_fields: tuple[str, ...] = LAUNCH_FIELDS, branch_from: str | Path | None = None) -> TrainResult:
    """Train ``run`` into ``run_dir``; ``resume`` continues from its newest valid checkpoint (the run's
    own config, except ``launch_fields`` of ``train`` and :data:`LAUNCH_DATA_FIELDS`, taken from ``run``).
    ``branch_from`` (a checkpoint directory of another run): continue that run from that checkpoint, as a resume
    would, into the new or empty ``run_dir`` (its config.yaml is written, the branch point saved first).

    ``stop_after`` ends the loop after that optimizer step (saving a checkpoint), as an interruption
    would -- used to test exact resume. ``parallelism``: how the run is spread over processes (default:
    one process on ``train.device``); torchrun launches go through :func:`mhmoe.parallel.train_parallel`.
    ``run_dir`` is locked for the whole call (rank 0 holds the lock under torchrun); a second training
    into it raises ConfigError. A Ctrl-C / SIGTERM raises :class:`~mhmoe.runtime.signals.Interrupted`
    after saving a checkpoint at the step boundary (single process).
    """
    if parallelism is None:
        check_single_process(run)
        parallelism = SingleProcess(resolve_device(run.train.device))
    run_dir = Path(run_dir)
    if resume and not run_dir.is_dir():
        raise ConfigError("--out", str(run_dir), "an existing run directory with --resume (it does not exist; "
                                                 "drop --resume to start a new run)")
    with RunDirLock(run_dir, enabled=parallelism.is_rank0):
        return Trainer(run, run_dir, resume, progress, stop_after, parallelism, launch_fields, branch_from).run()


def check_single_process(run: RunConfig) -> None:
    """A run without a parallel launcher: refuse settings that need several processes."""
    world = os.environ.get("WORLD_SIZE", "1")
    if world not in ("", "1"):
        raise ConfigError("WORLD_SIZE", world, "1 for mhmoe.train.train (torchrun runs use mhmoe.parallel)")
    if run.train.parallel in ("ddp", "fsdp"):
        raise ConfigError("train.parallel", run.train.parallel, "auto | none without torchrun")
    if run.train.ep > 1:
        raise ConfigError("train.ep", run.train.ep, "1 without torchrun (expert parallelism needs several processes)")


def compiled(module: torch.nn.Module, enabled: bool, cuda_graphs: bool, device: torch.device):
    """The model as the training step calls it: as is, ``torch.compile``d, or compiled with CUDA-graph capture
    (mode "reduce-overhead": the forward and backward replay as graphs; CUDA only)."""
    if not enabled:
        return module
    if cuda_graphs and device.type != "cuda":
        raise ConfigError("train.cuda_graphs", True, f"false on {device.type} (CUDA graphs need a CUDA device)")
    return torch.compile(module, mode="reduce-overhead" if cuda_graphs else None)


def _owned(stats: list[RoutingStats]) -> list[RoutingStats]:
    """Copies of a forward's routing statistics: outputs of a CUDA-graph replay are overwritten by the next one."""
    return [RoutingStats(s.counts.clone(), s.tokens.clone(), s.dropped.clone(), {k: v.clone() for k, v in
                                                                                  s.losses.items()}) for s in stats]


class Trainer:
    """One training run. Built by :func:`train`; every method is one named piece of the loop."""

    def __init__(self, run: RunConfig, run_dir: Path, resume: bool, progress: bool, stop_after: int | None,
                 parallelism: SingleProcess, launch_fields: tuple[str, ...] = LAUNCH_FIELDS,
                 branch_from: str | Path | None = None) -> None:
        self.run_dir, self.parallelism, self.stop_after, self.branch = run_dir, parallelism, stop_after, branch_from
        par = parallelism
        if par.is_rank0:
            check_run_paths(run_dir)  # a FIFO, a device, a file for checkpoints/: one line now, not at the first save
            remove_stale_temporaries(run_dir)  # left by a killed run (the lock says none is writing now)
        begin = start_point(run_dir, run, resume, branch_from, parallelism, launch_fields)
        # from_config_file: a resume without checkpoint that starts the run's own config.yaml
        self.ckpt, self.run_config, self.from_config_file = begin.ckpt, begin.run, begin.from_config_file
        self.train_config = self.run_config.train
        if self.train_config.threads:
            torch.set_num_threads(self.train_config.threads)
        torch.manual_seed(self.train_config.seed)
        self.objective = self._prepare_objective(progress)
        self._write_config()
        resumed = self.ckpt is not None and self.ckpt.model is not None
        self.model = self.ckpt.model if resumed else build_model(self.run_config.model)
        set_activation_checkpointing(self.model, self.train_config.activation_checkpointing)
        self.module = par.parallelize(self.model)
        self.optimizer = build_optimizer(self.model, self.train_config, fused=par.fused_optimizer)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(self.train_config))
        self.loss_scale = LossScale(par.device, enabled=self.train_config.dtype == "float16")
        self.state = self._restore()
        self.start = self.state.step
        self.forward = compiled(self.module, self.train_config.compile, self.train_config.cuda_graphs,
                                self.parallelism.device)
        self.metrics = MetricsWriter(run_dir, self.start if self.ckpt else None) if par.is_rank0 else None
        self.result = TrainResult(run_dir, self.start, params=par.num_params(self.model), rank=par.rank)
        self.progress = progress and par.is_rank0
        self._print_header()
        self.bar = StepBar(self.train_config.max_steps, self.start, self.train_config.tokens_per_step * par.world_size,
                           par.device, self.progress, desc=self.run_config.name)
        self.nan_run = self.scale_run = 0  # non-finite losses / float16 overflows in a row
        self.nan_at_start = self.state.nan_total
        # the step of the newest checkpoint on disk (a branch's run directory has none until run() saves one)
        self.saved_step = self.start if self.ckpt and self.branch is None else None
        self.stop = StopRequests(enabled=False)  # replaced by run(): signals deferred to step boundaries
        self.pending: list[StepResult] = []  # steps whose finiteness the host has not read yet
        self.window = (time.perf_counter(), self.state.tokens_seen)  # (time, tokens) at the last log

    # ---- setup --------------------------------------------------------------------------------
    def _prepare_objective(self, progress: bool) -> Objective:
        """The run's training objective (``data.task``) with its data tokenized and cached (rank 0 first, so the others
        read its cache); the model's vocabulary is sized from it."""
        if not self.parallelism.is_rank0:
            self.parallelism.barrier()
        tokenizer = self.ckpt.tokenizer if self.ckpt else None
        par = self.parallelism
        objective = build_objective(self.run_config, tokenizer=tokenizer, rank=par.rank, world_size=par.world_size,
                          progress=progress and par.is_rank0)
        if self.parallelism.is_rank0:
            self.parallelism.barrier()
        if self.run_config.model.vocab_size != objective.vocab_size:
            model = {**self.run_config.model.to_dict(), "vocab_size": objective.vocab_size}
            self.run_config = RunConfig.from_dict({**self.run_config.to_dict(), "model": model})
        return objective

    def _print_header(self) -> None:
        """The resolved run, before the first step (rank 0, stderr; :func:`mhmoe.train.progress.run_header`)."""
        par = self.parallelism
        if not par.is_rank0:
            return
        flops = model_flops_per_token(self.run_config.model, self.train_config.seq_len).total
        lines = run_header(self.run_config, self.run_dir, self.result.params, flops, self.objective.summary(),
                           par.device, par.world_size, self.start, branched=self.branch is not None)
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _write_config(self) -> None:
        """``RUN/config.yaml``, written when a run starts or branches (never by a resume: what a run is never
        changes)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        new_run = self.ckpt is None or self.branch is not None
        if self.parallelism.is_rank0 and new_run and not self.from_config_file:
            atomic_write(self.run_dir / CONFIG_FILE, self.run_config.to_yaml(), root=self.run_dir)

    def _restore(self) -> Progress:
        """Optimizer, scheduler, RNG and counters from the resume checkpoint (fresh counters without one)."""
        if not self.ckpt:
            return Progress()
        st = self.parallelism.restore(self.ckpt, self.model, self.optimizer)
        self.scheduler.load_state_dict(st["scheduler"])
        continue_schedule(self.optimizer, self.scheduler, self.train_config)  # this run's schedule from here on
        torch.set_rng_state(st["rng_cpu"])
        if self.parallelism.device.type == "cuda" and "rng_cuda" in st:
            torch.cuda.set_rng_state(st["rng_cuda"])
        if self.loss_scale.enabled and "loss_scale" in st:
            self.loss_scale.load_state_dict(st["loss_scale"])
        return Progress(st["step"], st["nan_total"], st["tokens_seen"], st["train_s"], st.get("scale_skips", 0))

    # ---- one optimizer step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """Forward/backward of every micro-batch of ``step``, gradient reduction and clipping, then the
        optimizer and scheduler step. A non-finite loss or gradient skips the optimizer update on the
        device; nothing here waits for the device (losses and statistics stay tensors)."""
        self.model.train()
        n = self.train_config.grad_accum
        lm = torch.zeros((), device=self.parallelism.device)
        aux, routing = torch.zeros_like(lm), None
        graphs = self.train_config.compile and self.train_config.cuda_graphs
        for micro in range(n):
            batch = self.objective.micro_batch(step, micro, self.parallelism.device)  # page-locked on CUDA: no wait
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()  # one forward + backward per replay
            with self.parallelism.micro_step(last=micro == n - 1):
                with autocast_ctx(self.parallelism.device, self.train_config.dtype):
                    out = self.objective.forward(self.forward, batch)
                self.loss_scale.scaled((out.loss + out.aux_loss) / n).backward()
            lm, aux = lm + out.loss.detach().float(), aux + out.aux_loss.detach().float()
            routing = sum_routing(routing, _owned(out.routing) if graphs else out.routing)
        max_norm = self.train_config.grad_clip or math.inf
        self.loss_scale.unscale_(self.model.parameters())
        loss_finite = torch.isfinite(lm + aux)
        gnorm = self.parallelism.finish_grads(self.model, max_norm, loss_finite)
        finite = torch.isfinite(gnorm)
        self.loss_scale.update(finite)
        self.optimizer.param_groups[0]["weight_decay"] = weight_decay_at(self.train_config, step)
        self.parallelism.optimizer_step(self.optimizer, finite)
        if routing:
            self.model.balance_step(routing, finite)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return StepResult(step, finite, loss_finite, lm / n, aux / n, gnorm, lr, routing or [])

    def count_skipped_steps(self) -> None:
        """Read the finiteness of the steps run since the last call (one host sync): count skipped steps
        and their tokens, warn, and stop the run after ``train.max_nan_skips`` skipped steps in a row. A float16
        step skipped for a gradient overflow at a finite loss is the loss scale's business
        (:mod:`mhmoe.train.loss_scale`): counted apart, no warning, unless they never end (:data:`MAX_SCALE_SKIPS`)."""
        if not self.pending:
            return
        flags = torch.stack([torch.stack([r.finite, r.loss_finite]) for r in self.pending]).tolist()
        steps, self.pending = [r.step for r in self.pending], []
        for step, (ok, loss_ok) in zip(steps, flags, strict=True):
            if ok:
                self.nan_run = self.scale_run = 0
                self.state.tokens_seen += self.train_config.tokens_per_step * self.parallelism.world_size
            elif loss_ok and self.loss_scale.enabled:
                self.state.scale_skips, self.scale_run = self.state.scale_skips + 1, self.scale_run + 1
                if self.scale_run > MAX_SCALE_SKIPS:
                    raise TrainingStopped(f"stopping: {self.scale_run} float16 gradient overflows in a row at step "
                                          f"{step} (the loss scale halved each time); use bfloat16 or float32")
            else:
                self._count_non_finite(step)

    def _count_non_finite(self, step: int) -> None:
        self.state.nan_total, self.nan_run = self.state.nan_total + 1, self.nan_run + 1
        if self.parallelism.is_rank0:
            print(f"mhmoe: warning: non-finite loss or gradient at step {step}; step skipped "
                  f"({self.nan_run} in a row, {self.state.nan_total} total)", file=sys.stderr)
        if self.nan_run > self.train_config.max_nan_skips:
            limit = self.train_config.max_nan_skips
            raise TrainingStopped(f"stopping: {self.nan_run} consecutive non-finite losses at step {step} "
                                  f"(train.max_nan_skips={limit}); lower train.lr or use float32")

    # ---- logging, evaluation, checkpoints ----------------------------------------------------
    def log_step(self, res: StepResult) -> None:
        """Append one record to metrics.jsonl (losses averaged over ranks); a skipped (non-finite) step is
        not logged. Due at step 1, every ``log_every`` steps and at the last step."""
        if not bool(res.finite):
            return
        lm, aux = self.parallelism.mean([float(res.lm_loss), float(res.aux_loss)])
        now = time.perf_counter()
        tps = (self.state.tokens_seen - self.window[1]) / max(1e-9, now - self.window[0])
        self.window = (now, self.state.tokens_seen)
        rec = {"step": res.step + 1, "loss": lm, "aux_loss": aux, "lr": res.lr, "grad_norm": float(res.grad_norm),
               "tokens_per_s": tps, "tokens": self.state.tokens_seen, "nan_skips": self.state.nan_total,
               **routing_summary(res.routing, self.train_config.grad_accum), **self._scale_summary()}
        if self.metrics is not None:
            self.metrics.log(rec)

    def evaluate(self, step: int) -> dict[str, dict[str, float]]:
        """Validation perplexity on every set. Every rank evaluates the same windows (EP and FSDP
        forwards are collectives); rank 0 logs to eval.jsonl."""
        cfg = self.train_config
        t0 = time.perf_counter()
        with eval_progress(self.objective.eval_size(cfg.eval_batches), f"eval step {step}", self.progress) as tick:
            res = self.objective.evaluate(self.model, max_batches=cfg.eval_batches, device=self.parallelism.device,
                                          dtype=cfg.dtype, on_batch=tick)
        if self.parallelism.is_rank0:
            self.bar.write(format_eval(step, cfg.max_steps, res, time.perf_counter() - t0))
        if self.metrics is not None:
            self.metrics.log({"step": step, **{f"{k}_ppl": v["ppl"] for k, v in res.items()},
                              **{f"{k}_loss": v["loss"] for k, v in res.items()}}, file=EVAL_FILE)
            update_run_plot(self.run_dir)  # RUN/curves.png
        self.result.eval = res
        return res

    def trainer_state(self) -> dict[str, Any]:
        """Scheduler, RNG and counters (the optimizer is saved by the parallelism's checkpoint writer)."""
        st = {**asdict(self.state), "scheduler": self.scheduler.state_dict(), "rng_cpu": torch.get_rng_state()}
        if self.parallelism.device.type == "cuda":
            st["rng_cuda"] = torch.cuda.get_rng_state()
        if self.loss_scale.enabled:
            st["loss_scale"] = self.loss_scale.state_dict()
        return st

    def _scale_summary(self) -> dict[str, float | int]:
        """float16 runs: the loss scale now and the steps skipped for an overflow (none for other dtypes)."""
        if not self.loss_scale.enabled:
            return {}
        return {"loss_scale": float(self.loss_scale.scale), "scale_skips": self.state.scale_skips}

    def save(self) -> None:
        """Checkpoint the current step (atomic; older checkpoints pruned to ``train.keep_last``)."""
        self.parallelism.save_checkpoint(self.run_dir, self.state.step, self.model, self.optimizer, self.run_config,
                                 self.objective.tokenizer, self.trainer_state(), self.train_config.keep_last)
        self.saved_step = self.state.step

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """The loop, then :meth:`finish`. Ctrl-C / SIGTERM are deferred to step boundaries in a single
        process (:meth:`stop_if_requested`)."""
        with StopRequests(enabled=self.parallelism.saves_alone) as self.stop:
            try:
                if self.branch is not None:  # the branch point first: the new run resumes on its own from here on
                    self.save()
                self._loop()
                res = self.finish()
            finally:
                self.bar.close()
                if self.metrics is not None:
                    self.metrics.close()
        return res

    def _loop(self) -> None:
        cfg, st = self.train_config, self.state
        self.bar.start()
        while st.step < cfg.max_steps:
            t0 = time.perf_counter()
            res = self.train_step(st.step)
            self.pending.append(res)
            st.step += 1
            st.train_s += time.perf_counter() - t0
            self.bar.step(res.lm_loss)
            due = {"log": st.step % cfg.log_every == 0 or st.step in (1, cfg.max_steps),  # step 1: a curve's start
                   "eval": bool(cfg.eval_every) and st.step % cfg.eval_every == 0 and st.step < cfg.max_steps,
                   "ckpt": bool(cfg.ckpt_every) and st.step % cfg.ckpt_every == 0 and st.step < cfg.max_steps,
                   "stop": self.stop_after is not None and st.step >= self.stop_after}
            if any(due.values()):
                self.count_skipped_steps()
            if due["log"]:
                self.log_step(res)
            if due["eval"]:
                self.evaluate(st.step)
            if due["ckpt"]:
                self.save()
            self.stop_if_requested()  # the step boundary: weights, optimizer, scheduler and counters agree
            if due["stop"]:
                break
        self.count_skipped_steps()

    def stop_if_requested(self) -> None:
        """At a step boundary, after a Ctrl-C / SIGTERM: checkpoint the current step (unless it is saved
        already or no step ran) and raise :class:`~mhmoe.runtime.signals.Interrupted` saying so."""
        signum = self.stop.signum
        if signum is None:
            return
        self.count_skipped_steps()
        st, name = self.state, signal_name(signum)
        if st.step > self.start and self.saved_step != st.step:
            self.save()
        if self.saved_step == st.step and st.step > self.start:
            raise Interrupted(signum, f"interrupted ({name}) at step {st.step}: checkpoint saved "
                                      f"(continue with --resume)")
        raise Interrupted(signum, f"interrupted ({name}) at step {st.step}: nothing new to save")

    def finish(self) -> TrainResult:
        """Final checkpoint and evaluation; results.json (rank 0). A run whose every step was skipped as
        non-finite saves nothing and raises RuntimeError."""
        st, res = self.state, self.result
        ran = st.step - self.start
        if ran and st.nan_total - self.nan_at_start >= ran:
            raise TrainingStopped(f"stopping: all {ran} steps were skipped as non-finite (last step {st.step}); "
                                  "nothing saved: lower train.lr, check the config (e.g. model.norm_eps) or use "
                                  "float32")
        if st.step > self.start or not list_checkpoints(self.run_dir):
            self.save()
        self.stop_if_requested()  # before the final evaluation (the checkpoint is on disk)
        if st.step >= self.train_config.max_steps:
            self.evaluate(st.step)
        res.step, res.nan_skips, res.wall_s = st.step, st.nan_total, st.train_s
        res.tokens_per_s = st.tokens_seen / max(1e-9, st.train_s)
        if self.metrics is None:
            return res
        self.metrics.close()
        res.flops_per_token = model_flops_per_token(self.run_config.model, self.train_config.seq_len).total  # analytic
        summary = {"preset": self.run_config.name, "step": st.step, "params": res.params,
                   "fwd_flops_per_token": res.flops_per_token, "tokens_per_s": res.tokens_per_s,
                   "train_s": st.train_s, "nan_skips": st.nan_total, **self._scale_summary(), "eval": res.eval,
                   **self.parallelism.summary()}
        atomic_write(self.run_dir / RESULTS_FILE, json.dumps(summary, indent=2), root=self.run_dir)
        return res
