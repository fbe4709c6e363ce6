"""A training run's full configuration: model + optimisation + data, with YAML in/out and
``--set key=value`` overrides (dotted paths, values parsed as YAML scalars).

Every section is a dataclass validated on construction; an unknown or invalid key raises
:class:`~mhmoe.errors.ConfigError` naming the dotted field and the allowed values.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mhmoe.config import _check, coerce_fields
from mhmoe.data import DataConfig
from mhmoe.errors import ConfigError
from mhmoe.model import ModelConfig

SCHEDULES = ("linear", "cosine", "constant")
DTYPES = ("float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("auto", "none", "ddp", "fsdp")


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
    schedule: str = "linear"  # linear | cosine | constant (after warm-up)
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.01
    # two-stage schedule (BitNet b1.58 training notes): from step max_steps // 2 on, the lr is
    # multiplied by lr_stage2_ratio and the weight decay of the matrices becomes wd_stage2 (None = keep)
    lr_stage2_ratio: float = 1.0
    wd_stage2: float | None = None
    grad_clip: float = 1.0  # 0 = off
    dtype: str = "float32"  # autocast dtype: float32 (off) | bfloat16 (CUDA and CPU)
    compile: bool = False  # torch.compile the model
    device: str = "auto"  # auto | cpu | cuda
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
    parallel: str = "auto"
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batches", "keep_last"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"train.{name}", v, "an integer >= 1")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "threads", "max_nan_skips"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 0, f"train.{name}", v, "an integer >= 0")
        _check(isinstance(self.compile, bool), "train.compile", self.compile, "true | false")
        _check(self.parallel in PARALLEL, "train.parallel", self.parallel, " | ".join(PARALLEL))
        _check(isinstance(self.ep, int) and not isinstance(self.ep, bool) and self.ep >= 1, "train.ep", self.ep,
               "an integer >= 1 (1 = no expert parallelism)")
        _check(self.lr > 0, "train.lr", self.lr, "a float > 0")
        _check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "0..1")
        _check(self.schedule in SCHEDULES, "train.schedule", self.schedule, " | ".join(SCHEDULES))
        _check(self.dtype in DTYPES, "train.dtype", self.dtype, " | ".join(DTYPES))
        _check(self.device in DEVICES, "train.device", self.device, " | ".join(DEVICES))
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2", (self.beta1, self.beta2), "[0, 1)")
        _check(self.lr_stage2_ratio > 0, "train.lr_stage2_ratio", self.lr_stage2_ratio, "a float > 0 (1.0 = off)")
        _check(self.wd_stage2 is None or self.wd_stage2 >= 0, "train.wd_stage2", self.wd_stage2,
               "null (keep weight_decay) or a float >= 0")
        _check(self.eps > 0 and self.weight_decay >= 0 and self.grad_clip >= 0, "train.eps/weight_decay/grad_clip",
               (self.eps, self.weight_decay, self.grad_clip), "eps > 0, weight_decay >= 0, grad_clip >= 0")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len * self.grad_accum


def _section(cls: type, d: Any, name: str) -> Any:
    if isinstance(d, cls):
        return d
    if cls is ModelConfig:
        return ModelConfig.from_dict(d)
    d = coerce_fields(cls, d, name)
    if cls is DataConfig and isinstance(d.get("val_sets"), list):
        d["val_sets"] = tuple(d["val_sets"])
    return cls(**d)


@dataclass
class RunConfig:
    """model + train + data; ``name`` is the preset it came from (informational)."""

    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        self.model = _section(ModelConfig, self.model, "model")
        self.train = _section(TrainConfig, self.train, "train")
        self.data = _section(DataConfig, self.data, "data")
        _check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
               f"<= model.max_seq_len={self.model.max_seq_len}")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["data"]["val_sets"] = list(d["data"]["val_sets"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        if not isinstance(d, dict):
            raise ConfigError("config", type(d).__name__, "a mapping with model/train/data sections")
        extra = set(d) - {"name", "model", "train", "data"}
        if extra:
            raise ConfigError(sorted(extra)[0], d[sorted(extra)[0]], "one of name, model, train, data")
        return cls(name=d.get("name", "custom"), model=d.get("model", {}), train=d.get("train", {}),
                   data=d.get("data", {}))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str) -> RunConfig:
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("config", type(exc).__name__, "valid YAML (" + " ".join(str(exc).split()) + ")") from None
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_yaml(Path(path).read_text(encoding="utf-8"))

    def with_overrides(self, assignments: list[str]) -> RunConfig:
        """Apply ``section.key=value`` strings (e.g. ``train.lr=1e-3``, ``model.moe.top_k=2``)."""
        d = copy.deepcopy(self.to_dict())
        for item in assignments:
            if "=" not in item:
                raise ConfigError("--set", item, "key=value with a dotted key, e.g. train.lr=1e-3")
            key, raw = item.split("=", 1)
            parts = key.strip().split(".")
            node = d
            for p in parts[:-1]:
                if not isinstance(node.get(p), dict):
                    raise ConfigError(key, raw, "a dotted path into model/train/data (see `mhmoe presets --show`)")
                node = node[p]
            if parts[-1] not in node:
                raise ConfigError(key, raw, "one of " + ", ".join(sorted(node)))
            try:
                node[parts[-1]] = yaml.safe_load(raw)
            except yaml.YAMLError:
                raise ConfigError(key, raw, "a YAML scalar, e.g. 1e-3, 4, true, cosine") from None
        return RunConfig.from_dict(d)
