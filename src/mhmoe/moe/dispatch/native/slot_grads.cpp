// The per-row work at the head of the fused MoE path's backward (mhmoe/moe/dispatch/fused.py) in one pass over the
// expert-grouped rows, where ATen took five (gather dout by token, zero the padding rows, multiply by the outputs,
// sum, scale by the weights): for every row r of a valid slot (s, k),
//   g[r] = dout[s] * weights[s, k]           (the expert output's gradient, rounded once to T, as ATen's mul_)
//   dweights[s, k] = sum_d ys[r, d] * dout[s, d]  (the combine weight's gradient: exact products, fp32 sums)
// and g[r] = 0 for padding rows, dweights = 0 for invalid slots. Registered as torch.ops.mhmoe_cpu.slot_grads.
//
// Shape legend: S routed (sub-)tokens, K slots per token, R rows of the buffer (RowLayout), D expert width.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <algorithm>
#include <vector>

namespace {

using at::Tensor;
using mhmoe_native::fVec;
using mhmoe_native::load2;
using mhmoe_native::store2;

// One row: g [D] = dout_s [D] * w (rounded to T) and returns sum_d y[d] * dout_s[d] in fp32.
template <typename T>
float row(const T* dout_s, const T* y, float w, T* g, int64_t D) {
  constexpr int64_t W = 2 * fVec::size();
  const fVec vw(w);
  fVec acc0(0.f), acc1(0.f);
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    fVec a0, a1, y0, y1;
    load2(dout_s + d, a0, a1);
    load2(y + d, y0, y1);
    acc0 = at::vec::fmadd(a0, y0, acc0);
    acc1 = at::vec::fmadd(a1, y1, acc1);
    store2(g + d, a0 * vw, a1 * vw);
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, acc0 + acc1);
  for (; d < D; ++d) {
    const float a = float(dout_s[d]);
    sum += a * float(y[d]);
    g[d] = T(a * w);
  }
  return sum;
}

// dout [S, D] contiguous; ys [>= R, D] contiguous (the forward's expert outputs; extra rows unread); weights [S, K];
// tok, slot [R] int64 (the token and the flat slot s * K + k of every row; padding rows: any slot whose row is not
// theirs); inv [S * K] int64 (the row of every slot; invalid slots: R). Returns {g [R, D], dweights [S, K]} in
// dout's dtype.
std::vector<Tensor> slot_grads(const Tensor& dout, const Tensor& ys, const Tensor& weights, const Tensor& tok,
                               const Tensor& slot, const Tensor& inv) {
  TORCH_CHECK(dout.dim() == 2 && dout.is_contiguous() && ys.dim() == 2 && ys.is_contiguous() &&
              ys.size(1) == dout.size(1), "slot_grads: dout [S, D] and ys [R, D] contiguous");
  const int64_t S = dout.size(0), D = dout.size(1), R = tok.numel();
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == S && ys.size(0) >= R && slot.numel() == R &&
              inv.numel() == weights.numel(), "slot_grads: shapes");
  TORCH_CHECK(tok.scalar_type() == at::kLong && slot.scalar_type() == at::kLong && inv.scalar_type() == at::kLong,
              "slot_grads: int64 indices");
  TORCH_CHECK((dout.scalar_type() == at::kFloat || dout.scalar_type() == at::kBFloat16) &&
              ys.scalar_type() == dout.scalar_type() && weights.scalar_type() == dout.scalar_type(),
              "slot_grads: float32 or bfloat16, one dtype");
  const int64_t SK = weights.numel();
  const Tensor w = weights.contiguous(), tk = tok.contiguous(), sl = slot.contiguous(), iv = inv.contiguous();
  const int64_t *tp = tk.const_data_ptr<int64_t>(), *sp = sl.const_data_ptr<int64_t>(),
                *ip = iv.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < S && sp[r] >= 0 && sp[r] < SK, "slot_grads: token or slot out of range");
  Tensor g = at::empty({R, D}, dout.options());
  Tensor dweights = at::zeros({S, weights.size(1)}, dout.options());
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t *dp = dout.const_data_ptr<scalar_t>(), *yp = ys.const_data_ptr<scalar_t>(),
                   *wp = w.const_data_ptr<scalar_t>();
    scalar_t *gp = g.mutable_data_ptr<scalar_t>(), *dwp = dweights.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t k = sp[r];
        if (ip[k] != r) {  // a padding row: no slot's
          std::fill(gp + r * D, gp + (r + 1) * D, scalar_t(0));
          continue;
        }
        dwp[k] = scalar_t(row<scalar_t>(dp + tp[r] * D, yp + r * D, float(wp[k]), gp + r * D, D));
      }
    });
  };
  if (dout.scalar_type() == at::kFloat)
    run(float{});
  else
    run(at::BFloat16{});
  return {g, dweights};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhmoe_cpu, m) {
  m.def("slot_grads(Tensor dout, Tensor ys, Tensor weights, Tensor tok, Tensor slot, Tensor inv) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) { m.impl("slot_grads", &slot_grads); }
