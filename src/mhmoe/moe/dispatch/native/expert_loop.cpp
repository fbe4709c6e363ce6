// The CPU expert loop of the fused MoE path in C++: every expert's GEMMs (ATen's, so oneDNN / MKL as in
// Python) with the SwiGLU / ReLU element-wise work fused into one vectorised pass per direction, experts
// spread over the intra-op threads (whole experts per thread, each GEMM single-threaded), no Python between
// the kernels. Registered as torch.ops.mhmoe_cpu.{expert_forward, expert_backward}; the Python path
// (mhmoe/moe/dispatch/fused.py) is the same computation op for op and the reference the tests hold it to.
// With `gemm` = kDot (bf16 experts on CPUs with AVX-512 BF16 and no AMX, decided in Python: native.dot_gemm) the
// GEMMs run on the dot-product kernel of dot_gemm.h instead of at::mm; with kAmx (bf16 experts on CPUs with AMX,
// native.expert_gemm) on the AMX tiles of amx_gemm.h (one expert GEMM on each back end: expert_gemm.h). Under
// bf16 autocast the weights may stay fp32 for bf16 rows: each expert's matrices are rounded to bf16 (as Tensor.to
// does) as they are used (the own kernels while packing them, ATen's GEMMs on a cast of the matrix), and every fp32
// weight gradient is the bf16 product widened (matmul): the numbers of casting the weights first
// (tests/moe/test_native_fp32_weights.py).
//
// Shape legend: R rows of the expert-grouped buffer (expert e owns rows [starts[e], starts[e] + sizes[e])),
// D expert width, F expert hidden width, E experts, C rows of one expert.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "expert_gemm.h"
#include "swiglu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;
using mhmoe_native::fused_glu_up;
using mhmoe_native::kAten;
using mhmoe_native::kStreamOutputBytes;
using mhmoe_native::matmul;
using mhmoe_native::swiglu_backward;
using mhmoe_native::swiglu_forward;

// The non-empty experts, longest first, and the lanes (threads) that run them: each lane takes the next expert of
// `order` when it finishes one, so the lanes finish within about the last (shortest) expert of each other whatever
// each expert costs (a static split by row counts left one thread waiting for the other in the backward, ~8 ms of
// the d=768 h=3 layer's bf16 step on 2 threads; the four d=768 layers 1.00-1.02x as fast, one round-robin A/B).
// With one lane the experts run in order and every GEMM uses all intra-op threads. An expert's numbers do not
// depend on its lane.
struct Schedule {
  std::vector<int64_t> order;
  int64_t lanes = 1;
};

Schedule schedule_of(const std::vector<int64_t>& sizes, int64_t threads) {
  Schedule s;
  for (int64_t e = 0; e < (int64_t)sizes.size(); ++e)
    if (sizes[e] > 0) s.order.push_back(e);
  s.lanes = std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)s.order.size()));
  if (s.lanes > 1)
    std::stable_sort(s.order.begin(), s.order.end(), [&](int64_t a, int64_t b) { return sizes[a] > sizes[b]; });
  return s;
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

// work(e, lane, after) for every expert of the schedule, lanes in parallel over the intra-op threads; `after` is
// the expert the lane most likely runs next (its weights are prefetched during this one's GEMMs), or -1.
template <typename F>
void run_lanes(const Schedule& s, const F& work) {
  const int64_t n = (int64_t)s.order.size();
  const auto after = [&](int64_t i) { return i + s.lanes < n ? s.order[i + s.lanes] : int64_t{-1}; };
  if (s.lanes == 1) {
    for (int64_t i = 0; i < n; ++i) work(s.order[i], 0, after(i));
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, s.lanes, 1, [&](int64_t begin, int64_t end) {
    at::NoGradGuard no_grad;
    for (int64_t l = begin; l < end; ++l)
      for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(s.order[i], l, after(i));
  });
}

