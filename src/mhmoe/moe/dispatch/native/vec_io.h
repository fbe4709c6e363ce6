// Vector loads and stores (and a scalar rounding) shared by the C++ ops of mhmoe.moe.dispatch.native: two float vectors from / to
// 2 * fVec::size() consecutive elements of float or bfloat16 (bf16 converted to and from fp32).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <tuple>

namespace mhmoe_native {

using fVec = at::vec::Vectorized<float>;

inline void load2(const float* p, fVec& a, fVec& b) {
  a = fVec::loadu(p);
  b = fVec::loadu(p + fVec::size());
}
inline void load2(const at::BFloat16* p, fVec& a, fVec& b) {
  std::tie(a, b) = at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p));
}
inline void store2(float* p, const fVec& a, const fVec& b) {
  a.store(p);
  b.store(p + fVec::size());
}
inline void store2(at::BFloat16* p, const fVec& a, const fVec& b) {
  at::vec::convert_from_float<at::BFloat16>(a, b).store(p);
}

// v rounded to T's precision (where the Python code stores an intermediate tensor of dtype T), as a float
template <typename T>
inline float round_to(float v) { return float(T(v)); }

}  // namespace mhmoe_native
