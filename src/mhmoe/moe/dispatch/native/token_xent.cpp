// The LM loss's per-row work on a CPU (mhmoe/model/lm_loss.py): for every row of a chunk of logits, its
// cross-entropy against the target and, in place of the logits, the logit gradient softmax - onehot, in one
// pass over the row (max), one exp pass into an fp32 row buffer (sum) and one pass writing the gradient. The
// torch ops for the same work convert the chunk to fp32, run softmax, then convert the gradient back: three
// passes over [C, V] in memory. Registered as torch.ops.mhmoe_cpu.token_xent_.
//
// Shape legend: C rows (positions of one chunk), V vocabulary.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using at::Tensor;
using fVec = at::vec::Vectorized<float>;
using mhmoe_native::load2;
using mhmoe_native::store2;
constexpr int64_t kIgnore = -100;  // target of a row without a loss (mhmoe.model.lm_loss.IGNORE)

// One row x [V]: returns its loss logsumexp(x) - x[t] (0 when t is kIgnore) and, with grad, writes
// softmax(x) - onehot(t) over x (zeros when t is kIgnore). e: an fp32 scratch row of V.
template <typename T>
float row_xent(T* x, int64_t V, int64_t t, bool grad, float* e) {
  constexpr int64_t W = 2 * fVec::size();
  const int64_t Vv = V - V % W;
  if (t == kIgnore) {
    if (grad) std::fill(x, x + V, T(0.f));
    return 0.f;
  }
  float mx = -std::numeric_limits<float>::infinity();
  fVec m0(mx), m1(mx);
  for (int64_t i = 0; i < Vv; i += W) {
    fVec a, b;
    load2(x + i, a, b);
    m0 = at::vec::maximum(m0, a);
    m1 = at::vec::maximum(m1, b);
  }
  mx = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); },
                                      at::vec::maximum(m0, m1));
  for (int64_t i = Vv; i < V; ++i) mx = std::max(mx, float(x[i]));
  const fVec vmx(mx);
  fVec s0(0.f), s1(0.f);
  for (int64_t i = 0; i < Vv; i += W) {
    fVec a, b;
    load2(x + i, a, b);
    a = (a - vmx).exp();
    b = (b - vmx).exp();
    store2(e + i, a, b);
    s0 = s0 + a;
    s1 = s1 + b;
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, s0 + s1);
  for (int64_t i = Vv; i < V; ++i) {
    e[i] = std::exp(float(x[i]) - mx);
    sum += e[i];
  }
  const float loss = mx + std::log(sum) - float(x[t]);
  if (grad) {
    const fVec inv(1.f / sum);
    for (int64_t i = 0; i < Vv; i += W) {
      fVec a, b;
      load2(e + i, a, b);
      store2(x + i, a * inv, b * inv);
    }
    for (int64_t i = Vv; i < V; ++i) x[i] = T(e[i] / sum);
    x[t] = T(e[t] / sum - 1.f);
  }
  return loss;
}

// logits [C, V] (float32 or bfloat16, contiguous), targets [C] int64 (kIgnore: no loss) -> the rows' losses
// [C] fp32; with grad the logits are overwritten by softmax - onehot (rows without a loss: zeros).
Tensor token_xent_(Tensor logits, const Tensor& targets, bool grad) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [C, V] tensor");
  TORCH_CHECK(targets.dim() == 1 && targets.size(0) == logits.size(0) && targets.scalar_type() == at::kLong,
              "targets must be an int64 [C] tensor");
  const int64_t C = logits.size(0), V = logits.size(1);
  Tensor tgt = targets.contiguous();
  const int64_t* tp = tgt.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < C; ++r)
    TORCH_CHECK(tp[r] == kIgnore || (tp[r] >= 0 && tp[r] < V), "target ", tp[r], " out of bounds [0, ", V, ")");
  Tensor loss = at::empty({C}, logits.options().dtype(at::kFloat));
  float* lp = loss.mutable_data_ptr<float>();
  auto run = [&](auto* x) {
    at::parallel_for(0, C, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> e(V);
      for (int64_t r = begin; r < end; ++r) lp[r] = row_xent(x + r * V, V, tp[r], grad, e.data());
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(logits.mutable_data_ptr<float>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "token_xent_: float32 or bfloat16 logits, got ",
                logits.scalar_type());
    run(logits.mutable_data_ptr<at::BFloat16>());
  }
  return loss;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhmoe_cpu, m) {
  m.def("token_xent_(Tensor(a!) logits, Tensor targets, bool grad) -> Tensor");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("token_xent_", &token_xent_);
}