// `count` scratch blocks [rows, F] per lane (rows: the largest expert's, which any lane may take) for the
// per-expert [C, F] temporaries, allocated here, in the calling thread. Allocated per expert inside the intra-op
// threads, the temporaries of thin, wide experts (hundreds of MB each) came from glibc's per-thread arenas, which
// unmap such blocks when freed: every call page-faulted them again, even with MHMOE_MALLOC=tuned
// (docs/PERFORMANCE.md, "Thin experts").
std::vector<std::vector<Tensor>> lane_scratch(const Schedule& s, const std::vector<int64_t>& sizes, int64_t count,
                                              int64_t F, const at::TensorOptions& options) {
  int64_t rows = 0;
  for (int64_t e : s.order) rows = std::max(rows, sizes[e]);
  std::vector<std::vector<Tensor>> out(s.lanes);
  for (auto& lane : out)
    for (int64_t i = 0; i < count; ++i) lane.push_back(at::empty({rows, F}, options));
  return out;
}

// The shapes every op relies on (the fused passes index raw pointers): xs [R, D] contiguous, w1 (and w3) [E, D, F],
// w2 [E, F, D], every expert block inside [0, R).
void check_shapes(const Tensor& xs, const Tensor& w1, const Tensor& w2, const std::optional<Tensor>& w3,
                  const std::vector<int64_t>& starts, const std::vector<int64_t>& sizes) {
  TORCH_CHECK(xs.dim() == 2 && xs.is_contiguous(), "xs must be a contiguous [R, D] tensor");
  const int64_t R = xs.size(0), D = xs.size(1), E = w1.size(0), F = w1.size(2);
  const auto wt = w1.scalar_type();
  TORCH_CHECK(wt == xs.scalar_type() || (xs.scalar_type() == at::kBFloat16 && wt == at::kFloat),
              "w1/w2/w3 must have the rows' dtype (or float32 for bfloat16 rows: bf16 autocast)");
  TORCH_CHECK(w2.scalar_type() == wt && (!w3 || w3->scalar_type() == wt), "w1, w2 and w3 must share a dtype");
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
                    std::vector<int64_t> sizes, int64_t threads, int64_t gemm) {
  const bool glu = w3.has_value(), keep = h1.has_value();
  const int64_t F = w1.size(2);
  check_shapes(xs, w1, w2, w3, starts, sizes);
  if (keep) check_hidden(xs, w1, w3, *h1, h3);
  TORCH_CHECK(keep || !h3, "h3 is kept only with h1");
  TORCH_CHECK(ys.is_contiguous() && ys.sizes() == xs.sizes(), "ys must be a contiguous [R, D] tensor");
  // the rows' outputs, read again only by the combine after every expert, written past the cache (the own kernels)
  // where they outgrow the cache anyway: a write through it first reads every line it writes
  const bool stream_ys = ys.numel() * ys.element_size() >= kStreamOutputBytes;
  const auto schedule = schedule_of(sizes, threads);
  // act (kept hidden buffers), or a1 and a3 (forward-only; act over a3)
  auto scratch = lane_scratch(schedule, sizes, keep ? 1 : (glu ? 2 : 1), F, xs.options());
  dispatch_dtype(xs.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    run_lanes(schedule, [&](int64_t e, int64_t lane, int64_t after) {
      const int64_t r0 = starts[e], C = sizes[e];
      const auto& own = scratch[lane];
      Tensor x = xs.narrow(0, r0, C);
      Tensor a1 = keep ? h1->narrow(0, r0, C) : own[0].narrow(0, 0, C);
      Tensor act;
      if (glu) {
        Tensor a3 = keep ? h3->narrow(0, r0, C) : own[1].narrow(0, 0, C);
        act = keep ? own[0].narrow(0, 0, C) : a3;  // without buffers to keep, over h3 (read before written)
        if (!fused_glu_up(a1, a3, act, x, w1[e], (*w3)[e], w2[e], keep, gemm)) {
          matmul(a1, x, w1[e], false, gemm, (*w3)[e]);
          matmul(a3, x, (*w3)[e], false, gemm, w2[e]);
          RECORD_FUNCTION("mhmoe::swiglu_forward", std::vector<c10::IValue>());
          swiglu_forward<scalar_t>(a1.const_data_ptr<scalar_t>(), a3.const_data_ptr<scalar_t>(),
                                   act.mutable_data_ptr<scalar_t>(), a1.numel());
        }
      } else {
        matmul(a1, x, w1[e], false, gemm, w2[e]);
        act = keep ? own[0].narrow(0, 0, C) : a1;
        at::clamp_min_out(act, a1, 0);  // at::relu (over a1 without buffers to keep)
      }
      Tensor y = ys.narrow(0, r0, C);
      matmul(y, act, w2[e], false, gemm, after < 0 ? Tensor() : w1[after], stream_ys);
    });
  });
}

