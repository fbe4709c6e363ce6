// Generation's few (token, slot) pairs on a CPU (mhmoe/moe/dispatch/gathered.py): each pair's one-row FFN read
// straight from its expert's weights, a vector-matrix product per weight matrix, in place of gathering every
// pair's weights into [N, D, F] copies and running batched GEMMs on them (the copies are most of the memory
// traffic of a decoding step's MoE layer). Plain experts only (no biases, not quantized). Registered as
// torch.ops.mhmoe_cpu.gathered_ffn.
//
// Shape legend: N pairs, D expert width, F expert hidden width, E experts.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vec_io.h"

#include <cmath>
#include <vector>

namespace {

using at::Tensor;
using fVec = at::vec::Vectorized<float>;
using mhmoe_native::round_to;

// acc[0:n] += a * row[0:n] (row of T, accumulated in fp32)
template <typename T>
inline void axpy(float a, const T* row, float* acc, int64_t n) {
  const fVec va(a);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + fVec::size() <= n; i += fVec::size())
      at::vec::fmadd(va, fVec::loadu(row + i), fVec::loadu(acc + i)).store(acc + i);
  } else {
    constexpr int64_t W = 2 * fVec::size();
    for (; i + W <= n; i += W) {
      auto [r0, r1] = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(row + i));
      at::vec::fmadd(va, r0, fVec::loadu(acc + i)).store(acc + i);
      at::vec::fmadd(va, r1, fVec::loadu(acc + i + fVec::size())).store(acc + i + fVec::size());
    }
  }
  for (; i < n; ++i) acc[i] += a * float(row[i]);
}

// One pair: y [D] = act(x W1 [, x W3]) W2 with x [D]; w1, w3 [D, F], w2 [F, D] row-major. Rounds to T where the
// batched path stores a T tensor (the pre-activations, silu, the product); h1, h3: fp32 scratch rows of F.
template <typename T>
void pair_ffn(const T* x, const T* w1, const T* w3, const T* w2, int64_t D, int64_t F, T* y, float* h1, float* h3,
              float* acc) {
  std::fill(h1, h1 + F, 0.f);
  if (w3) std::fill(h3, h3 + F, 0.f);
  for (int64_t d = 0; d < D; ++d) {
    const float xd = float(x[d]);
    axpy(xd, w1 + d * F, h1, F);
    if (w3) axpy(xd, w3 + d * F, h3, F);
  }
  for (int64_t f = 0; f < F; ++f) {
    const float g = round_to<T>(h1[f]);
    h1[f] = w3 ? round_to<T>(round_to<T>(g / (1.f + std::exp(-g))) * round_to<T>(h3[f])) : std::max(g, 0.f);
  }
  std::fill(acc, acc + D, 0.f);
  for (int64_t f = 0; f < F; ++f) axpy(h1[f], w2 + f * D, acc, D);
  for (int64_t d = 0; d < D; ++d) y[d] = T(acc[d]);
}

// x [N, D] (contiguous), ids [N] int64 in [0, E), w1 (w3) [E, D, F], w2 [E, F, D] contiguous -> y [N, D].
Tensor gathered_ffn(const Tensor& x, const Tensor& ids, const Tensor& w1, const Tensor& w2,
                    const std::optional<Tensor>& w3) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [N, D] tensor");
  const int64_t N = x.size(0), D = x.size(1), E = w1.size(0), F = w1.size(2);
  TORCH_CHECK(w1.dim() == 3 && w1.size(1) == D && w1.is_contiguous(), "w1 must be a contiguous [E, D, F] tensor");
  TORCH_CHECK(w2.sizes() == at::IntArrayRef({E, F, D}) && w2.is_contiguous(), "w2 must be a contiguous [E, F, D]");
  TORCH_CHECK(!w3 || (w3->sizes() == w1.sizes() && w3->is_contiguous()), "w3 must be contiguous, w1's shape");
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == N && ids.scalar_type() == at::kLong, "ids must be int64 [N]");
  TORCH_CHECK(w1.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type() &&
              (!w3 || w3->scalar_type() == x.scalar_type()), "x and the weights must share a dtype");
  Tensor idc = ids.contiguous();
  const int64_t* ip = idc.const_data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) TORCH_CHECK(ip[n] >= 0 && ip[n] < E, "expert id ", ip[n], " out of range");
  Tensor y = at::empty({N, D}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    const T* p1 = w1.const_data_ptr<T>();
    const T* p2 = w2.const_data_ptr<T>();
    const T* p3 = w3 ? w3->const_data_ptr<T>() : nullptr;
    T* yp = y.mutable_data_ptr<T>();
    at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> h1(F), h3(F), acc(D);
      for (int64_t n = begin; n < end; ++n) {
        const int64_t e = ip[n];
        pair_ffn<T>(xp + n * D, p1 + e * D * F, p3 ? p3 + e * D * F : nullptr, p2 + e * F * D, D, F, yp + n * D,
                    h1.data(), h3.data(), acc.data());
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(float{});
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "gathered_ffn: float32 or bfloat16, got ", x.scalar_type());
    run(at::BFloat16{});
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhmoe_cpu, m) {
  m.def("gathered_ffn(Tensor x, Tensor ids, Tensor w1, Tensor w2, Tensor? w3) -> Tensor");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("gathered_ffn", &gathered_ffn);
}
