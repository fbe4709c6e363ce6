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

from mhmoe.config.data import DataConfig
from mhmoe.config.fields import check, coerce_fields
from mhmoe.config.model import ModelConfig
from mhmoe.config.train import TrainConfig
from mhmoe.errors import ConfigError, did_you_mean
from mhmoe.runtime.bounded import MAX_YAML_CHARS, BoundedLoadError, load_yaml
from mhmoe.runtime.reading import read_text


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
        check(isinstance(self.name, str) and self.name.strip() != "", "name", self.name, "a non-empty string")
        self.model = _section(ModelConfig, self.model, "model")
        self.train = _section(TrainConfig, self.train, "train")
        self.data = _section(DataConfig, self.data, "data")
        check(self.train.seq_len <= self.model.max_seq_len, "train.seq_len", self.train.seq_len,
               f"<= model.max_seq_len={self.model.max_seq_len}")
        arch = "encoder" if self.data.task == "masked_mm" else "decoder"  # the model each task trains
        check(self.model.arch == arch, "model.arch", self.model.arch, f"{arch} with data.task={self.data.task}")
        check(self.train.activation_checkpointing != "moe" or self.model.moe.kind != "dense",
              "train.activation_checkpointing", "moe", "none | blocks for a dense model (it has no MoE layer)")
        check(not (self.train.compile and self.model.moe.xmoe_code) or self.train.activation_checkpointing == "none",
              "train.activation_checkpointing", self.train.activation_checkpointing,
              "none with train.compile and model.moe.xmoe_reading=code (a compiled recomputation would rescale the "
              "expert embeddings again)")

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
    def from_yaml(cls, text: str, where: str = "config") -> RunConfig:
        """Parse YAML within the limits of :func:`mhmoe.runtime.bounded.load_yaml` (size, nesting, alias
        expansion; duplicate keys refused); ConfigError naming ``where`` otherwise."""
        try:
            d = load_yaml(text, where)
        except BoundedLoadError as exc:
            raise ConfigError("config", where, f"a valid run config ({str(exc).removeprefix(where + ': ')})") from None
        if not isinstance(d, dict):  # e.g. a config.yaml linked to another file: name the file, not the type
            raise ConfigError("config", where, f"a YAML mapping with model/train/data sections (this file holds a "
                              f"{type(d).__name__})")
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        """Read a YAML run config; ConfigError (one line, naming the file) for a missing, unreadable,
        empty, non-text or over-limit file."""
        path = Path(path)
        try:  # a regular file (never a FIFO or /dev/zero), its size from fstat before a byte is read
            text = read_text(path, MAX_YAML_CHARS * 4, what="run config")
        except OSError as exc:
            raise ConfigError("config", str(path), f"a readable YAML file ({exc.strerror or type(exc).__name__})"
                              ) from None
        except BoundedLoadError as exc:
            raise ConfigError("config", str(path), f"a YAML run config file ({str(exc).removeprefix(f'{path}: ')})"
                              ) from None
        if not text.strip():
            raise ConfigError("config", str(path), "a YAML run config (this file is empty; in a run directory, the "
                              "config.yaml of its newest checkpoint, RUN/checkpoints/step_*/config.yaml, is a copy)")
        return cls.from_yaml(text, str(path))

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
                raise ConfigError(key, raw, "one of " + ", ".join(sorted(node)), did_you_mean(parts[-1], node))
            try:
                node[parts[-1]] = load_yaml(raw, f"--set {key}")
            except BoundedLoadError:
                raise ConfigError(key, raw, "a YAML scalar, e.g. 1e-3, 4, true, cosine") from None
        return RunConfig.from_dict(d)
