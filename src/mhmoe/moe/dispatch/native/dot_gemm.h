// bf16 GEMMs on the AVX-512 BF16 dot-product instruction (vdpbf16ps: fp32 += a0 * b0 + a1 * b1 per lane), for the
// expert loop on CPUs that have it without AMX (AMD Zen 4 / 5, Intel Cooper Lake). One expert's GEMM is small (the
// d=768 h=3 layer: [192, 256] x [256, 512]); at::mm (oneDNN) spends about a sixth of such a call outside its inner
// loop.
// Here the right operand is packed once per call into K-pairs, the left one is read in place (or packed the same
// way when it is a transposed view: the weight gradients' X^T), and a register-blocked kernel of MR rows x 32
// columns accumulates in fp32 over the whole K, in K order, as oneDNN's does (docs/PERFORMANCE.md, "The loop's own
// bf16 GEMM").
//
// Layouts: an operand "in pairs" is a matrix of 32-bit elements, each the bf16 pair (x[.., 2kk], x[.., 2kk + 1]).
// B in pairs: P[kk][n] = (b[2kk][n], b[2kk + 1][n]), N pairs per row. A in pairs: element (i, kk) at
// A[i * a_row + kk * a_k]: a row-major matrix read in place (a_row = its row stride / 2, a_k = 1) or a packed one.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) && !defined(__clang__) ? __GNUC__ >= 10 : __clang_major__ >= 9)
#define MHMOE_DOT_GEMM 1
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#define MHMOE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace mhmoe_native::dot_gemm {

// Whether this CPU runs the kernels (callers fall back to another GEMM where it does not): AVX512_BF16 is CPUID
// leaf 7, sub-leaf 1, EAX bit 5 (read directly: not every compiler's __builtin_cpu_supports knows it).
inline bool supported() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    const bool bf16 = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
    return bf16 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq");
  }();
  return yes;
}

constexpr int64_t NB = 32;      // columns of one kernel call (two vectors of 16 fp32 accumulators)
constexpr int64_t MR = 8;       // rows of one kernel call (the switch in gemm has a case for each count)
constexpr int64_t L2_A = 1 << 18;  // bytes of A one column sweep keeps in cache (a quarter of a 1 MiB L2)
constexpr int64_t L2_B = 1 << 18;  // bytes of packed B per column panel (callers pack and use B panel by panel)

// Rows k, k + 1 of src [K, N] (row stride ld, bf16) into P [ceil(K / 2)][N] pairs; an odd K's last pair takes a zero.
MHMOE_BF16_TARGET inline void pack_row_pairs(const uint16_t* src, int64_t ld, int64_t K, int64_t N, uint32_t* P) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54, 22,
                                      53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* r0 = src + k * ld;
    const bool pair = k + 1 < K;
    uint32_t* o = P + (k / 2) * N;
    for (int64_t n = 0; n < N; n += 32) {
      const int64_t t = std::min<int64_t>(32, N - n);
      const __mmask32 m = t == 32 ? ~0u : (1u << t) - 1;
      const __m512i a = _mm512_maskz_loadu_epi16(m, r0 + n);
      const __m512i b = pair ? _mm512_maskz_loadu_epi16(m, r0 + ld + n) : _mm512_setzero_si512();
      const __mmask16 m0 = t >= 16 ? 0xFFFF : (1u << t) - 1, m1 = t >= 32 ? 0xFFFF : t > 16 ? (1u << (t - 16)) - 1 : 0;
      _mm512_mask_storeu_epi32(o + n, m0, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_mask_storeu_epi32(o + n + 16, m1, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// The 32-bit transpose of src [N, K / 2] (row stride ld32 in 32-bit elements) into P [K / 2][N]: B in pairs for a
// right operand given as the transpose of a row-major [N, K] bf16 matrix (K even). 16 x 16 blocks in registers.
MHMOE_BF16_TARGET inline void pack_col_pairs(const uint32_t* src, int64_t ld32, int64_t KK, int64_t N, uint32_t* P) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    int64_t kk = 0;
    for (; kk + 16 <= KK; kk += 16) {
      __m512i r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (n + i) * ld32 + kk);
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {  // r[4i + j], lane L: column 4L + j of rows 4i..4i+3
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i x0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i y0 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44),
                      y1 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        _mm512_storeu_si512(P + (kk + j) * N + n, _mm512_shuffle_i32x4(x0, y0, 0x88));
        _mm512_storeu_si512(P + (kk + 4 + j) * N + n, _mm512_shuffle_i32x4(x0, y0, 0xDD));
        _mm512_storeu_si512(P + (kk + 8 + j) * N + n, _mm512_shuffle_i32x4(x1, y1, 0x88));
        _mm512_storeu_si512(P + (kk + 12 + j) * N + n, _mm512_shuffle_i32x4(x1, y1, 0xDD));
      }
    }
    for (; kk < KK; ++kk)
      for (int64_t i = 0; i < 16; ++i) P[kk * N + n + i] = src[(n + i) * ld32 + kk];
  }
  for (; n < N; ++n)
    for (int64_t kk = 0; kk < KK; ++kk) P[kk * N + n] = src[n * ld32 + kk];
}

