"""Kernel resource report without a GPU: every Triton MoE kernel, in every config it may launch, compiled for
a GPU target (default sm_90a, the H100) with the *launch's real specialisation*.

How: a forward and backward of the op runs on CPU tensors of real shapes with the launches recorded
instead of run (:func:`mhmoe.moe.dispatch.triton.launch.recording`); each recorded launch is bound by
triton's own argument binder -- the code a real launch runs to decide which integers are 1 or multiples
of 16 and which pointers are 16-byte aligned -- and compiled, once per candidate config, for the target.
Triton ships ptxas, so this runs on any machine. Each compile is then read back: shared memory (triton's
metadata), registers and local memory (``cuobjdump -res-usage`` on the cubin: spills live in local
memory), whether the loads are pipelined (``cp.async`` in the PTX) and whether the MMAs are Hopper tensor-core
instructions (``wgmma``).

Needs the compiled kernels (import without ``TRITON_INTERPRET``) and a triton with the NVIDIA backend.
Used by ``benchmarks/triton_moe.py --aot`` and ``tests/moe/test_triton_aot.py``.

Shape legend: S tokens, K top-k, E experts, D expert width, F hidden width.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mhmoe.moe.dispatch.triton.tiles import CONFIGS, H100_SMEM, Tile, smem_bytes

# (S, K, E, D, F) at the dispatch level: the parity configs' expert shapes (mh3: d/h = 256, fused dx;
# smoe: K = 1, no K-sum, unfused dx) and an unaligned one (padded to 112 x 304 by the op)
SHAPES = {"mh3": (512, 3, 96, 256, 512), "mh2": (512, 2, 40, 384, 768), "fgmoe": (512, 2, 16, 768, 1024),
          "smoe": (512, 1, 8, 768, 2048), "odd": (300, 2, 6, 100, 300)}
# which gradients a backward computes: (x, routing weights, w1, w2, w3); None = a forward without autograd
SCENARIOS: dict[str, tuple[bool, ...] | None] = {
    "train": (True, True, True, True, True), "inference": None, "frozen_experts": (True, True, False, False, False),
    "frozen_input": (False, True, True, True, True), "fixed_routing": (True, False, True, True, True)}
TENSOR_CORE = re.compile(r"\bwgmma\.mma_async")
PIPELINED = re.compile(r"\bcp\.async\b|\bcp\.async\.bulk")


@dataclass
class KernelReport:
    """One compiled kernel x config x specialisation."""

    kernel: str
    dtype: str
    variant: str  # the launch's non-tile constexprs, e.g. "GATED=1 STORE_PRE=1"
    tile: str  # "BMxBNxBK w{warps} s{stages}"
    smem: int  # bytes of shared memory (dynamic, triton's metadata)
    smem_predicted: int  # tiles.smem_bytes (the autotuner's prune)
    registers: int
    local_bytes: int  # per-thread local memory: register spills
    pipelined: bool  # cp.async loads in the PTX
    wgmma: bool  # Hopper tensor-core MMA in the PTX
    precision: str  # tl.dot input precision: tf32 | ieee (fp32) / tf32 (bf16: ignored); split: the router
    seconds: float

    def problems(self, smem_limit: int = H100_SMEM) -> list[str]:
        """What this compile gets wrong for an H100 (empty = fine)."""
        where = f"{self.kernel} {self.dtype} [{self.variant}] {self.tile}"
        out = []
        if self.smem > smem_limit:
            out.append(f"{where}: {self.smem / 1024:.0f} KiB shared memory > {smem_limit / 1024:.0f} KiB")
        if self.local_bytes:
            out.append(f"{where}: {self.local_bytes} B of register spills (local memory)")
        no_loop = self.kernel == "ksum" or (self.kernel == "router_bwd" and "NEED_DX=0" in self.variant)
        if not self.pipelined and not no_loop:
            out.append(f"{where}: loads not pipelined (no cp.async)")
        if self.precision == "split" and not self.wgmma and not no_loop:  # the fused router: bf16 MMAs
            out.append(f"{where}: no wgmma (tensor cores) in its split bf16 MMAs")
        elif (self.dtype == "bf16" or self.precision == "tf32") and not self.wgmma and not no_loop:
            out.append(f"{where}: no wgmma (tensor cores) in {self.dtype}/{self.precision}")
        return out


def record(shape: tuple[int, int, int, int, int], dtype: torch.dtype, ffn: str, scenario: str,
           fused: bool | None = None) -> list:
    """The launches of one forward (and backward) of the op at ``shape``, recorded, not run (CPU tensors).
    ``fused``: the act_dx backward on/off (default: as configured)."""
    from mhmoe.moe.dispatch.triton import launch as L
    from mhmoe.moe.dispatch.triton.backward import expert_backward
    from mhmoe.moe.dispatch.triton.ops import _pad_widths

    S, K, E, D, F = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, D, generator=gen).to(dtype)
    w1, w2 = torch.empty(E, D, F, dtype=dtype), torch.empty(E, F, D, dtype=dtype)
    w3 = torch.empty(E, D, F, dtype=dtype) if ffn == "swiglu" else None
    x, w1, w2, w3 = _pad_widths(x, w1, w2, w3)
    idx = torch.randint(0, E, (S, K), generator=gen)
    valid = torch.ones(S, K, dtype=torch.bool)
    weights = torch.rand(S, K, generator=gen)
    needs = SCENARIOS[scenario]
    with L.recording() as launches:
        plan = L.route_plan(idx, valid, E, L.plan_block_ms(dtype))
        if needs is None:
            _, _, act = L.up_forward(x, w1, w3, plan, store_pre=False)
            assert act is not None
            L.down_forward(act, None, w2, weights, valid, plan, "none")
        else:
            h1, h3, _ = L.up_forward(x, w1, w3, plan, store_pre=True)
            assert h1 is not None
            L.down_forward(h1, h3, w2, weights, valid, plan, "relu" if w3 is None else "swiglu")
            expert_backward(torch.empty_like(x), x, weights, w1, w2, w3, h1, h3, valid, plan, needs, fused)
        if ffn == "swiglu":  # the fused router over the same sub-tokens (input width D, unpadded)
            _record_router(S, E, K, D, dtype, needs)
    return launches


def _record_router(S: int, E: int, K: int, D: int, dtype: torch.dtype, needs: tuple[bool, ...] | None) -> None:
    """The fused router's launches (forward; the backward with the x and weight gradients ``needs`` asks for)."""
    from mhmoe.moe.dispatch.triton import router as R

    x, w = torch.empty(S, D, dtype=dtype), torch.empty(E, D)
    mask = torch.ones(S, dtype=torch.bool)
    logits, _, _, experts, *_ = R._forward(x, w, None, mask, K, "softmax", True)
    if needs is not None and (needs[0] or needs[1]):
        g = torch.empty(S, E)
        R._backward(g, g, torch.empty(S, K), x, w, logits, experts, mask, "softmax", True, needs[0], needs[2])