// Backward of expert_forward from the rows' output gradients dy [R, D]: returns the weight gradients
// {gw1, gw2, gw3} ({gw1, gw2} for ReLU) and writes the rows' input gradients into dxs [R, D] when given.
// In bf16 on at::mm the left operand of the W1/W3 weight gradients is a contiguous transposed copy of the rows:
// oneDNN's bf16 GEMM with a transposed left operand ran at about half speed (the own kernel packs them itself).
std::vector<Tensor> expert_backward(const Tensor& xs, const Tensor& h1, const std::optional<Tensor>& h3,
                                    const Tensor& dy, const Tensor& w1, const Tensor& w2,
                                    const std::optional<Tensor>& w3, std::optional<Tensor> dxs,
                                    std::vector<int64_t> starts, std::vector<int64_t> sizes, int64_t threads,
                                    int64_t gemm) {
  const int64_t E = w1.size(0);
  check_shapes(xs, w1, w2, w3, starts, sizes);
  check_hidden(xs, w1, w3, h1, h3);
  TORCH_CHECK(dy.is_contiguous() && dy.sizes() == xs.sizes(), "dy must be a contiguous [R, D] tensor");
  TORCH_CHECK(!dxs || (dxs->is_contiguous() && dxs->sizes() == xs.sizes()), "dxs must be a contiguous [R, D] tensor");
  const bool glu = w3.has_value();
  const bool transpose_x = xs.scalar_type() == at::kBFloat16 && gemm == kAten;
  Tensor gw1 = at::empty_like(w1), gw2 = at::empty_like(w2);
  Tensor gw3 = glu ? at::empty_like(*w3) : Tensor();
  for (int64_t e = 0; e < E; ++e) {
    if (sizes[e] == 0) {
      gw1[e].zero_();
      gw2[e].zero_();
      if (glu) gw3[e].zero_();
    }
  }
  const auto schedule = schedule_of(sizes, threads);
  auto scratch = lane_scratch(schedule, sizes, glu ? 3 : 2, w1.size(2), xs.options());  // da, act (, dh3)
  dispatch_dtype(xs.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    run_lanes(schedule, [&](int64_t e, int64_t lane, int64_t after) {
      const int64_t r0 = starts[e], C = sizes[e];
      const auto& own = scratch[lane];
      Tensor x = xs.narrow(0, r0, C), g = dy.narrow(0, r0, C), a1 = h1.narrow(0, r0, C);
      Tensor da = own[0].narrow(0, 0, C), act = own[1].narrow(0, 0, C);  // [C, F]; da becomes dh1
      const Tensor next_w2 = after < 0 ? Tensor() : w2[after];
      matmul(da, g, w2[e].t(), false, gemm, glu ? Tensor() : w1[e]);
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
          matmul(gw2e, act.t(), g, false, gemm, Tensor(), true);
          matmul(gw3e, xt, dh3, false, gemm, dxs ? (*w3)[e] : Tensor(), true);
        }
        if (dxs) {
          Tensor dx = dxs->narrow(0, r0, C);
          matmul(dx, dh3, (*w3)[e].t(), false, gemm, w1[e]);
          matmul(dx, da, w1[e].t(), true, gemm);
        }
      } else {
        at::clamp_min_out(act, a1, 0);  // at::relu
        {
          RECORD_FUNCTION("mhmoe::wgrad", std::vector<c10::IValue>());
          matmul(gw2e, act.t(), g, false, gemm, Tensor(), true);
        }
        at::threshold_backward_out(da, da, a1, 0);
        if (dxs) {
          Tensor dx = dxs->narrow(0, r0, C);
          matmul(dx, da, w1[e].t(), false, gemm);
        }
      }
      RECORD_FUNCTION("mhmoe::wgrad", std::vector<c10::IValue>());
      matmul(gw1e, xt, da, false, gemm, next_w2, true);
    });
  });
  if (glu) return {gw1, gw2, gw3};
  return {gw1, gw2};
}