// dst[i] = bf16(src[i]) for the first multiple of 32 of n elements, rounded to nearest even as ATen rounds (the
// instruction's rounding; a block of 32 with a denormal or a NaN, which the instruction flushes or quiets, is left
// to the caller); returns how many it wrote.
MHMOE_BF16_TARGET inline int64_t round_bf16(const float* src, int64_t n, void* dst) {
  auto* d = static_cast<uint16_t*>(dst);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(src + i), hi = _mm512_loadu_ps(src + i + 16);
    // fpclass: 0x01 QNaN, 0x80 SNaN, 0x20 denormal
    if (_mm512_fpclass_ps_mask(lo, 0xA1) | _mm512_fpclass_ps_mask(hi, 0xA1)) break;
    _mm512_storeu_si512(d + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  return i;
}

// out[R, 32] (+)= A[R rows] · P[:, 32 columns] over KK pairs.
template <int R>
MHMOE_BF16_TARGET inline void kernel(const uint32_t* A, int64_t a_row, int64_t a_k, const uint32_t* P, int64_t N,
                                     int64_t KK, uint16_t* out, int64_t ldo, bool add, bool stream) {
  __m512 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < KK; ++kk) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(P + kk * N), b1 = (__m512bh)_mm512_loadu_si512(P + kk * N + 16);
    const uint32_t* a = A + kk * a_k;
    for (int i = 0; i < R; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i * a_row]);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  for (int i = 0; i < R; ++i) {
    uint16_t* o = out + i * ldo;
    if (add) {  // fp32(out) + the product, rounded once (as addmm_)
      const __m512i old = _mm512_loadu_si512(o);
      acc[i][0] = _mm512_add_ps(acc[i][0], _mm512_castsi512_ps(_mm512_slli_epi32(
                                               _mm512_cvtepu16_epi32(_mm512_castsi512_si256(old)), 16)));
      acc[i][1] = _mm512_add_ps(acc[i][1], _mm512_castsi512_ps(_mm512_slli_epi32(
                                               _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(old, 1)), 16)));
    }
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(acc[i][1], acc[i][0]);
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v);
    else
      _mm512_storeu_si512(o, v);
  }
}

// out[M, N] (row stride ldo, bf16) = A · B (add: out + A · B, rounded once), A in pairs (a_row, a_k), B in pairs P
// [KK][N]; N a multiple of NB. Chunks of A's rows small enough to stay in cache while every column block reads them.
// `next` (bytes `next_bytes`, may be null): memory the caller reads next (the next weight matrix), pulled into the
// cache a few lines per kernel call while this GEMM computes.
MHMOE_BF16_TARGET inline void gemm(const uint32_t* A, int64_t a_row, int64_t a_k, const uint32_t* P, int64_t M,
                                   int64_t N, int64_t KK, uint16_t* out, int64_t ldo, bool add,
                                   const void* next = nullptr, int64_t next_bytes = 0, bool stream = false) {
  // non-temporal stores (no read of the output's lines first) where asked and every row starts on a cache line
  stream = stream && !add && reinterpret_cast<uintptr_t>(out) % 64 == 0 && (ldo * 2) % 64 == 0;
  const int64_t chunk = std::max<int64_t>(MR, L2_A / std::max<int64_t>(1, KK * 4) / MR * MR);
  const int64_t calls = ((M + MR - 1) / MR) * (N / NB), lines = (next_bytes + 63) / 64;
  const int64_t per_call = calls > 0 ? (lines + calls - 1) / calls : 0;
  const char* pf = static_cast<const char*>(next);
  const char* pf_end = pf + lines * 64;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
    for (int64_t n = 0; n < N; n += NB)
      for (int64_t m = m0; m < m1; m += MR) {
        const uint32_t* a = A + m * a_row;
        uint16_t* o = out + m * ldo + n;
        for (int64_t l = 0; l < per_call && pf < pf_end; ++l, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        switch (std::min<int64_t>(MR, m1 - m)) {
          case 8: kernel<8>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 7: kernel<7>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 6: kernel<6>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 5: kernel<5>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 4: kernel<4>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 3: kernel<3>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          case 2: kernel<2>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream); break;
          default: kernel<1>(a, a_row, a_k, P + n, N, KK, o, ldo, add, stream);
        }
      }
  }
  if (stream) _mm_sfence();
}

}  // namespace mhmoe_native::dot_gemm

#endif
