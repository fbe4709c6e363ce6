"""Packed ternary export of a BitNet b1.58 model (``mhmoe export --bitnet``) and its loader.

File ``OUT/model.bitnet.safetensors`` (format ``mhmoe-bitnet158``, version 1):

- every quantized weight ``NAME`` (BitLinear weights; expert ``w1``/``w2``/``w3`` stacks) is stored as
  ``NAME.packed`` uint8 [G, ceil(n / 4)] + ``NAME.scale`` fp32 [G]: G = 1 for a matrix, G = E for a
  stacked expert tensor [E, A, B] (one scale per expert), n = the element count of one group.
  Scale convention: ``W = code * gamma`` with code in {-1, 0, +1} and gamma = the absmean scale the
  fake-quantized model used (mean|W| of the latent weight, clamped at 1e-5).
- 2-bit codes: ``code + 1`` -> {0, 1, 2} (3 is never written). Four codes per byte, little-endian
  within the byte: element ``4j + i`` of a group (row-major/C order of the group's elements) sits in
  bits ``2i .. 2i+1`` of byte ``j``. A group whose n is not a multiple of 4 is padded with code 0
  (bits ``01``) in its last byte.
- every other tensor (embeddings = tied LM head, norms, sub-norms, routers, biases) is stored under
  its own name in ``float_dtype`` (fp32 by default: the loaded model is then exact; bf16 halves them).
- the safetensors metadata key ``mhmoe.bitnet`` holds JSON: format, version, the scale convention,
  the code map and bit order, ``packed`` (name -> original shape, groups, per-group count, dtype)
  and ``model`` (the ModelConfig as a dict).

:func:`load_packed` unpacks once (W = code * gamma, exactly the fake-quantized weights) into an
:class:`~mhmoe.model.LM` marked ``prequantized`` (weights are used as stored, activations are still
quantized), so it computes the same logits as the fake-quantized model -- bit-identical on CPU in
fp32 (tested with atol 1e-5, see docs/BITNET.md).
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from mhmoe.checkpoint.layout import WEIGHTS_FILE
from mhmoe.config.model import ModelConfig
from mhmoe.errors import ConfigError
from mhmoe.model.lm import LM
from mhmoe.quant.bitnet import BITNET158, quantized_weights, set_prequantized, ternary_codes
from mhmoe.runtime.bounded import load_json

FORMAT = "mhmoe-bitnet158"
FORMAT_VERSION = 1
FILE_NAME = "model.bitnet.safetensors"
META_KEY = "mhmoe.bitnet"
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pack_ternary(codes: Tensor) -> Tensor:
    """codes [G, n] with values in {-1, 0, 1} (any dtype) -> uint8 [G, ceil(n / 4)], 4 per byte
    (element 4j+i in bits 2i..2i+1 of byte j, code + 1; padding code 0 = bits 01)."""
    if codes.dim() != 2:
        raise ValueError(f"invalid codes shape {tuple(codes.shape)}: allowed [G, n]")
    G, n = codes.shape
    c = (codes.to(torch.int16) + 1).to(torch.uint8)
    if bool((c > 2).any()):
        raise ValueError("invalid ternary codes: allowed values -1, 0, 1")
    pad = (-n) % 4
    if pad:
        c = torch.cat([c, torch.ones(G, pad, dtype=torch.uint8, device=c.device)], 1)
    c = c.view(G, -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


def unpack_ternary(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_ternary`: uint8 [G, m] -> int8 codes [G, n] in {-1, 0, 1}."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != math.ceil(n / 4):
        raise ValueError(f"invalid packed tensor {packed.dtype} {tuple(packed.shape)} for n={n}")
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    c = (packed.unsqueeze(-1) >> shifts) & 3  # [G, m, 4]
    return (c.reshape(packed.shape[0], -1)[:, :n].to(torch.int8) - 1)


def _groups(shape: torch.Size, dims: tuple[int, ...] | None) -> int:
    """Number of scales of a quantized tensor: 1 (whole matrix) or the leading (expert) dim."""
    if dims is None:
        return 1
    if tuple(dims) != tuple(range(1, len(shape))):
        raise ValueError(f"unsupported quantization dims {dims} for shape {tuple(shape)}")
    return shape[0]


@dataclass
class ExportReport:
    path: Path
    packed_bytes: int  # size of model.bitnet.safetensors
    fp32_bytes: int  # size of the same model as an fp32 safetensors file (save_model)
    packed_tensors: int  # quantized matrices / expert stacks packed
    packed_params: int  # weights stored as 2-bit codes
    float_params: int  # weights stored in float_dtype
    float_dtype: str

    @property
    def ratio(self) -> float:
        return self.fp32_bytes / max(1, self.packed_bytes)

    def to_dict(self) -> dict:
        return {"path": str(self.path), "packed_bytes": self.packed_bytes, "fp32_bytes": self.fp32_bytes,
                "ratio": self.ratio, "packed_tensors": self.packed_tensors, "packed_params": self.packed_params,
                "float_params": self.float_params, "float_dtype": self.float_dtype}


def _float_state(model: LM) -> dict[str, Tensor]:
    """The model's state dict with the tied LM head stored once (as ``embed.weight``)."""
    state = dict(model.state_dict())
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    return state


