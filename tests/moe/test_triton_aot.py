"""The Triton kernels' resources on an H100, checked without a GPU: every kernel x candidate config x dtype
that the op launches (and the fused router's three kernels) is compiled for sm_90a with the launch's real
argument specialisation, and must fit (shared memory <= 227 KiB, no register spills, pipelined cp.async
loads, wgmma in bf16 and TF32).

CI compiles a representative subset (``benchmarks/triton_moe.py --aot --quick``: the mh3 expert shape,
SwiGLU, training and inference launches, both backward designs, every candidate config of every
kernel, bf16 and fp32 in both precisions; about a minute on 2 cores, cached across runs in pytest's
cache directory); ``--aot`` without ``--quick`` compiles the full matrix (all parity shapes, an
unaligned one, ReLU, frozen-parameter backwards). Skipped where the installed triton cannot target
sm_90a. The predicted shared memory that prunes configs on smaller GPUs is checked against the compiles.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mhmoe.moe.dispatch.triton.tiles import (
    CONFIGS,
    H100_SMEM,
    INTERP,
    KERNELS,
    ROW_KERNELS,
    Tile,
    block_m,
    fits,
    smem_bytes,
)

ROOT = Path(__file__).resolve().parents[2]


def test_candidate_tables_are_consistent():
    """One row-tile size per row kernel and dtype (the tile table is built for it); every candidate's
    predicted shared memory fits an H100; PART divides every act_bwd BN; the interpreter config exists."""
    for kernel in KERNELS:
        assert kernel in INTERP
        for dt, tiles in CONFIGS[kernel].items():
            assert tiles and len(set(tiles)) == len(tiles), (kernel, dt)
            if kernel in ROW_KERNELS:
                block_m(kernel, dt)  # raises if a row kernel mixes BMs
            for t in tiles:
                item = 2 if dt == "bf16" else 4
                assert fits(kernel, t, item, H100_SMEM, gated=True, d=256), (kernel, dt, t)
    assert all(t.bn % 64 == 0 for dt in CONFIGS["act_bwd"].values() for t in dt)


def test_pruning_by_predicted_shared_memory():
    """On a GPU with less shared memory the autotuner drops the configs predicted to exceed it."""
    t_small, t_big = Tile(128, 64, 32, 8, 2), Tile(128, 128, 64, 8, 4)
    assert smem_bytes("up_fwd", t_small, 2) == 2 * (128 * 32 + 2 * 32 * 64) * 2
    assert smem_bytes("up_fwd", t_small, 2, gated=False) < smem_bytes("up_fwd", t_small, 2)
    assert fits("up_fwd", t_small, 2, 99 * 1024) and not fits("up_fwd", t_big, 2, 99 * 1024)
    assert smem_bytes("up_fwd", t_big, 4) == 2 * smem_bytes("up_fwd", t_big, 2)
    with pytest.raises(ValueError, match="unknown kernel"):
        smem_bytes("nope", t_small, 2)


def _can_target_sm90() -> str | None:
    """None if the installed triton can compile for sm_90a here, else why not."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as e:
        return f"triton without the pieces the compile report uses ({e})"
    if not hasattr(JITFunction, "_pack_args"):
        return f"triton {triton.__version__} has no JITFunction._pack_args (the launch binder the report reuses)"
    try:
        make_backend(GPUTarget("cuda", 90, 32))
    except Exception as e:  # noqa: BLE001 - any backend failure means: cannot target sm_90a here
        return f"triton {triton.__version__} cannot target sm_90a here: {e}"
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return f"triton {triton.__version__} ships no ptxas"
    return None


@pytest.fixture(scope="module")
def report(request, tmp_path_factory):
    why = _can_target_sm90()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cache = getattr(request.config, "cache", None)  # compiles reused across runs (absent: -p no:cacheprovider)
    env["TRITON_CACHE_DIR"] = str(cache.mkdir("triton-aot-cache") if cache else tmp_path_factory.mktemp("triton"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_moe.py"), "--aot", "--quick", "--check",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert proc.returncode == 0, "\n".join(data["problems"]) or proc.stderr[-4000:]
    return data


def test_every_kernel_and_config_is_compiled(report):
    compiled = {(c["kernel"], c["dtype"], c["tile"]) for c in report["compiles"]}
    routers = {(c["kernel"], c["dtype"]) for c in report["compiles"] if c["kernel"].startswith("router")}
    assert routers == {(k, dt) for k in ("router_fwd", "router_bwd", "router_wgrad") for dt in ("bf16", "fp32")}
    for kernel in KERNELS:
        for dt, tiles in CONFIGS[kernel].items():
            for t in tiles:
                assert (kernel, dt, f"{t.bm}x{t.bn}x{t.bk} w{t.warps} s{t.stages}") in compiled, (kernel, dt, t)
    assert {c["precision"] for c in report["compiles"] if c["dtype"] == "fp32"} >= {"ieee", "tf32"}


def test_every_compile_fits_an_h100(report):
    assert report["problems"] == []
    for c in report["compiles"]:
        name = f"{c['kernel']} {c['dtype']} {c['precision']} [{c['variant']}] {c['tile']}"
        assert c["smem"] <= H100_SMEM and c["local_bytes"] == 0, name
        if c["kernel"] == "ksum" or (c["kernel"] == "router_bwd" and "NEED_DX=0" in c["variant"]):
            continue  # no loop, no MMA
        assert c["pipelined"], name  # aligned widths: cp.async software pipelining
        # ieee fp32: FMA; the fused router ("split"): bf16 MMAs whatever its input
        assert c["wgmma"] == (c["dtype"] == "bf16" or c["precision"] in ("tf32", "split")), name
        # the prediction that prunes configs on smaller GPUs never under-estimates, and is not far off
        assert c["smem"] <= c["smem_predicted"] <= 3 * c["smem"] + 16 * 1024, name
