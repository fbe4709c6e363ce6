// The CPU expert loop of the fused MoE path in C++: every expert's GEMMs (ATen's, so oneDNN / MKL as in
// Python) with the SwiGLU / ReLU element-wise work fused into one vectorised pass per direction, experts
// spread over the intra-op threads (whole experts per thread, each GEMM single-threaded), no Python between
// the kernels. Registered as torch.ops.mhmoe_cpu.{expert_forward, expert_backward}; the Python path
// (mhmoe/moe/dispatch/fused.py) is the same computation op for op and the reference the tests hold it to.
// With `small` (bf16 experts with small weight matrices, decided in Python: native.small_gemm) the GEMMs run
// on oneDNN's brgemm micro-kernel with the right operand packed here (SmallGemm below) instead of at::mm.
//
// Shape legend: R rows of the expert-grouped buffer (expert e owns rows [starts[e], starts[e] + sizes[e])),
// D expert width, F expert hidden width, E experts, C rows of one expert.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "swiglu.h"
#include "vec_io.h"
#if defined(__AVX512BW__)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#define MHMOE_BRGEMM 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

using at::Tensor;
using fVec = at::vec::Vectorized<float>;
using mhmoe_native::load2;
using mhmoe_native::store2;
using mhmoe_native::swiglu_backward;
using mhmoe_native::swiglu_forward;

#ifdef MHMOE_BRGEMM
// bf16 GEMMs of one expert on oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm, fp32 accumulation in a
// scratch block), the right operand packed here into the micro-kernel's pair-interleaved layout [K/2][N][2].
// For the small experts of the tiny presets at::mm's fixed cost per call (primitive lookup, its own packing)
// is a large part of each GEMM (docs/PERFORMANCE.md). Outputs and input gradients come out bit-identical to
// at::mm's in the tests; the weight gradients (sums over an expert's rows, which at::mm may order differently)
// within one bf16 rounding step (about 1 element in 10^5 differs in its last bit).
struct SmallGemm {
  // rows k, k + 1 of src [K, N] (row stride ld) -> p [K/2][N][2]; N a multiple of 32
  static void pack_rows(const at::BFloat16* src, int64_t ld, int64_t K, int64_t N, at::BFloat16* p) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                        22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
    for (int64_t k = 0; k < K; k += 2) {
      const at::BFloat16* r0 = src + k * ld;
      at::BFloat16* o = p + k * N;
      for (int64_t n = 0; n < N; n += 32) {
        __m512i a = _mm512_loadu_si512(r0 + n), b = _mm512_loadu_si512(r0 + ld + n);
        _mm512_storeu_si512(o + 2 * n, _mm512_permutex2var_epi16(a, lo, b));
        _mm512_storeu_si512(o + 2 * n + 32, _mm512_permutex2var_epi16(a, hi, b));
      }
    }
  }
  // the transpose of src [N, K] (row stride ld, even): p[k/2][n] as 32-bit pairs = src[n][k], src[n][k + 1]
  static void pack_transposed(const at::BFloat16* src, int64_t ld, int64_t K, int64_t N, at::BFloat16* p) {
    const auto* s32 = reinterpret_cast<const int32_t*>(src);
    auto* p32 = reinterpret_cast<int32_t*>(p);
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(ld / 2)));
    for (int64_t n = 0; n < N; n += 16)
      for (int64_t kk = 0; kk < K / 2; ++kk)
        _mm512_storeu_si512(p32 + kk * N + n, _mm512_i32gather_epi32(rows, s32 + n * (ld / 2) + kk, 4));
  }
  // whether out [M, N] = a [M, K] · b runs here: bf16, b row-major or the transpose of a row-major matrix whose
  // element pairs are 4-byte aligned (even row stride and offset), K even, N a multiple of 32, out contiguous
  static bool fits(const Tensor& out, const Tensor& a, const Tensor& b) {
    const int64_t K = a.size(1), N = b.size(1);
    const bool rows = b.stride(1) == 1;
    const bool pairs = b.stride(0) == 1 && b.stride(1) % 2 == 0 &&
                       reinterpret_cast<uintptr_t>(b.const_data_ptr()) % 4 == 0;
    return a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16 && (rows || pairs) && K % 2 == 0 &&
           N % 32 == 0 && out.is_contiguous() && K > 0 && a.size(0) > 0;
  }
  // out = a · b, or with add out = a · b + out (rounded once, as addmm_); a transposed view's rows are copied out
  static void run(Tensor& out, const Tensor& a_in, const Tensor& b, bool add) {
    const Tensor a = a_in.stride(1) == 1 ? a_in : a_in.contiguous();
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
    // per-thread scratch, grown as needed (never zero-filled: every element is written before it is read)
    thread_local std::vector<at::BFloat16> packed;
    thread_local std::vector<float> acc;
    if ((int64_t)packed.size() < K * N) packed.resize(K * N);
    if ((int64_t)acc.size() < M * N) acc.resize(M * N);
    if (b.stride(1) == 1)
      pack_rows(b.const_data_ptr<at::BFloat16>(), b.stride(0), K, N, packed.data());
    else
      pack_transposed(b.const_data_ptr<at::BFloat16>(), b.stride(1), K, N, packed.data());
    at::native::cpublas::brgemm(M, N, K, a.stride(0), N, N, false, a.const_data_ptr<at::BFloat16>(), packed.data(),
                                acc.data(), true);
    auto* o = out.mutable_data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * N; i += 2 * fVec::size()) {
      fVec x, y;
      load2(acc.data() + i, x, y);
      if (add) {
        fVec u, v;
        load2(o + i, u, v);
        x = x + u;
        y = y + v;
      }
      store2(o + i, x, y);
    }
  }
};
#endif

// out = a · b (add: out += a · b): on the brgemm micro-kernel with `small` where SmallGemm fits, else ATen's.
void matmul(Tensor out, const Tensor& a, const Tensor& b, bool add, bool small) {
#ifdef MHMOE_BRGEMM
  if (small && SmallGemm::fits(out, a, b)) {
    SmallGemm::run(out, a, b, add);
    return;
  }
#endif
  if (add)
    out.addmm_(a, b);
  else
    at::mm_out(out, a, b);
}

// Release the micro-kernel's hardware state (AMX tiles) on this thread after a lane of experts.
void release_small_gemm(bool small) {
#ifdef MHMOE_BRGEMM
  if (small) at::native::cpublas::brgemm_release(true);
#endif
}

// Whole experts per lane, longest first onto the least-loaded lane (blocks of one expert stay on one thread,
// so nothing races); with one lane the experts run in order and every GEMM uses all intra-op threads.
std::vector<std::vector<int64_t>> lanes_of(const std::vector<int64_t>& sizes, int64_t threads) {
  std::vector<int64_t> order;
  for (int64_t e = 0; e < (int64_t)sizes.size(); ++e)
    if (sizes[e] > 0) order.push_back(e);
  threads = std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)order.size()));
  std::vector<std::vector<int64_t>> lanes(threads);
  if (threads == 1) {
    lanes[0] = order;
    return lanes;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sizes[a] > sizes[b]; });
  std::vector<int64_t> load(threads, 0);
  for (int64_t e : order) {
    auto i = std::min_element(load.begin(), load.end()) - load.begin();
    lanes[i].push_back(e);
    load[i] += sizes[e];
  }
  return lanes;
}

// f(T{}) with T the C++ type of a float32 or bfloat16 tensor (the dtypes the fused path runs natively).
template <typename F>
void dispatch_dtype(at::ScalarType t, const F& f) {
  if (t == at::kFloat) {
    f(float{});
  } else {
    TORCH_CHECK(t == at::kBFloat16, "mhmoe_cpu: float32 or bfloat16 rows only, got ", t);
    f(at::BFloat16{});
  }
}

// work(e, lane) for every expert of every lane: lanes in parallel over the intra-op threads, the experts of a lane
// in order on one thread.
template <typename F>
void run_lanes(const std::vector<std::vector<int64_t>>& lanes, bool small, const F& work) {
  if (lanes.size() == 1) {
    for (int64_t e : lanes[0]) work(e, 0);
    release_small_gemm(small);
    return;
  }
  at::parallel_for(0, (int64_t)lanes.size(), 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    for (int64_t l = begin; l < end; ++l)
      for (int64_t e : lanes[l]) work(e, l);
    release_small_gemm(small);
  });
}

// `count` scratch blocks [rows, F] per lane (rows: the lane's largest expert) for the per-expert [C, F] temporaries,
// allocated here, in the calling thread. Allocated per expert inside the intra-op threads, the temporaries of thin,
// wide experts (hundreds of MB each) came from glibc's per-thread arenas, which unmap such blocks when freed:
// every call page-faulted them again, even with MHMOE_MALLOC=tuned (docs/PERFORMANCE.md, "Thin experts").
std::vector<std::vector<Tensor>> lane_scratch(const std::vector<std::vector<int64_t>>& lanes,
                                              const std::vector<int64_t>& sizes, int64_t count, int64_t F,
                                              const at::TensorOptions& options) {
  std::vector<std::vector<Tensor>> out(lanes.size());
  for (size_t l = 0; l < lanes.size(); ++l) {
    int64_t rows = 0;
    for (int64_t e : lanes[l]) rows = std::max(rows, sizes[e]);
    for (int64_t i = 0; i < count; ++i) out[l].push_back(at::empty({rows, F}, options));
  }
  return out;
}

