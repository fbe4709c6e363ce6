"""Optimisation and bookkeeping configuration: :class:`TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from mhmoe.config.fields import INT64, check, check_types

Schedule = Literal["linear", "cosine", "constant", "wsd"]
CooldownShape = Literal["1-sqrt", "linear", "cosine"]  # train.cooldown_shape: how wsd's lr falls in its cooldown
DType = Literal["float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
Parallel = Literal["auto", "none", "ddp", "fsdp"]
ParallelMode = Literal["none", "ddp", "fsdp"]  # train.parallel with auto decided (mhmoe.parallel.launch.parallel_mode)
DataParallel = Literal["ddp", "fsdp"]  # how mhmoe.parallel.data_parallel.parallelize wraps a model
Recompute = Literal["none", "moe", "blocks"]  # train.activation_checkpointing (mhmoe.model.recompute)
SCHEDULES, DTYPES, DEVICES, PARALLEL = (get_args(t) for t in (Schedule, DType, Device, Parallel))
#: tokens of one micro-batch (batch_size * seq_len): past this, index arithmetic of int32 kernels overflows and
#: no machine holds the activations; a smaller batch that still does not fit fails with a one-line out-of-memory
MAX_MICRO_BATCH_TOKENS = 2**31 - 1


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. Defaults follow the ICML paper's Table 10 where sensible:
    AdamW betas (0.9, 0.98), eps 1e-6, weight decay 0.01, warm-up then linear decay."""

    max_steps: int = 1000
    batch_size: int = 16  # sequences per micro-batch
    seq_len: int = 256
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 5e-4
    min_lr_ratio: float = 0.0  # final lr = lr * min_lr_ratio
    warmup_steps: int = 100
    # after warm-up: linear | cosine decay to lr * min_lr_ratio at max_steps | constant | wsd (warm-up, stable,
    # decay: the lr stays at its peak until the last cooldown_fraction of max_steps, then falls to lr * min_lr_ratio
    # in the cooldown_shape; a run resumed from a checkpoint of its stable phase with a larger --max-steps moves
    # the cooldown to its new end. Hagele et al. 2024, arXiv:2405.18392: 1-sqrt over the last 20% matches cosine)
    schedule: Schedule = "linear"
    cooldown_fraction: float = 0.2  # wsd: the share of max_steps at the end in which the lr decays
    cooldown_shape: CooldownShape = "1-sqrt"  # wsd: 1-sqrt (1 - sqrt(t)) | linear (1 - t) | cosine, t from 0 to 1
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.01
    # two-stage schedule (BitNet b1.58 training notes): from step max_steps // 2 on, the lr is
    # multiplied by lr_stage2_ratio and the weight decay of the matrices becomes wd_stage2 (None = keep)
    lr_stage2_ratio: float = 1.0
    wd_stage2: float | None = None
    grad_clip: float = 1.0  # 0 = off
    # autocast dtype: float32 (off) | bfloat16 (CUDA and CPU) | float16 (with dynamic loss scaling, for GPUs without
    # bf16 such as the T4 and V100; mhmoe.train.loss_scale)
    dtype: DType = "float32"
    compile: bool = False  # torch.compile the model
    # with compile, on CUDA: capture the compiled forward and backward as CUDA graphs (torch.compile mode
    # "reduce-overhead"); the default paths have no host synchronisation, so the capture holds
    cuda_graphs: bool = False
    # what a training forward keeps for the backward (mhmoe.model.recompute): none = everything (fastest) |
    # moe = the MoE layers run again in the backward | blocks = every block does (least memory); same results
    activation_checkpointing: Recompute = "none"
    device: Device = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch.set_num_threads on CPU (0 = torch default)
    seed: int = 1337
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 16
    ckpt_every: int = 0  # 0 = only at the end
    keep_last: int = 2
    max_nan_skips: int = 5  # consecutive non-finite losses before the run stops
    # scale-out (docs/DISTRIBUTED.md), launch properties taken from the command even on --resume:
    # parallel: auto (ddp under torchrun with WORLD_SIZE > 1, else none) | none | ddp | fsdp (FSDP2);
    # ep: expert-parallel group size (divides the world size and model.moe.n_experts; needs ddp)
    parallel: Parallel = "auto"
    ep: int = 1

    def __post_init__(self) -> None:
        check_types(self, "train.")  # types, and the Literal options (schedule, dtype, device, parallel)
        for name in ("max_steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches", "keep_last"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, f"train.{name}", v, "an integer >= 1")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "threads", "max_nan_skips"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 0, f"train.{name}", v, "an integer >= 0")
        check(0 <= self.seed < INT64, "train.seed", self.seed, "an integer in 0..2**63-1")
        check(self.batch_size * self.seq_len <= MAX_MICRO_BATCH_TOKENS, "train.batch_size", self.batch_size,
              f"an integer >= 1 with batch_size * seq_len <= {MAX_MICRO_BATCH_TOKENS:,} (seq_len={self.seq_len})")
        check(isinstance(self.ep, int) and not isinstance(self.ep, bool) and self.ep >= 1, "train.ep", self.ep,
               "an integer >= 1 (1 = no expert parallelism)")
        check(self.compile or not self.cuda_graphs, "train.cuda_graphs", self.cuda_graphs,
              "false, or true together with train.compile=true (CUDA graphs capture the compiled model)")
        check(self.dtype != "float16" or self.parallel != "fsdp", "train.dtype", self.dtype,
              "float32 | bfloat16 with train.parallel=fsdp (float16 loss scaling runs with ddp or one process)")
        check(self.lr > 0, "train.lr", self.lr, "a float > 0")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "0..1")
        check(0 < self.cooldown_fraction <= 1, "train.cooldown_fraction", self.cooldown_fraction,
              "a float in (0, 1] (wsd: the share of max_steps at the end in which the lr decays)")
        for name in ("beta1", "beta2"):
            check(0 <= getattr(self, name) < 1, f"train.{name}", getattr(self, name), "a float in [0, 1)")
        check(self.lr_stage2_ratio > 0, "train.lr_stage2_ratio", self.lr_stage2_ratio, "a float > 0 (1.0 = off)")
        check(self.wd_stage2 is None or self.wd_stage2 >= 0, "train.wd_stage2", self.wd_stage2,
               "null (keep weight_decay) or a float >= 0")
        check(self.eps > 0, "train.eps", self.eps, "a float > 0")
        for name in ("weight_decay", "grad_clip"):
            check(getattr(self, name) >= 0, f"train.{name}", getattr(self, name), "a float >= 0 (0 = off)")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum
