// The SwiGLU element-wise passes of the C++ expert loop (expert_loop.cpp), one vectorised pass per direction
// over an expert's [C, F] hidden block, with the formulas and the bf16 roundings of the Python loop's ATen
// kernels (mhmoe/moe/dispatch/fused.py), so that both loops compute the same numbers bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "vec_io.h"
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace mhmoe_native {

// Rounding to T between the element-wise ops where the Python loop stores an intermediate tensor of dtype T
// (bf16: silu(h1), silu(h1) * h3, da * h3), so that both loops compute the same numbers.
template <typename T>
inline void round2(fVec&, fVec&) {}
template <>
inline void round2<at::BFloat16>(fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(a, b));
}

// The formulas of ATen's silu and silu_backward kernels: silu(x) = x / (1 + exp(-x)),
// silu'(x) dy = dy * s * (1 + x * (1 - s)) with s = 1 / (1 + exp(-x)). act = silu(g), sig = s.
inline void silu_parts(const fVec& g, fVec& act, fVec& sig) {
  const fVec one(1.f), e = one + g.neg().exp();
  act = g / e;
  sig = one / e;
}

// The vector part of the passes below over the first multiple of 2 * fVec::size() elements of n; returns
// how many it did (the scalar tails follow). With exp per element here; bf16 has a table (below).
template <typename T>
int64_t swiglu_forward_vec(const T* h1, const T* h3, T* a, int64_t n) {
  constexpr int64_t W = 2 * fVec::size();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    fVec g0, g1, u0, u1, s0, s1, unused;
    load2(h1 + i, g0, g1);
    load2(h3 + i, u0, u1);
    silu_parts(g0, s0, unused);
    silu_parts(g1, s1, unused);
    round2<T>(s0, s1);
    store2(a + i, s0 * u0, s1 * u1);
  }
  return i;
}

// The element-wise tail of the backward from silu(h1) (rounded to T) and s for two vectors of elements:
// writes dh3 = da * act, a = act * h3 and dh1 = (da * h3) * s * (1 + h1 * (1 - s)) over da.
template <typename T>
inline void swiglu_backward_store(const fVec g[2], const fVec act[2], const fVec sig[2], const T* h3, T* da_dh1,
                                  T* a, T* dh3) {
  const fVec one(1.f);
  fVec u[2], d[2], t[2];
  load2(h3, u[0], u[1]);
  load2(da_dh1, d[0], d[1]);
  store2(dh3, d[0] * act[0], d[1] * act[1]);
  store2(a, act[0] * u[0], act[1] * u[1]);
  t[0] = d[0] * u[0];
  t[1] = d[1] * u[1];
  round2<T>(t[0], t[1]);
  store2(da_dh1, t[0] * sig[0] * (one + g[0] * (one - sig[0])), t[1] * sig[1] * (one + g[1] * (one - sig[1])));
}

template <typename T>
int64_t swiglu_backward_vec(const T* h1, const T* h3, T* da_dh1, T* a, T* dh3, int64_t n) {
  constexpr int64_t W = 2 * fVec::size();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    fVec g[2], act[2], sig[2];
    load2(h1 + i, g[0], g[1]);
    silu_parts(g[0], act[0], sig[0]);
    silu_parts(g[1], act[1], sig[1]);
    round2<T>(act[0], act[1]);
    swiglu_backward_store<T>(g, act, sig, h3 + i, da_dh1 + i, a + i, dh3 + i);
  }
  return i;
}

#if defined(__AVX512BW__)
// bf16 has 65,536 values: silu(x) (rounded to bf16) and s of every one, computed once by silu_parts (the
// same instructions as the loops above), are looked up instead of computed: bit-identical, and the passes
// take ~0.5 / 1.0-1.2 ns per element in the expert loop instead of 0.85 / 1.49 (one thread, AMD EPYC; the exp
// and the divisions cost more than two 64-bit gathers; benchmarks/native_ops.py). 512 KiB, of which the few
// thousand values that pre-activations take are read.
class SiluTable {
 public:
  static const SiluTable& get() {
    static const SiluTable table;  // built on first use, thread-safe
    return table;
  }
  // act (rounded to bf16) and s of 16 bf16 values at p
  void lookup(const at::BFloat16* p, fVec& act, fVec& sig) const {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
    const __m512 p0 = _mm512_castpd_ps(_mm512_i32gather_pd(lo, pairs_.data(), 8));
    const __m512 p1 = _mm512_castpd_ps(_mm512_i32gather_pd(hi, pairs_.data(), 8));
    act = _mm512_permutex2var_ps(p0, even, p1);
    sig = _mm512_permutex2var_ps(p0, odd, p1);
  }

 private:
  SiluTable() : pairs_(65536) {
    constexpr int64_t W = 2 * fVec::size();
    at::BFloat16 x[W];
    for (int64_t b = 0; b < 65536; b += W) {
      for (int64_t j = 0; j < W; ++j) x[j] = at::BFloat16(static_cast<uint16_t>(b + j), at::BFloat16::from_bits());
      fVec g[2], act[2], sig[2];
      load2(x, g[0], g[1]);
      silu_parts(g[0], act[0], sig[0]);
      silu_parts(g[1], act[1], sig[1]);
      round2<at::BFloat16>(act[0], act[1]);
      float v[2][W];
      for (int h = 0; h < 2; ++h) {
        act[h].store(v[0] + h * fVec::size());
        sig[h].store(v[1] + h * fVec::size());
      }
      for (int64_t j = 0; j < W; ++j) {
        const float pair[2] = {v[0][j], v[1][j]};
        std::memcpy(&pairs_[b + j], pair, sizeof(double));
      }
    }
  }
  std::vector<double> pairs_;  // {act, s} of bf16 bit pattern i as two floats
};

template <>
inline int64_t swiglu_forward_vec<at::BFloat16>(const at::BFloat16* h1, const at::BFloat16* h3, at::BFloat16* a,
                                                int64_t n) {
  constexpr int64_t W = 2 * fVec::size();
  const SiluTable& table = SiluTable::get();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    fVec s0, s1, u0, u1, unused;
    table.lookup(h1 + i, s0, unused);
    table.lookup(h1 + i + fVec::size(), s1, unused);
    load2(h3 + i, u0, u1);
    store2(a + i, s0 * u0, s1 * u1);
  }
  return i;
}

template <>
inline int64_t swiglu_backward_vec<at::BFloat16>(const at::BFloat16* h1, const at::BFloat16* h3,
                                                 at::BFloat16* da_dh1, at::BFloat16* a, at::BFloat16* dh3, int64_t n) {
  constexpr int64_t W = 2 * fVec::size();
  const SiluTable& table = SiluTable::get();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    fVec g[2], act[2], sig[2];
    load2(h1 + i, g[0], g[1]);
    table.lookup(h1 + i, act[0], sig[0]);
    table.lookup(h1 + i + fVec::size(), act[1], sig[1]);
    swiglu_backward_store<at::BFloat16>(g, act, sig, h3 + i, da_dh1 + i, a + i, dh3 + i);
  }
  return i;
}
#endif

// a = silu(h1) * h3 over n elements (the Python loop: F.silu(h1).mul_(h3)).
template <typename T>
void swiglu_forward(const T* h1, const T* h3, T* a, int64_t n) {
  for (int64_t i = swiglu_forward_vec(h1, h3, a, n); i < n; ++i) {
    float g = float(h1[i]);
    a[i] = T(round_to<T>(g / (1.f + std::exp(-g))) * float(h3[i]));
  }
}

// From the pre-activations h1, h3 and the gradient da of a = silu(h1) * h3: a itself (what W2 saw, for its
// weight gradient), dh3 = da * silu(h1) and dh1 = da * h3 * silu'(h1), written over da. n elements.
template <typename T>
void swiglu_backward(const T* h1, const T* h3, T* da_dh1, T* a, T* dh3, int64_t n) {
  for (int64_t i = swiglu_backward_vec(h1, h3, da_dh1, a, dh3, n); i < n; ++i) {
    float g = float(h1[i]), u = float(h3[i]), d = float(da_dh1[i]);
    float e = 1.f + std::exp(-g), act = round_to<T>(g / e), s = 1.f / e, t = round_to<T>(d * u);
    dh3[i] = T(d * act);
    a[i] = T(act * u);
    da_dh1[i] = T(t * s * (1.f + g * (1.f - s)));
  }
}

}  // namespace mhmoe_native