// The shapes every op relies on (the fused passes index raw pointers): xs [R, D] contiguous, w1 (and w3) [E, D, F],
// w2 [E, F, D], every expert block inside [0, R).
void check_shapes(const Tensor& xs, const Tensor& w1, const Tensor& w2, const std::optional<Tensor>& w3,
                  const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(xs.dim() == 2 && xs.is_contiguous(), "xs must be a contiguous [R, D] tensor");
  const int64_t R = xs.size(0), D = xs.size(1), E = w1.size(0), F = w1.size(2);
  TORCH_CHECK(w1.dim() == 3 && w1.size(1) == D && w2.sizes() == at::IntArrayRef({E, F, D}), "w1/w2 shapes");
  TORCH_CHECK(!w3 || w3->sizes() == w1.sizes(), "w3 must have w1's shape");
  TORCH_CHECK((int64_t)starts.size() == E && (int64_t)sizes.size() == E, "starts/sizes need one entry per expert");
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(starts[e] >= 0 && sizes[e] >= 0 && starts[e] + sizes[e] <= R, "expert block out of range");
}

// The hidden pre-activations: h1 (and h3 exactly with w3) contiguous [R, F].
void check_hidden(const Tensor& xs, const Tensor& w1, const std::optional<Tensor>& w3, const Tensor& h1,
                  const std::optional<Tensor>& h3) {
  const std::vector<int64_t> shape{xs.size(0), w1.size(2)};
  TORCH_CHECK(h1.is_contiguous() && h1.sizes() == shape, "h1 must be a contiguous [R, F] tensor");
  TORCH_CHECK(w3.has_value() == h3.has_value() && (!h3 || (h3->is_contiguous() && h3->sizes() == shape)),
              "h3 must be given with w3, a contiguous [R, F] tensor");
}

// Forward of every expert block: h1 = xs W1 (and h3 = xs W3 for SwiGLU), ys = act(h1[, h3]) W2. xs [R, D]; w1, w3
// [E, D, F]; w2 [E, F, D]; ys [R, D] written. h1, h3 [R, F]: written when given (kept for the backward); without
// them (forward-only calls) every expert's pre-activations live in blocks of its own, freed after its GEMMs.
void expert_forward(const Tensor& xs, const Tensor& w1, const Tensor& w2, const std::optional<Tensor>& w3,
                    std::optional<Tensor> h1, std::optional<Tensor> h3, Tensor ys, std::vector<int64_t> starts,
                    std::vector<int64_t> sizes, int64_t threads, bool small) {
  const bool glu = w3.has_value(), keep = h1.has_value();
  const int64_t F = w1.size(2);
  check_shapes(xs, w1, w2, w3, starts, sizes);
  if (keep) check_hidden(xs, w1, w3, *h1, h3);
  TORCH_CHECK(keep || !h3, "h3 is kept only with h1");
  TORCH_CHECK(ys.is_contiguous() && ys.sizes() == xs.sizes(), "ys must be a contiguous [R, D] tensor");
  const auto lanes = lanes_of(sizes, threads);
  // act (kept hidden buffers), or a1 and a3 (forward-only; act over a3)
  auto scratch = lane_scratch(lanes, sizes, keep ? 1 : (glu ? 2 : 1), F, xs.options());
  dispatch_dtype(xs.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    run_lanes(lanes, small, [&](int64_t e, int64_t lane) {
      const int64_t r0 = starts[e], C = sizes[e];
      const auto& own = scratch[lane];
      Tensor x = xs.narrow(0, r0, C);
      Tensor a1 = keep ? h1->narrow(0, r0, C) : own[0].narrow(0, 0, C);
      matmul(a1, x, w1[e], false, small);
      Tensor act;
      if (glu) {
        Tensor a3 = keep ? h3->narrow(0, r0, C) : own[1].narrow(0, 0, C);
        matmul(a3, x, (*w3)[e], false, small);
        act = keep ? own[0].narrow(0, 0, C) : a3;  // without buffers to keep, over h3 (read before written)
        RECORD_FUNCTION("mhmoe::swiglu_forward", std::vector<c10::IValue>());
        swiglu_forward<scalar_t>(a1.const_data_ptr<scalar_t>(), a3.const_data_ptr<scalar_t>(),
                                 act.mutable_data_ptr<scalar_t>(), a1.numel());
      } else {
        act = keep ? own[0].narrow(0, 0, C) : a1;
        at::clamp_min_out(act, a1, 0);  // at::relu (over a1 without buffers to keep)
      }
      Tensor y = ys.narrow(0, r0, C);
      matmul(y, act, w2[e], false, small);
    });
  });
}