def fp32_size(model: LM) -> int:
    """Bytes of the model as an fp32 safetensors file (what a checkpoint's model.safetensors holds)."""
    state = {k: v.detach().float().contiguous().cpu() if v.is_floating_point() else v.contiguous().cpu()
             for k, v in _float_state(model).items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / WEIGHTS_FILE
        save_file(state, str(path))
        return path.stat().st_size


def export_bitnet(model: LM, out_dir: str | Path, float_dtype: str = "float32") -> ExportReport:
    """Write ``out_dir/model.bitnet.safetensors`` (see the module docstring) and return sizes."""
    if model.cfg.quant != BITNET158:
        raise ConfigError("model.quant", model.cfg.quant,
                          f"{BITNET158} (export --bitnet packs a model trained with quantization-aware training)")
    if float_dtype not in FLOAT_DTYPES:
        raise ConfigError("--float-dtype", float_dtype, " | ".join(FLOAT_DTYPES))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    quant = quantized_weights(model)
    params = dict(model.named_parameters())
    tensors: dict[str, Tensor] = {}
    packed_meta: dict[str, dict] = {}
    n_packed = n_float = 0
    with torch.no_grad():
        for name, t in _float_state(model).items():
            if name in quant:
                w = params[name]
                dims = quant[name]
                G = _groups(w.shape, dims)
                codes, gamma = ternary_codes(w, dims)  # exactly what weight_quant uses
                tensors[f"{name}.packed"] = pack_ternary(codes.reshape(G, -1)).contiguous().cpu()
                tensors[f"{name}.scale"] = gamma.reshape(G).float().contiguous().cpu()
                packed_meta[name] = {"shape": list(w.shape), "groups": G, "numel_per_group": w.numel() // G,
                                     "dtype": str(w.dtype).removeprefix("torch.")}
                n_packed += w.numel()
            else:
                tensors[name] = t.detach().to(FLOAT_DTYPES[float_dtype] if t.is_floating_point() else t.dtype
                                              ).contiguous().cpu()
                n_float += t.numel() if t.is_floating_point() else 0
    meta = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "scale_convention": "W = code * gamma; code in {-1, 0, +1}; gamma = NAME.scale (fp32), one per matrix "
                            "(groups = 1) or per expert (groups = E, leading dim of [E, A, B])",
        "code_map": {"0": -1, "1": 0, "2": 1},
        "bit_order": "4 codes per byte, element 4j+i of a group (row-major) in bits 2i..2i+1 of byte j "
                     "(little-endian within the byte); padding code 1 (= 0)",
        "packed": packed_meta,
        "float_dtype": float_dtype,
        "model": model.cfg.to_dict(),
    }
    path = out_dir / FILE_NAME
    save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})
    return ExportReport(path, path.stat().st_size, fp32_size(model), len(packed_meta), n_packed, n_float,
                        float_dtype)


def read_metadata(path: str | Path) -> dict:
    """The ``mhmoe.bitnet`` JSON metadata of a packed file (ValueError when it is not one)."""
    with safe_open(str(path), framework="pt") as f:
        raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise ValueError(f"{path}: not an mhmoe BitNet export (no {META_KEY!r} metadata)")
    meta = load_json(raw, f"{path} ({META_KEY} metadata)")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: {META_KEY} metadata is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {meta.get('format')!r} v{meta.get('version')!r}, "
                         f"expected {FORMAT} v{FORMAT_VERSION}")
    return meta


def load_packed(path: str | Path, device: str | torch.device = "cpu") -> LM:
    """Build the LM of a packed file: ternary weights unpacked once to code * gamma (fp32), other
    tensors cast to fp32; the model is ``prequantized`` (no re-quantization of the stored weights,
    activations still 8-bit) and in eval mode. ``path``: the file or the export directory."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    meta = read_metadata(path)
    cfg = ModelConfig.from_dict(meta["model"])
    model = LM(cfg)
    state: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        for name, info in meta["packed"].items():
            G, n = int(info["groups"]), int(info["numel_per_group"])
            codes = unpack_ternary(f.get_tensor(f"{name}.packed"), n).float()
            gamma = f.get_tensor(f"{name}.scale").float().reshape(G, 1)
            state[name] = (codes * gamma).reshape(info["shape"])  # W = code * gamma, as in weight_quant
            keys -= {f"{name}.packed", f"{name}.scale"}
        for name in keys:
            t = f.get_tensor(name)
            state[name] = t.float() if t.is_floating_point() else t
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: tensors do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    set_prequantized(model, True)
    return model.to(device).eval()
