"""MoE layer benchmark: our execution paths vs the masked per-expert loop vs a same-FLOPs dense FFN vs
the GEMM floor vs peer libraries.

Configurations are the v2 paper's four parity models at d=768 (SwiGLU): SMoE 8x2048 top-1,
fine-grained 16x1024 top-2, MH-MoE h=2 40x768 top-2 and h=3 96x512 top-3 (with head/merge layers).

References in every row:

- ``dense``: one SwiGLU FFN whose hidden width is the multiple of 128 closest to the width that makes
  its matmul FLOPs equal to the MoE layer's: tensor-core friendly, as a real dense model would be. FLOPs
  are the analytic count of :mod:`mhmoe.config.flops` (experts for the routed sub-tokens, head/merge,
  router), a property of the layer and so the same for every path: PyTorch's FlopCounterMode has no
  formula for ``torch._grouped_mm`` and counts padded rows, so it would give each path another number.
  Its time is reported as measured (``ms_dense``) and FLOP-normalised to the MoE layer's FLOPs
  (``ms_dense_norm``); ``ratio_dense`` = ms_dense_norm / ms_ours.
- ``floor``: the expert GEMMs alone -- every expert gets the same number of rows (the routed rows /
  E), run as batched GEMMs on pre-gathered blocks: no router, no dispatch, no combine, no head/merge.
- peers (:mod:`mhmoe.research.bench_peers`): HF transformers' Qwen3-MoE block with each of its experts
  backends, and the PyPI MoE packages, configured like our layer.

On CUDA every row also records the peak memory of each candidate (``mb_<name>``, MiB above the
inputs and weights).

Timing: warm-up, then the median of ``repeats`` runs, all candidates of a row timed round-robin
(:func:`time_fns`), ``impl="auto"``'s path right before the dense FFN in every repeat: ``ratio_dense_auto_paired``
is the median of the per-repeat ratios (:func:`paired_ratio`), robust where the machine's speed moves within
seconds, ``ratio_vs_smoe_paired`` the layer's time over SMoE's from the two rows' paired ratios, and
``ratio_vs_smoe_same_rounds`` the median of auto's time over the SMoE layer's (``ms_smoe``: SMoE, ``impl="auto"``,
timed in every repeat of the other configs' rows, after the dense FFN). ``fwd`` runs
under ``torch.no_grad()``, ``fwd_bwd`` runs forward + backward of ``out.sum() + aux_loss`` with parameter gradients
and (by default) the input's gradient, as for any layer inside a network.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from mhmoe.config.flops import moe_layer_flops
from mhmoe.config.moe import MoEConfig
from mhmoe.moe.experts import DenseFFN, GroupedExperts
from mhmoe.moe.layers import build_ffn_layer
from mhmoe.research.timing import machine_info, paired_ratio, sync, time_fns

D_MODEL = 768
PEER_GROUP = 1024  # tokens per sequence for the peers (their expert capacity is per sequence)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    experts: int
    d_expert: int
    top_k: int
    heads: int
    overrides: tuple[tuple[str, Any], ...] = ()  # other MoEConfig fields (mhmoe bench moe --set)

    def moe_config(self, impl: str) -> MoEConfig:
        hm = self.heads > 1
        return MoEConfig(**{"n_experts": self.experts, "top_k": self.top_k, "d_expert": self.d_expert,
                            "heads": self.heads, "head_layer": hm, "merge_layer": hm, "impl": impl,
                            "balance_loss_weight": 1e-2, **dict(self.overrides)})


#: MoEConfig fields the benchmark itself sets (the configurations' shapes and the timed paths)
FIXED_FIELDS = ("kind", "n_experts", "top_k", "d_expert", "heads", "head_layer", "merge_layer", "impl")


def moe_overrides(assignments: list[str]) -> dict[str, Any]:
    """``["router_dtype=model", ...]`` -> ``{"router_dtype": "model", ...}``: MoEConfig fields for every benchmarked
    layer (values read as YAML scalars; checked as MoEConfig checks them). ConfigError (naming the field) for a field
    the benchmark sets itself, an unknown one or a bad value."""
    from mhmoe.errors import ConfigError, did_you_mean
    from mhmoe.runtime.bounded import BoundedLoadError, load_yaml

    names = [f.name for f in fields(MoEConfig) if f.name not in FIXED_FIELDS]
    out: dict[str, Any] = {}
    for item in assignments:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or key not in names:
            raise ConfigError("--set", item, "FIELD=VALUE with a MoEConfig field other than " + ", ".join(FIXED_FIELDS)
                              + " (set by --configs and the paths)", did_you_mean(key, names))
        try:
            out[key] = load_yaml(raw, f"--set {key}")
        except BoundedLoadError:
            raise ConfigError(key, raw, "a YAML scalar, e.g. model, 0.01, true") from None
    MoEConfig(**out)  # the field checks (types, options, ranges), one line naming the field
    return out


CONFIGS = {
    "smoe": BenchConfig("smoe", 8, 2048, 1, 1),
    "fgmoe": BenchConfig("fgmoe", 16, 1024, 2, 1),
    "mh2": BenchConfig("mh2", 40, 768, 2, 2),
    "mh3": BenchConfig("mh3", 96, 512, 3, 3),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PASSES = ("fwd", "fwd_bwd")


ALIGN = 128  # the dense reference's hidden width is a multiple of this (tensor-core friendly)
CPU_ALIGN = 64  # on a CPU: a multiple of 64 (the AVX-512 / AMX register and tile widths in bf16 and fp32)


def available_impls(device: torch.device) -> list[str]:
    """Our execution paths usable on ``device`` (the loop oracle is measured separately). On CUDA the
    CPU-oriented ``fused``/``chunked`` (per-expert Python loops with host syncs) are left out; ``triton``
    runs when the package is installed (on CPU only its interpreter could run it: not timed)."""
    grouped = ["grouped_mm"] if hasattr(torch, "_grouped_mm") else []
    if device.type == "cuda":
        from mhmoe.moe.dispatch.triton import triton_available

        return grouped + (["triton"] if triton_available() else []) + ["sorted", "padded"]
    return ["padded", "fused", "chunked", "sorted"] + grouped


def aligned_hidden(flops_per_token: float, d_model: int, align: int = ALIGN) -> int:
    """The SwiGLU hidden width, a multiple of ``align``, closest to ``flops_per_token`` (6 d F FLOPs/token)."""
    return max(align, round(flops_per_token / (6 * d_model) / align) * align)


class GemmFloor(torch.nn.Module):
    """The expert GEMMs of a config alone: E SwiGLU experts, each on the same number of rows (routed
    rows / E, pre-gathered into [E, R, D_in] blocks), as batched GEMMs. forward(x [tokens, D]) ignores
    x's values (it only sets the dtype/device) and returns the [E, R, D_in] outputs."""

    def __init__(self, cfg: BenchConfig, tokens: int, d_model: int = D_MODEL) -> None:
        super().__init__()
        d_in = d_model // cfg.heads
        rows = -(-tokens * cfg.heads * cfg.top_k // cfg.experts)
        self.experts = GroupedExperts(cfg.experts, d_in, cfg.d_expert)
        self.blocks = torch.nn.Parameter(torch.randn(cfg.experts, rows, d_in))  # stands in for the gathered rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward_padded(self.blocks.to(x.dtype))


def _runner(module: torch.nn.Module, x: torch.Tensor, pass_: str) -> Callable[[], Any]:
    def fwd() -> Any:
        with torch.no_grad():
            return module(x)

    def fwd_bwd() -> Any:
        module.zero_grad(set_to_none=True)
        x.grad = None
        out = module(x)
        y, aux = (out.out, out.aux_loss) if hasattr(out, "out") else (out, 0.0)
        (y.float().sum() + aux).backward()

    return fwd if pass_ == "fwd" else fwd_bwd


def _autocast(fn: Callable[[], Any], device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    def run() -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return fn()

    return run


def layer_flops(cfg: BenchConfig, tokens: int, d_model: int = D_MODEL) -> int:
    """Analytic forward FLOPs of the config's layer on ``tokens`` tokens (:func:`mhmoe.config.flops.moe_layer_flops`:
    the routed experts, head/merge projections and router), the same for every execution path."""
    return round(tokens * sum(moe_layer_flops(cfg.moe_config("auto"), d_model).values()))


def dense_flops(d_hidden: int, tokens: int, d_model: int = D_MODEL) -> int:
    """Analytic forward FLOPs of the SwiGLU dense reference of hidden width ``d_hidden`` on ``tokens`` tokens."""
    return 6 * d_model * d_hidden * tokens


def _autocast_peer(name: str) -> bool:
    from mhmoe.research.bench_peers import NATIVE_DTYPE

    return name.startswith("peer_") and name[5:] not in NATIVE_DTYPE


def _peak_mb(fns: dict[str, Callable[[], Any]], device: torch.device) -> dict[str, float]:
    """Peak CUDA memory of one call of every function, MiB above what was allocated before it."""
    out = {}
    for name, fn in fns.items():
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        out["mb_" + name[3:]] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return out


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can still get: on CUDA the driver's free memory plus what the caching
    allocator holds unused; on CPU ``MemAvailable`` of /proc/meminfo (None where unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# a peer may use at most this fraction of the free memory: the benchmark's other layers and inputs stay resident
# and the allocator fragments (at 0.9 hf_batched_mm's predicted 18 GiB passed on a 24 GiB CPU machine, and the
# process was killed for memory)
MEMORY_HEADROOM = 0.5


def skipped_peers(cfg: BenchConfig, tokens: int, dtype: torch.dtype, device: torch.device, pass_: str,
                  peers: tuple[str, ...], free: int | None) -> dict[str, str]:
    """{peer: why} for the peers whose predicted memory for this pass exceeds the free memory."""
    from mhmoe.research.bench_peers import peer_predicted_bytes

    out = {}
    for name in peers:
        need = peer_predicted_bytes(name, D_MODEL, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, tokens, dtype,
                                    backward=pass_ == "fwd_bwd")
        if need is not None and free is not None and need > MEMORY_HEADROOM * free:
            out[name] = (f"skipped: predicted {need / 2**30:.1f} GiB for {pass_} > {MEMORY_HEADROOM:.0%} of "
                         f"{free / 2**30:.1f} GiB free (it gathers the expert weights per routed slot)")
    return out


def _candidates(cfg: BenchConfig, x: torch.Tensor, dtype: torch.dtype, device: torch.device, with_loop: bool,
                peers: tuple[str, ...], with_smoe: bool = True,
                ) -> tuple[dict[str, torch.nn.Module], dict[str, torch.nn.Module], int]:
    """(our layers by impl, references and peers by name, the layer's forward FLOPs); ``with_smoe``: the SMoE layer
    among the references of the other configs."""
    tokens = x.shape[0]
    layers = {impl: build_ffn_layer(D_MODEL, cfg.moe_config(impl)).to(device, dtype)
              for impl in available_impls(device)}
    first = next(iter(layers.values()))
    for layer in layers.values():
        layer.load_state_dict(first.state_dict())
    flops = layer_flops(cfg, tokens)
    align = ALIGN if device.type == "cuda" else CPU_ALIGN
    refs: dict[str, torch.nn.Module] = {"dense": DenseFFN(D_MODEL, aligned_hidden(flops / tokens, D_MODEL, align))}
    if with_smoe and cfg.name != "smoe":  # the SMoE layer (impl="auto") in the same rounds, after the dense FFN
        refs["smoe"] = build_ffn_layer(D_MODEL, replace(CONFIGS["smoe"], overrides=cfg.overrides).moe_config("auto"))
    refs["floor"] = GemmFloor(cfg, tokens)
    if with_loop:
        refs["loop"] = build_ffn_layer(D_MODEL, cfg.moe_config("loop"))
        refs["loop"].load_state_dict(first.state_dict())
    for name in peers:
        from mhmoe.research.bench_peers import build_peer

        layer = build_peer(name, D_MODEL, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, PEER_GROUP
                           if tokens % PEER_GROUP == 0 else tokens)
        if layer is not None:
            refs[f"peer_{name}"] = layer
    for name, m in refs.items():  # PyPI peers keep fp32 weights and run under autocast (fp32 dispatch tensors)
        refs[name] = m.to(device) if _autocast_peer(name) else m.to(device, dtype)
    return layers, refs, flops


def bench_config(cfg: BenchConfig, tokens: int, dtype: torch.dtype, device: torch.device, repeats: int,
                 passes: tuple[str, ...] = PASSES, with_loop: bool = True, peers: tuple[str, ...] = (),
                 input_grad: bool = True, with_smoe: bool = True) -> list[dict]:
    """One row per pass. ``with_smoe``: the SMoE layer timed in the same rounds (``ratio_vs_smoe_same_rounds``;
    the GPU lease leaves it out: its router kernels would compile in the lease's first step).
    ``input_grad``: the backward also computes the layer input's gradient, as every
    layer inside a network must (off, a path may skip its input-side GEMMs and a dense FFN its W1/W3
    data gradients)."""
    torch.manual_seed(0)
    x = torch.randn(tokens, D_MODEL, device=device, dtype=dtype).requires_grad_(input_grad)
    layers, refs, flops = _candidates(cfg, x, dtype, device, with_loop, peers, with_smoe)
    ref_flops = dense_flops(refs["dense"].experts.d_hidden, tokens)
    rows = []
    for pass_ in passes:
        row: dict[str, Any] = {"config": cfg.name, "dtype": str(dtype).replace("torch.", ""), "pass": pass_,
                               "tokens": tokens, "input_grad": input_grad, "flops_fwd": flops,
                               "dense_hidden": refs["dense"].experts.d_hidden, "dense_flops_fwd": ref_flops}
        row["auto_impl"] = auto = auto_path(next(iter(layers.values())), x)
        # auto's path timed last of ours, right before the dense FFN (the first reference): paired_ratio
        order = sorted(layers, key=lambda impl: impl == auto)
        fns = {f"ms_{impl}": _runner(layers[impl], x, pass_) for impl in order}
        skipped = skipped_peers(cfg, tokens, dtype, device, pass_, tuple(n[5:] for n in refs if n.startswith("peer_")),
                                free_memory_bytes(device))
        if skipped:
            row["peer_skipped"] = skipped
        for name, m in refs.items():  # peers in bf16: under autocast (fp32 weights)
            if name[5:] in skipped and name.startswith("peer_"):
                continue
            run = _runner(m, x, pass_)
            fns[f"ms_{name}"] = _autocast(run, device, dtype) if _autocast_peer(name) and dtype != torch.float32 \
                else run
        peer_keys = frozenset(k for k in fns if k.startswith("ms_peer_"))
        samples: dict[str, list[float]] = {}
        times, errors = time_fns(fns, device, repeats, fallible=peer_keys, samples=samples)
        row.update(times)
        if f"ms_{auto}" in samples:  # the dense FFN's time (FLOP-normalised) over auto's, repeat by repeat
            row["ratio_dense_auto_paired"] = paired_ratio(samples["ms_dense"], samples[f"ms_{auto}"]) * (
                flops / ref_flops)
            if "ms_smoe" in samples:  # auto's time over the SMoE layer's, repeat by repeat
                row["ratio_vs_smoe_same_rounds"] = paired_ratio(samples[f"ms_{auto}"], samples["ms_smoe"])
        if device.type == "cuda":
            row.update(_peak_mb({k: f for k, f in fns.items() if k in times and k != "ms_loop"}, device))
        _summarise(row, layers, refs, errors, flops / ref_flops)
        row.update(predictions(cfg, tokens, dtype, pass_, row["dense_hidden"], device))
        rows.append(row)
    return rows


def auto_path(layer: torch.nn.Module, x: torch.Tensor) -> str:
    """The execution path ``impl="auto"`` resolves to for this layer's routed experts and input ``x``."""
    from mhmoe.moe.dispatch import resolve_impl

    moe = layer.moe if hasattr(layer, "moe") else layer
    return resolve_impl("auto", x.new_empty(1, moe.d_in), moe.experts)


def predictions(cfg: BenchConfig, tokens: int, dtype: torch.dtype, pass_: str, dense_hidden: int,
                device: torch.device) -> dict[str, Any]:
    """The traffic model's predicted ms (:mod:`mhmoe.research.traffic`) of the Triton path and of the dense
    reference, with the L2 bound and without it (``*_no_l2``), and the Triton path's parts (experts, projections,
    router, router losses: ``pred_parts_triton*``), on a GPU the model knows; {} elsewhere."""
    from mhmoe.research.traffic import dense_prediction, device_for, layer_prediction, without_l2

    dev = device_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if dev is None:
        return {}
    dt = "bf16" if dtype == torch.bfloat16 else ("tf32" if _tf32() else "fp32")
    out: dict[str, Any] = {"pred_device": dev.name}
    for suffix, d in (("", dev), ("_no_l2", without_l2(dev))):
        pred = layer_prediction(tokens, D_MODEL, cfg.experts, cfg.d_expert, cfg.top_k, cfg.heads, dt, pass_, d)
        out[f"pred_ms_triton{suffix}"] = pred["layer_ms"]
        out[f"pred_parts_triton{suffix}"] = {k: v for k, v in pred.items() if k != "layer_ms"}  # experts, router, ...
        out[f"pred_ms_dense{suffix}"] = dense_prediction(tokens, D_MODEL, dense_hidden, dt, pass_, d)
    return out


def _tf32() -> bool:
    from mhmoe.moe.dispatch.precision import cuda_matmul_tf32

    return cuda_matmul_tf32()


def _summarise(row: dict[str, Any], layers: dict, refs: dict, errors: dict[str, str], flop_ratio: float) -> None:
    """Best path, dense (FLOP-normalised), floor, loop and peer ratios of one row (in place)."""
    best = min(layers, key=lambda i: row[f"ms_{i}"])
    row["best_impl"], row["ms_ours"] = best, row[f"ms_{best}"]
    row["ms_dense_norm"] = row["ms_dense"] * flop_ratio
    row["ratio_dense"] = row["ms_dense_norm"] / row["ms_ours"]
    auto = row.get("auto_impl")  # the path impl="auto" runs: its time against the dense FFN
    row["ratio_dense_auto"] = row["ms_dense_norm"] / row[f"ms_{auto}"] if f"ms_{auto}" in row else None
    row["ratio_floor"] = row["ms_floor"] / row["ms_ours"]
    row.setdefault("ms_loop", None)
    row["ratio_loop"] = row["ms_loop"] / row["ms_ours"] if row["ms_loop"] else None
    for key in refs:
        if not key.startswith("peer_"):
            continue
        ms = row.setdefault(f"ms_{key}", None)
        row[f"ratio_{key}"] = ms / row["ms_ours"] if ms else None
        if f"ms_{key}" in errors:  # a peer that cannot run this config/dtype: recorded, not fatal
            row.setdefault("peer_errors", {})[key[5:]] = errors[f"ms_{key}"]


def run_benchmark(configs: list[str], dtypes: list[str], tokens: int, repeats: int, device: str = "cpu",
                  with_loop: bool = True, progress: Callable[[str], None] | None = None,
                  peers: tuple[str, ...] = (), input_grad: bool = True,
                  overrides: dict[str, Any] | None = None) -> dict:
    """Every config x dtype x pass; ``peers``: names from :func:`mhmoe.research.bench_peers.installed_peers`;
    ``overrides``: MoEConfig fields for every layer (:func:`moe_overrides`; recorded in the result)."""
    dev = torch.device(device)
    rows: list[dict] = []
    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    for name in configs:
        for dt in dtypes:
            if progress:
                progress(f"{name} {dt}")
            cfg = replace(CONFIGS[name], overrides=tuple(sorted((overrides or {}).items())))
            rows += bench_config(cfg, tokens, DTYPES[dt], dev, repeats, with_loop=with_loop,
                                 peers=tuple(peers), input_grad=input_grad)
    smoe = {(r["dtype"], r["pass"]): r for r in rows if r["config"] == "smoe"}
    for r in rows:
        base = smoe.get((r["dtype"], r["pass"]))
        r["ratio_vs_smoe"] = r["ms_ours"] / base["ms_ours"] if base else None
        auto, base_auto = r.get(f"ms_{r.get('auto_impl')}"), base and base.get(f"ms_{base.get('auto_impl')}")
        r["ratio_vs_smoe_auto"] = auto / base_auto if auto and base_auto else None  # impl="auto" in both
        # the same from each row's paired dense ratio: the two layers' times (equal FLOPs) each measured against
        # its own dense FFN, so that the machine's speed when each row ran drops out
        paired, base_paired = r.get("ratio_dense_auto_paired"), base and base.get("ratio_dense_auto_paired")
        r["ratio_vs_smoe_paired"] = base_paired / paired if paired and base_paired else None
        if r["config"] == "smoe":
            r["ratio_vs_smoe_same_rounds"] = 1.0
    machine = machine_info(dev)
    machine["loadavg_before"] = load_before  # 1, 5, 15-minute load averages: other work on the machine
    machine["loadavg_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    machine["date"] = datetime.date.today().isoformat()
    if peers:
        from mhmoe.research.bench_peers import peer_info

        machine["peers"] = peer_info()
    return {"machine": machine, "overrides": dict(sorted((overrides or {}).items())), "rows": rows}


def _pred_range(row: dict, key: str) -> str:
    """"lo-hi" ms of a prediction: without the L2 bound, with it."""
    return "-" if key not in row else f"{row[key + '_no_l2']:.2f}-{row[key]:.2f}"


def format_rows(result: dict) -> str:
    rows = result["rows"]
    refs = ("ours", "dense", "dense_norm", "loop", "floor", "smoe")
    impls = sorted({k[3:] for r in rows for k in r
                    if k.startswith("ms_") and k[3:] not in refs and not k.startswith("ms_peer_")})
    peers = sorted({k[8:] for r in rows for k in r if k.startswith("ms_peer_")})
    pred = any("pred_ms_triton" in r for r in rows)
    head = (["config", "dtype", "pass", "tokens"] + [f"{i} ms" for i in impls]
            + ["ours ms", "loop ms", "dense ms", "dense/ours", "auto", "dense/auto", "dense/auto paired", "floor ms",
               "floor/ours", "loop/ours", "vs smoe", "auto vs smoe", "auto vs smoe paired", "auto vs smoe same rounds"]
            + [c for p in peers for c in (f"{p} ms", f"{p}/ours")]
            + (["triton ms predicted", "dense ms predicted"] if pred else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in rows:
        cells = [r["config"], r["dtype"], r["pass"], str(r["tokens"])] + [fmt(r.get(f"ms_{i}")) for i in impls]
        cells += [fmt(r["ms_ours"]), fmt(r["ms_loop"]), fmt(r["ms_dense"]), fmt(r["ratio_dense"], 2),
                  f"`{r.get('auto_impl')}`", fmt(r.get("ratio_dense_auto"), 2),
                  fmt(r.get("ratio_dense_auto_paired"), 2), fmt(r["ms_floor"]), fmt(r["ratio_floor"], 2),
                  fmt(r["ratio_loop"], 2), fmt(r["ratio_vs_smoe"], 2), fmt(r.get("ratio_vs_smoe_auto"), 2),
                  fmt(r.get("ratio_vs_smoe_paired"), 2), fmt(r.get("ratio_vs_smoe_same_rounds"), 2)]
        cells += [c for p in peers for c in (fmt(r.get(f"ms_peer_{p}")), fmt(r.get(f"ratio_peer_{p}"), 2))]
        if pred:
            cells += [_pred_range(r, "pred_ms_triton"), _pred_range(r, "pred_ms_dense")]
        lines.append("| " + " | ".join(cells) + " |")
    m = result["machine"]
    gpu = f" ({m['gpu']})" if m.get("gpu") else ""
    isa = f" ({m['isa']})" if m.get("isa") and not gpu else ""
    lines.append(f"\nmachine: {m['cpu']}{isa}, {m['threads']} threads, torch {m['torch']}, device {m['device']}{gpu}; "
                 "dense/ours uses the dense FFN's time scaled to the MoE layer's FLOPs (analytic)"
                 + ("; predicted = the traffic model (mhmoe.research.traffic) on "
                    f"{next(r['pred_device'] for r in rows if 'pred_device' in r)}, without-L2 bound to "
                    "with-L2 bound (unmeasured assumptions)" if pred else ""))
    if result.get("overrides"):
        lines.append("every layer with " + ", ".join(f"{k}={v}" for k, v in result["overrides"].items()))
    return "\n".join(lines)
