"""benchmarks/moe_profile.py: which profiled events count, and into which bucket they go."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def moe_profile():
    spec = importlib.util.spec_from_file_location("moe_profile", ROOT / "benchmarks" / "moe_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _event(name, shapes=()):
    return SimpleNamespace(name=name, input_shapes=list(shapes), id=0)


def test_the_cpp_loops_elementwise_passes_count(moe_profile):
    """The C++ loop's SwiGLU passes are labels with no ATen op inside: their self time is real work."""
    for name in ("mhmoe::swiglu_forward", "mhmoe::swiglu_backward"):
        assert moe_profile.counted(name, 120.0)
        assert moe_profile.classify(_event(name), ["mhmoe_cpu::expert_backward"], {}) == "elementwise"
    assert moe_profile.counted("aten::mm", 5.0)


def test_wrapping_labels_and_empty_events_do_not_count(moe_profile):
    for name in ("mhmoe::wgrad", "mhmoe::router", "mhmoe::cand::layer"):
        assert not moe_profile.counted(name, 50.0)
    assert not moe_profile.counted("aten::mm", 0.0)


def test_router_gemm_and_expert_gemm_buckets(moe_profile):
    dims = {"d_model": 768, "d_in": 256, "d_hidden": 512, "experts": 96, "tokens": 2048, "heads": 3}
    router = _event("aten::mm", [[6144, 256], [256, 96]])
    expert = _event("aten::mm", [[192, 256], [256, 512]])
    assert moe_profile.classify(router, [], dims) == "router"
    assert moe_profile.classify(expert, [], dims) == "experts fwd"
    assert moe_profile.classify(expert, ["MmBackward0"], dims) == "experts dgrad"
    assert moe_profile.classify(expert, ["mhmoe::wgrad"], dims) == "experts wgrad"


@pytest.mark.parametrize("label", ["mhmoe::dot_gemm", "mhmoe::amx_gemm"])
def test_the_cpp_loops_own_gemms_count_by_pass(moe_profile, label):
    """The C++ loop's own bf16 GEMMs (the dot-product kernel, AMX tiles) are labels whose self time counts: forward,
    input-side backward, or (inside the loop's weight-gradient label) weight gradients."""
    gemm = _event(label)
    assert moe_profile.counted(gemm.name, 300.0)
    assert moe_profile.classify(gemm, ["mhmoe_cpu::expert_forward", "_FusedMoE"], {}) == "experts fwd"
    assert moe_profile.classify(gemm, ["mhmoe_cpu::expert_backward", "_FusedMoEBackward"], {}) == "experts dgrad"
    assert moe_profile.classify(gemm, ["mhmoe::wgrad", "mhmoe_cpu::expert_backward"], {}) == "experts wgrad"