def _binder(fn, backend):
    """triton's argument binder for ``fn`` (the code a launch runs to specialise its arguments)."""
    from triton.runtime.jit import create_function_from_signature

    return create_function_from_signature(fn.signature, fn.params, backend)


def _variant(consts: dict[str, Any]) -> str:
    skip = {"BM", "BN", "BK", "PREC", "DP", "PART", "BS", "BD", "EP", "KP", "num_warps", "num_stages"}
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(consts.items()) if k not in skip)


def _resources(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes per thread) of a cubin, from ``cuobjdump -res-usage``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", out)
    local = re.search(r"LOCAL:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    spill = (int(local.group(1)) if local else 0) + (int(stack.group(1)) if stack else 0)
    return int(reg.group(1)) if reg else -1, spill


def compile_launch(launch, tile: Tile | None, arch: int = 90) -> KernelReport:
    """Compile one recorded launch with one config (None: the launch's own constexprs, e.g. the K-sum)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from mhmoe.moe.dispatch.triton import kernels as K_
    from mhmoe.moe.dispatch.triton import launch as L

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    from mhmoe.moe.dispatch.triton import router as R

    fn = {**L.JIT, **R.JIT}.get(launch.kernel, K_._ksum_kernel)
    kwargs = dict(launch.consts)
    if tile is not None:
        kwargs.update(L.tile_kwargs(launch.kernel, tile), num_warps=tile.warps, num_stages=tile.stages)
    bound, spec, opts = _binder(fn, backend)(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    t0 = time.perf_counter()
    kern = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    seconds = time.perf_counter() - t0
    regs, local = _resources(kern.asm["cubin"])
    ptx = kern.asm["ptx"]
    item = 2 if launch.dtype == "bf16" else 4
    gated = bool(launch.consts.get("GATED", True))
    d = int(launch.consts.get("DP", 256))  # act_dx: its [BN, DP] weight panels
    c = launch.consts
    name = ("—" if "num_warps" not in c else "x".join(str(c[k]) for k in ("BM", "BN", "BK") if k in c)
            + f" w{c['num_warps']} s{c.get('num_stages', 1)}") if tile is None else \
        f"{tile.bm}x{tile.bn}x{tile.bk} w{tile.warps} s{tile.stages}"
    return KernelReport(
        kernel=launch.kernel, dtype=launch.dtype, variant=_variant(launch.consts), tile=name,
        smem=int(kern.metadata.shared), smem_predicted=R.smem_bytes(launch.kernel, c, item, c["EP"]) if "EP" in c else
        0 if tile is None else smem_bytes(launch.kernel, tile, item, gated, d),
        registers=regs, local_bytes=local, pipelined=bool(PIPELINED.search(ptx)), wgmma=bool(TENSOR_CORE.search(ptx)),
        precision="split" if launch.kernel.startswith("router") else str(launch.consts.get("PREC", "-")),
        seconds=seconds)


def _key(launch, tile: Tile | None) -> tuple:
    specialised = tuple((type(a).__name__, str(a.dtype)) if isinstance(a, torch.Tensor) else
                        (a == 1, a % 16 == 0) if isinstance(a, int) else a for a in launch.args)
    return launch.kernel, launch.dtype, tuple(sorted(launch.consts.items())), tile, specialised


def report(shapes: list[str] | None = None, dtypes: tuple[str, ...] = ("bf16", "fp32"),
           ffns: tuple[str, ...] = ("swiglu", "relu"), scenarios: list[str] | None = None,
           precisions: tuple[str, ...] = ("ieee", "tf32"), arch: int = 90,
           progress=None) -> list[KernelReport]:
    """Compile every distinct (kernel, variant, specialisation) the given cases launch, in every candidate
    config of its kernel and dtype (fp32: with each tl.dot precision in ``precisions``)."""
    from mhmoe.moe.dispatch.precision import cuda_matmul_tf32_set
    from mhmoe.moe.dispatch.triton import launch as L

    if L.INTERPRETED:
        raise RuntimeError("the compile report needs the compiled kernels: unset TRITON_INTERPRET")
    seen: set[tuple] = set()
    out: list[KernelReport] = []
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for dt in dtypes:
        for prec in precisions if dt == "fp32" else ("tf32",):
            for shape in shapes or list(SHAPES):
                for ffn in ffns:
                    for scen in scenarios or list(SCENARIOS):
                        launches = []
                        for fused in (False, True):  # both backward designs (act_dx is opt-in)
                            with cuda_matmul_tf32_set(prec == "tf32"):
                                launches += record(SHAPES[shape], tdt[dt], ffn, scen, fused)
                        for launch in launches:
                            tiles = CONFIGS[launch.kernel][dt] if launch.kernel in CONFIGS else [None]
                            for tile in tiles:
                                key = _key(launch, tile)
                                if key in seen:
                                    continue
                                seen.add(key)
                                out.append(compile_launch(launch, tile, arch))
                                if progress:
                                    progress(out[-1])
    return out


def as_dicts(reports: list[KernelReport]) -> list[dict[str, Any]]:
    return [asdict(r) for r in reports]


def summary(reports: list[KernelReport]) -> list[dict[str, Any]]:
    """Per kernel x dtype x precision: candidate configs, compiles (x variants and specialisations), the largest
    shared memory (KiB) and register count, the spilled bytes, and whether every compile pipelines its
    loads / uses wgmma."""
    groups: dict[tuple, list[KernelReport]] = {}
    for r in reports:
        groups.setdefault((r.kernel, r.dtype, r.precision), []).append(r)
    return [{"kernel": k, "dtype": d, "precision": p, "configs": len({r.tile for r in rs}), "compiles": len(rs),
             "max_smem_kib": round(max(r.smem for r in rs) / 1024), "max_registers": max(r.registers for r in rs),
             "spill_bytes": sum(r.local_bytes for r in rs), "pipelined": all(r.pipelined for r in rs),
             "wgmma": all(r.wgmma for r in rs)} for (k, d, p), rs in sorted(groups.items())]


def format_report(reports: list[KernelReport]) -> str:
    """One markdown row per kernel x config: shared memory (and its prediction), registers, spills, flags."""
    rows = sorted({(r.kernel, r.dtype, r.precision, r.tile): r for r in reports}.values(),
                  key=lambda r: (r.kernel, r.dtype, r.precision, r.tile))
    worst: dict[tuple, KernelReport] = {}
    for r in reports:  # per kernel x config: the variant that uses the most shared memory / registers
        k = (r.kernel, r.dtype, r.precision, r.tile)
        if k not in worst or (r.smem, r.registers) > (worst[k].smem, worst[k].registers):
            worst[k] = r
    head = "| kernel | dtype | prec | config | smem KiB (predicted) | regs | spill B | cp.async | wgmma |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = worst[(r.kernel, r.dtype, r.precision, r.tile)]
        lines.append(f"| {w.kernel} | {w.dtype} | {w.precision} | {w.tile} | {w.smem / 1024:.0f} "
                     f"({w.smem_predicted / 1024:.0f}) | {w.registers} | {w.local_bytes} | "
                     f"{'yes' if w.pipelined else 'NO'} | {'yes' if w.wgmma else 'no'} |")
    return "\n".join(lines)