// Backward of expert_forward from the rows' output gradients dy [R, D]: returns the weight gradients
// {gw1, gw2, gw3} ({gw1, gw2} for ReLU) and writes the rows' input gradients into dxs [R, D] when given.
// In bf16 the left operand of the W1/W3 weight gradients is a contiguous transposed copy of the rows:
// oneDNN's bf16 GEMM with a transposed left operand ran at about half speed.
std::vector<Tensor> expert_backward(const Tensor& xs, const Tensor& h1, const std::optional<Tensor>& h3,
                                    const Tensor& dy, const Tensor& w1, const Tensor& w2,
                                    const std::optional<Tensor>& w3, std::optional<Tensor> dxs,
                                    std::vector<int64_t> starts, std::vector<int64_t> sizes, int64_t threads,
                                    bool small) {
  const int64_t E = w1.size(0);
  check_shapes(xs, w1, w2, w3, starts, sizes);
  check_hidden(xs, w1, w3, h1, h3);
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == xs.sizes(), "dy must be a contiguous [R, D] tensor");
  TORCH_CHECK(!dxs || (dxs->is_contiguous() && dxs->sizes() == xs.sizes()), "dxs must be a contiguous [R, D] tensor");
  const bool glu = w3.has_value();
  const bool transpose_x = xs.scalar_type() == at::kBFloat16;
  Tensor gw1 = at::empty_like(w1), gw2 = at::empty_like(w2);
  Tensor gw3 = glu ? at::empty_like(*w3) : Tensor();
  for (int64_t e = 0; e < E; ++e) {
    if (sizes[e] == 0) {
      gw1[e].zero_();
      gw2[e].zero_();
      if (glu) gw3[e].zero_();
    }
  }
  const auto lanes = lanes_of(sizes, threads);
  auto scratch = lane_scratch(lanes, sizes, glu ? 3 : 2, w1.size(2), xs.options());  // da, act (, dh3)
  dispatch_dtype(xs.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    run_lanes(lanes, small, [&](int64_t e, int64_t lane) {
      const int64_t r0 = starts[e], C = sizes[e];
      const auto& own = scratch[lane];
      Tensor x = xs.narrow(0, r0, C), g = dy.narrow(0, r0, C), a1 = h1.narrow(0, r0, C);
      Tensor da = own[0].narrow(0, 0, C), act = own[1].narrow(0, 0, C);  // [C, F]; da becomes dh1
      matmul(da, g, w2[e].t(), false, small);
      Tensor xt = transpose_x ? x.t().contiguous() : x.t();
      Tensor gw1e = gw1[e], gw2e = gw2[e];
      if (glu) {
        Tensor a3 = h3->narrow(0, r0, C), dh3 = own[2].narrow(0, 0, C);
        {
          RECORD_FUNCTION("mhmoe::swiglu_backward", std::vector<c10::IValue>());
          swiglu_backward<scalar_t>(a1.const_data_ptr<scalar_t>(), a3.const_data_ptr<scalar_t>(),
                                    da.mutable_data_ptr<scalar_t>(), act.mutable_data_ptr<scalar_t>(),
                                    dh3.mutable_data_ptr<scalar_t>(), da.numel());
        }
        Tensor gw3e = gw3[e];
        {
          RECORD_FUNCTION("mhmoe::wgrad", std::vector<c10::IValue>());  // a profiler label (benchmarks/moe_profile.py)
          matmul(gw2e, act.t(), g, false, small);
          matmul(gw3e, xt, dh3, false, small);
        }
        if (dxs) {
          Tensor dx = dxs->narrow(0, r0, C);
          matmul(dx, dh3, (*w3)[e].t(), false, small);
          matmul(dx, da, w1[e].t(), true, small);
        }
      } else {
        at::clamp_min_out(act, a1, 0);  // at::relu
        {
          RECORD_FUNCTION("mhmoe::wgrad", std::vector<c10::IValue>());
          matmul(gw2e, act.t(), g, false, small);
        }
        at::threshold_backward_out(da, da, a1, 0);
        if (dxs) {
          Tensor dx = dxs->narrow(0, r0, C);
          matmul(dx, da, w1[e].t(), false, small);
        }
      }
      RECORD_FUNCTION("mhmoe::wgrad", std::vector<c10::IValue>());
      matmul(gw1e, xt, da, false, small);
    });
  });
  if (glu) return {gw1, gw2, gw3};
  return {gw1, gw2};
}

}  // namespace

TORCH_LIBRARY(mhmoe_cpu, m) {
  m.def("expert_forward(Tensor xs, Tensor w1, Tensor w2, Tensor? w3, Tensor(a!)? h1, Tensor(b!)? h3, Tensor(c!) ys, "
        "int[] starts, int[] sizes, int threads, bool small=False) -> ()");
  m.def("expert_backward(Tensor xs, Tensor h1, Tensor? h3, Tensor dy, Tensor w1, Tensor w2, Tensor? w3, "
        "Tensor(a!)? dxs, int[] starts, int[] sizes, int threads, bool small=False) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("expert_forward", &expert_forward);
  m.impl("expert_backward", &expert_backward);
}