// out = a · b (add: out += a · b) on the loop's GEMM `gemm` (kDot where it fits, else ATen's; `stream`: the
// kDot kernel's non-temporal stores): one expert GEMM as the loop runs it, for the tests and the benchmarks.
void expert_matmul(const Tensor& a, const Tensor& b, Tensor out, bool add, int64_t gemm, bool stream) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2 && a.size(1) == b.size(0) && out.size(0) == a.size(0) &&
              out.size(1) == b.size(1), "expert_matmul: shapes");
  const auto dt = a.scalar_type();
  const bool bf16 = dt == at::kBFloat16;
  TORCH_CHECK((b.scalar_type() == dt || (bf16 && b.scalar_type() == at::kFloat)) &&
              (out.scalar_type() == dt || (bf16 && !add && out.scalar_type() == at::kFloat)),
              "expert_matmul: b and out of a's dtype, or float32 for a bfloat16 a (out: not with add)");
  at::NoGradGuard no_grad;
  matmul(out, a, b, add, gemm, Tensor(), stream);
}

// act = silu(x · w1) * (x · w3), the pre-activations kept in h1 / h3 where given: a SwiGLU expert's up-projection as
// the loop runs it on `gemm` (on AMX in one pass, fused_glu_up), for the tests and the benchmarks. x [C, D]; w1, w3
// [D, F]; h1, h3, act [C, F] contiguous.
void expert_glu_up(const Tensor& x, const Tensor& w1, const Tensor& w3, std::optional<Tensor> h1,
                   std::optional<Tensor> h3, Tensor act, int64_t gemm) {
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 2 && w1.sizes() == w3.sizes() && x.size(1) == w1.size(0) &&
              act.sizes() == at::IntArrayRef({x.size(0), w1.size(1)}) && act.is_contiguous(), "expert_glu_up: shapes");
  TORCH_CHECK(h1.has_value() == h3.has_value(), "expert_glu_up: h1 and h3 together");
  for (const auto* h : {&h1, &h3})
    TORCH_CHECK(!h->has_value() || ((*h)->sizes() == act.sizes() && (*h)->is_contiguous()), "expert_glu_up: h1/h3");
  at::NoGradGuard no_grad;
  const bool keep = h1.has_value();
  Tensor a1 = keep ? *h1 : at::empty_like(act), a3 = keep ? *h3 : at::empty_like(act);
  if (fused_glu_up(a1, a3, act, x, w1, w3, Tensor(), keep, gemm)) return;
  matmul(a1, x, w1, false, gemm);
  matmul(a3, x, w3, false, gemm);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    swiglu_forward<scalar_t>(a1.const_data_ptr<scalar_t>(), a3.const_data_ptr<scalar_t>(),
                             act.mutable_data_ptr<scalar_t>(), a1.numel());
  });
}

}  // namespace

TORCH_LIBRARY(mhmoe_cpu, m) {
  m.def("expert_forward(Tensor xs, Tensor w1, Tensor w2, Tensor? w3, Tensor(a!)? h1, Tensor(b!)? h3, Tensor(c!) ys, "
        "int[] starts, int[] sizes, int threads, int gemm=0) -> ()");
  m.def("expert_backward(Tensor xs, Tensor h1, Tensor? h3, Tensor dy, Tensor w1, Tensor w2, Tensor? w3, "
        "Tensor(a!)? dxs, int[] starts, int[] sizes, int threads, int gemm=0) -> Tensor[]");
  m.def("expert_matmul(Tensor a, Tensor b, Tensor(a!) out, bool add=False, int gemm=0, bool stream=False) -> ()");
  m.def("expert_glu_up(Tensor x, Tensor w1, Tensor w3, Tensor(a!)? h1, Tensor(b!)? h3, Tensor(c!) act, int gemm=0) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("expert_matmul", &expert_matmul);
  m.impl("expert_glu_up", &expert_glu_up);
  m.impl("expert_forward", &expert_forward);
  m.impl("expert_backward", &expert_backward);
}
