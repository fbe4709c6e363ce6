"""Training loop: AdamW, warm-up + linear/cosine decay, gradient accumulation and clipping, bf16
autocast, periodic evaluation, atomic checkpoints and bit-exact resume.

Exact resume on CPU: the batch of (step, micro-step) is a pure function of the seed
(:class:`mhmoe.data.BatchSampler`); the optimizer, scheduler and RNG states are checkpointed; so a
run stopped at step k and resumed produces the same losses, bit for bit, as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mhmoe.checkpoint import list_checkpoints, load_latest, save_checkpoint
from mhmoe.data import BatchSampler, prepare_data
from mhmoe.errors import ConfigError
from mhmoe.evaluate import evaluate, forward_flops_per_token
from mhmoe.model import LM
from mhmoe.moe import RoutingStats
from mhmoe.runconfig import RunConfig, TrainConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", name, "cpu (no CUDA device is available) | auto")
    return torch.device(name)


def autocast_ctx(device: torch.device, dtype: str):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


def in_stage2(cfg: TrainConfig, step: int) -> bool:
    """Two-stage schedule: optimizer step ``step`` (0-based) is in the second half of the run."""
    return step >= cfg.max_steps // 2


def lr_lambda(cfg: TrainConfig):
    """Multiplier of the peak lr at optimizer step s: linear warm-up, then linear/cosine decay;
    times ``lr_stage2_ratio`` from the halfway point (two-stage schedule, 1.0 = off)."""
    def base(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        decay = 1 - t if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * t))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    def f(step: int) -> float:
        return base(step) * (cfg.lr_stage2_ratio if in_stage2(cfg, step) else 1.0)
    return f


def weight_decay_at(cfg: TrainConfig, step: int) -> float:
    """Weight decay of the matrices at optimizer step ``step``: ``wd_stage2`` from the halfway point
    when set (BitNet: 0.1 -> 0), else ``weight_decay``. A pure function of the step, so a resumed
    run applies the same decay as an uninterrupted one."""
    if cfg.wd_stage2 is not None and in_stage2(cfg, step):
        return cfg.wd_stage2
    return cfg.weight_decay


def build_optimizer(model: nn.Module, cfg: TrainConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2), none on norms (including the [E, F] per-expert
    sub-norms of quantized experts), biases and router temperatures. Group 0 is the decayed one."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and not name.endswith("sub_norm") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


def _sum_routing(acc: list[RoutingStats] | None, new: list[RoutingStats]) -> list[RoutingStats]:
    if acc is None:
        return [RoutingStats(s.counts.clone(), s.tokens, s.dropped, dict(s.losses)) for s in new]
    for a, s in zip(acc, new, strict=True):
        a.counts += s.counts
        a.tokens += s.tokens
        a.dropped += s.dropped
        for k, v in s.losses.items():
            a.losses[k] = a.losses.get(k, 0.0) + v
    return acc


def routing_summary(stats: list[RoutingStats], n_micro: int) -> dict[str, Any]:
    """Expert-load statistics for metrics.jsonl (averaged over MoE layers)."""
    if not stats:
        return {}
    out: dict[str, Any] = {}
    for k in stats[0].losses:
        out[f"{k}_loss"] = sum(s.losses[k] for s in stats) / (len(stats) * n_micro)
    out["load_imbalance"] = sum(s.load_imbalance for s in stats) / len(stats)
    out["load_imbalance_per_layer"] = [round(s.load_imbalance, 4) for s in stats]
    slots = [max(1, int(s.counts.sum())) for s in stats]
    out["dropped_frac"] = sum(s.dropped for s in stats) / sum(slots)
    out["experts_used_frac"] = sum(float((s.counts > 0).float().mean()) for s in stats) / len(stats)
    return out


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


class _Metrics:
    """metrics.jsonl / eval.jsonl (+ TensorBoard when available) writer; a fresh run empties both
    files, a resumed one drops their lines past the resume step (logged after that checkpoint)."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / "metrics.jsonl"
        for path in (self.path, run_dir / "eval.jsonl"):
            if resume_step is not None and path.exists():
                lines = [(ln, _logged_step(ln)) for ln in path.read_text(encoding="utf-8").splitlines()]
                keep = [ln for ln, s in lines if s is not None and s <= resume_step]
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(ln + "\n" for ln in keep), encoding="utf-8")
                os.replace(tmp, path)
            elif resume_step is None:
                path.write_text("", encoding="utf-8")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        except Exception:  # tensorboard missing: jsonl only
            self.tb = None

    def log(self, record: dict[str, Any], file: str = "metrics.jsonl") -> None:
        with open(self.path.parent / file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            prefix = "eval/" if file != "metrics.jsonl" else "train/"
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(prefix + k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _logged_step(line: str) -> int | None:
    """The step of one metrics/eval line; None for a blank or torn line (a crash mid-write)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return None


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True,
                file=sys.stderr, leave=False)


def train(run: RunConfig, run_dir: str | Path, resume: bool = False, progress: bool = True,
          stop_after: int | None = None) -> TrainResult:
    """Train ``run`` into ``run_dir``; ``resume`` continues from its newest valid checkpoint.

    ``stop_after`` ends the loop after that optimizer step (saving a checkpoint), as an interruption
    would -- used to test exact resume. Under torchrun (``train.parallel`` ddp | fsdp, ``train.ep``)
    every rank calls this; see :mod:`mhmoe.distributed` and docs/DISTRIBUTED.md.
    """
    run_dir = Path(run_dir)
    cfg = run.train
    env = owns_pg = None
    if parallel_mode(cfg) != "none":
        import torch.distributed as dist

        from mhmoe.distributed.env import init_distributed

        owns_pg = not dist.is_initialized()
        env = init_distributed(cfg.device, cfg.ep)
    try:
        return _train(run, run_dir, resume, progress, stop_after, env)
    finally:
        if owns_pg:
            from mhmoe.distributed.env import teardown

            teardown()


def parallel_mode(cfg: TrainConfig) -> str:
    """none | ddp | fsdp: ``train.parallel`` with ``auto`` resolved from the torchrun WORLD_SIZE."""
    from mhmoe.distributed.env import env_world_size

    world = env_world_size()
    mode = cfg.parallel if cfg.parallel != "auto" else ("ddp" if world > 1 else "none")
    if mode == "none" and world > 1:
        raise ConfigError("train.parallel", cfg.parallel, f"ddp | fsdp (launched with WORLD_SIZE={world})")
    if mode == "none" and cfg.ep > 1:
        raise ConfigError("train.ep", cfg.ep, "1 without torchrun (expert parallelism needs several processes)")
    return mode


def _train(run: RunConfig, run_dir: Path, resume: bool, progress: bool, stop_after: int | None,
           env: Any) -> TrainResult:
    cfg = run.train
    rank0 = env is None or env.is_rank0
    ckpt = None
    if resume and list_checkpoints(run_dir):
        if env is None:
            ckpt = load_latest(run_dir)
        else:
            from mhmoe.distributed.checkpoint import open_latest_dcp

            ckpt = open_latest_dcp(run_dir)
        if rank0:
            print(f"mhmoe: resuming {run_dir} from step {ckpt.step} with the run's own config (only "
                  f"train.max_steps={cfg.max_steps}, threads, parallel and ep are taken from this command)",
                  file=sys.stderr)
        launch = {"max_steps": cfg.max_steps, "threads": cfg.threads, "parallel": cfg.parallel, "ep": cfg.ep}
        run = RunConfig.from_dict({**ckpt.run.to_dict(), "train": {**ckpt.run.train.__dict__, **launch}})
        cfg = run.train
    elif list_checkpoints(run_dir):
        raise ConfigError("--out", str(run_dir), "a new directory (it holds checkpoints: pass --resume to continue)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device) if env is None else env.device
    torch.manual_seed(cfg.seed)
    if env is not None and not rank0:
        env.barrier()  # rank 0 tokenizes and fills the cache first
    data = prepare_data(run.data, seq_len=cfg.seq_len, tokenizer=ckpt.tokenizer if ckpt else None,
                        progress=progress and rank0)
    if env is not None and rank0:
        env.barrier()
    if run.model.vocab_size != data.tokenizer.vocab_size:
        run = RunConfig.from_dict({**run.to_dict(), "model": {**run.model.to_dict(),
                                                              "vocab_size": data.tokenizer.vocab_size}})
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank0:
        (run_dir / "config.yaml").write_text(run.to_yaml(), encoding="utf-8")
    model = ckpt.model if ckpt and ckpt.model is not None else LM(run.model)
    model.to(device)
    par = None
    if env is not None:
        from mhmoe.distributed.data_parallel import parallelize

        par = parallelize(model, env, parallel_mode(cfg))
    optimizer = build_optimizer(model, cfg, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    start, nan_total, nan_run, tokens_seen, train_s = 0, 0, 0, 0, 0.0
    if ckpt:
        st = ckpt.trainer_state
        if st is None:  # DCP: loaded straight into the sharded model and optimizer (resharding)
            from mhmoe.distributed.checkpoint import load_dcp_into

            st = load_dcp_into(ckpt.path, model, optimizer, par)
        else:
            optimizer.load_state_dict(st["optimizer"])
        scheduler.load_state_dict(st["scheduler"])
        torch.set_rng_state(st["rng_cpu"])
        if device.type == "cuda" and "rng_cuda" in st:
            torch.cuda.set_rng_state(st["rng_cuda"])
        start, nan_total, tokens_seen, train_s = st["step"], st["nan_total"], st["tokens_seen"], st["train_s"]
    world = 1 if env is None else env.world_size
    sampler = BatchSampler(data.train, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed,
                           rank=0 if env is None else env.rank, world_size=world)
    fwd = model if par is None else par.module
    fwd = torch.compile(fwd) if cfg.compile else fwd
    metrics = _Metrics(run_dir, start if ckpt else None) if rank0 else None
    n_params = model.num_params() + (0 if par is None else (env.ep - 1) * sum(p.numel() for p in par.expert_params))
    result = TrainResult(run_dir, start, params=n_params, rank=0 if env is None else env.rank)

    def trainer_state(step: int) -> dict[str, Any]:
        st = {"step": step, "scheduler": scheduler.state_dict(),
              "rng_cpu": torch.get_rng_state(), "nan_total": nan_total, "tokens_seen": tokens_seen,
              "train_s": train_s}
        if par is None:
            st = {"step": step, "optimizer": optimizer.state_dict(), **st}
        if device.type == "cuda":
            st["rng_cuda"] = torch.cuda.get_rng_state()
        return st

    def checkpoint(step: int) -> None:
        if par is None:
            save_checkpoint(run_dir, step, model, run, data.tokenizer, trainer_state(step), cfg.keep_last)
        else:
            from mhmoe.distributed.checkpoint import save_dcp_checkpoint

            save_dcp_checkpoint(run_dir, step, model, optimizer, run, data.tokenizer, trainer_state(step),
                                cfg.keep_last, par)

    def run_eval(step: int) -> dict[str, dict[str, float]]:
        # every rank evaluates the same windows (EP and FSDP forwards are collectives); rank 0 logs
        res = evaluate(model, data.val, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                       max_batches=cfg.eval_batches, device=device, dtype=cfg.dtype)
        if metrics is not None:
            metrics.log({"step": step, **{f"{k}_ppl": v["ppl"] for k, v in res.items()},
                         **{f"{k}_loss": v["loss"] for k, v in res.items()}}, file="eval.jsonl")
        return res

    bar = _progress(cfg.max_steps, start, progress and rank0)
    step = start
    window_t, window_tok = time.perf_counter(), 0
    try:
        while step < cfg.max_steps:
            t0 = time.perf_counter()
            model.train()
            lm_sum, aux_sum, routing, finite = 0.0, 0.0, None, True
            for micro in range(cfg.grad_accum):
                x, y = sampler.get_batch(step, micro)
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with contextlib.nullcontext() if par is None else par.sync(micro == cfg.grad_accum - 1):
                    with autocast_ctx(device, cfg.dtype):
                        out = fwd(x, y)
                    loss = (out.loss + out.aux_loss) / cfg.grad_accum
                    if not torch.isfinite(loss):
                        finite = False
                        if par is None:  # ranks go on (collectives); the all-reduced norm skips the step
                            break
                    loss.backward()
                lm_sum += float(out.loss.detach())
                aux_sum += float(out.aux_loss.detach())
                routing = _sum_routing(routing, out.routing)
            gnorm = None
            if par is not None:
                par.finish_grads()
                gnorm = par.clip_grad_norm(cfg.grad_clip or math.inf, extra_nonfinite=not finite)
                finite = bool(torch.isfinite(gnorm))
            elif finite:  # a finite loss can still give non-finite gradients: skip those steps too
                gnorm = nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
                finite = bool(torch.isfinite(gnorm))
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                nan_total, nan_run = nan_total + 1, nan_run + 1
                if rank0:
                    print(f"mhmoe: warning: non-finite loss or gradient at step {step}; step skipped "
                          f"({nan_run} in a row, {nan_total} total)", file=sys.stderr)
                if nan_run > cfg.max_nan_skips:
                    raise RuntimeError(f"stopping: {nan_run} consecutive non-finite losses at step {step} "
                                       f"(train.max_nan_skips={cfg.max_nan_skips}); lower train.lr or use float32")
                step += 1
                scheduler.step()
                continue
            nan_run = 0
            optimizer.param_groups[0]["weight_decay"] = weight_decay_at(cfg, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if routing:
                model.balance_step(routing)
            step += 1
            n_tok = cfg.tokens_per_step * world
            tokens_seen += n_tok
            dt = time.perf_counter() - t0
            train_s += dt
            window_tok += n_tok
            bar.update(1)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                if par is not None:  # the global batch's mean losses
                    lm_sum, aux_sum = par.all_mean([lm_sum, aux_sum])
                now = time.perf_counter()
                tps = window_tok / max(1e-9, now - window_t)
                window_t, window_tok = now, 0
                rec = {"step": step, "loss": lm_sum / cfg.grad_accum, "aux_loss": aux_sum / cfg.grad_accum, "lr": lr,
                       "grad_norm": None if gnorm is None else float(gnorm), "tokens_per_s": tps,
                       "tokens": tokens_seen, "nan_skips": nan_total, **routing_summary(routing or [], cfg.grad_accum)}
                if metrics is not None:
                    metrics.log(rec)
                bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tps:,.0f}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.max_steps:
                result.eval = run_eval(step)
            if cfg.ckpt_every and step % cfg.ckpt_every == 0 and step < cfg.max_steps:
                checkpoint(step)
            if stop_after is not None and step >= stop_after:
                break
    except KeyboardInterrupt:
        bar.close()
        if par is None and step > start and step < cfg.max_steps:  # a sharded save needs every rank
            checkpoint(step)
            print(f"mhmoe: interrupted; checkpoint saved at step {step} (continue with --resume)", file=sys.stderr)
        if metrics is not None:
            metrics.close()
        raise
    bar.close()
    if step > start or not list_checkpoints(run_dir):
        checkpoint(step)
    if step >= cfg.max_steps:
        result.eval = run_eval(step)
    result.step, result.nan_skips = step, nan_total
    result.tokens_per_s = tokens_seen / max(1e-9, train_s)
    result.wall_s = train_s
    if metrics is None:
        return result
    metrics.close()
    result.flops_per_token = forward_flops_per_token(model if par is None else LM(run.model),
                                                     cfg.seq_len, device if par is None else "cpu")
    summary = {"preset": run.name, "step": step, "params": result.params, "fwd_flops_per_token": result.flops_per_token,
               "tokens_per_s": result.tokens_per_s, "train_s": train_s, "nan_skips": nan_total,
               "eval": result.eval}
    if env is not None:
        summary.update(world_size=env.world_size, parallel=par.mode, ep=env.ep)
    (run_dir / "results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return result
