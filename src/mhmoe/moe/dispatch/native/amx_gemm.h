// bf16 GEMMs on AMX tiles (TDPBF16PS: a 16 x 16 fp32 tile += a 16 x 32 bf16 tile times a 32 x 16 one), for the expert
// loop on CPUs with AMX (Intel Sapphire Rapids and later). One expert's GEMM is small (the d=768 h=3 layer:
// [192, 256] x [256, 512]); at::mm (oneDNN) ran such calls at about half the rate of one GEMM over all the experts'
// rows (benchmarks/native_ops.py), most of the difference fixed costs per call.
// Here the right operand is packed once per call into K-pairs (dot_gemm.h's layout, which is the tile's: a B tile is
// 16 pair rows of 16 columns), in L2-sized column panels; the left one is read in place (row-major, K a multiple of
// 32) or copied into a zero-padded block; every 32 x 32 output block accumulates in four tiles over the whole K, in
// K order, and leaves through an fp32 block rounded to bf16 once (docs/PERFORMANCE.md, "AMX tiles"). gemm_glu runs a
// SwiGLU expert's two up-projections block by block and hands the caller each pair of rounded blocks for the
// activation while they are in L1.
//
// Layouts: A row-major bf16 [M, Kp] (row stride lda elements, Kp = K rounded up to 32, zero beyond K); B in pairs
// P [Kp / 2][N] (dot_gemm.h; pairs beyond K zero). Tiles: 0-3 the output block, 4-5 A, 6-7 B.
#pragma once

#include "dot_gemm.h"

#if defined(MHMOE_DOT_GEMM) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define MHMOE_AMX_GEMM 1
#include <sys/syscall.h>
#include <unistd.h>

#define MHMOE_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace mhmoe_native::amx_gemm {

constexpr int64_t KB = 32;  // K of one tile step (bf16 elements)
constexpr int64_t MB = 32;  // rows of one output block (two A tiles)
constexpr int64_t NB = 32;  // columns of one output block (two B tiles)

// Whether this CPU and kernel run the tiles: AMX-TILE and AMX-BF16 (CPUID leaf 7, EDX bits 24 and 22), AVX-512 BF16
// for the packing and the rounding, and the kernel's permission for the tile data (Linux asks a process to request
// it once: arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18, as oneDNN does).
inline bool supported() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) return false;
    return dot_gemm::supported() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return yes;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes: the output's 16 x 16 fp32, A's 16 x 32 bf16, B's 16 pair rows x 16 columns.
MHMOE_AMX_TARGET inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC does not see the load read cfg's rows and columns (it dropped their stores, leaving the tiles unconfigured)
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// c[16 * MT][32] fp32 = A[16 * MT rows, Kp] · P[Kp / 2 pair rows][32 columns at n]; A rows of stride lda, P rows of N
// pairs. MT = 2: a whole 32-row block; MT = 1: a 16-row one (the last rows of an M that is 16 more than a multiple of 32,
// read in place instead of copied into a padded block).
// `per_step` lines of [pf, pf_end) are prefetched into L2 at every K step (advancing pf).
template <int MT>
MHMOE_AMX_TARGET inline void block(const uint16_t* A, int64_t lda, const uint32_t* P, int64_t N, int64_t Kp,
                                   float* c, const char*& pf, const char* pf_end, int64_t per_step) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (MT == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < Kp; k += KB) {
    for (int64_t l = 0; l < per_step && pf < pf_end; ++l, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    _tile_loadd(4, A + k, lda * 2);
    _tile_loadd(6, P + (k / 2) * N, N * 4);
    _tile_loadd(7, P + (k / 2) * N + 16, N * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, A + 16 * lda + k, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, NB * 4);
  _tile_stored(1, c + 16, NB * 4);
  if constexpr (MT == 2) {
    _tile_stored(2, c + 16 * NB, NB * 4);
    _tile_stored(3, c + 16 * NB + 16, NB * 4);
  }
}

// out[rows, 32] (row stride ldo) = bf16(c) (add: bf16(fp32(out) + c), rounded once as addmm_); c [32][32] fp32.
MHMOE_AMX_TARGET inline void store(const float* c, int64_t rows, uint16_t* out, int64_t ldo, bool add, bool stream) {
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* o = out + i * ldo;
    __m512 lo = _mm512_loadu_ps(c + i * NB), hi = _mm512_loadu_ps(c + i * NB + 16);
    if (add) {
      const __m512i old = _mm512_loadu_si512(o);
      lo = _mm512_add_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm512_castsi512_si256(old)), 16)));
      hi = _mm512_add_ps(hi, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(old, 1)), 16)));
    }
    const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(o), v);
    else
      _mm512_storeu_si512(o, v);
  }
}

// The prefetch of `next` (bytes `next_bytes`, may be null: memory the caller reads next, the next weight matrix),
// spread over a GEMM's `steps` K steps.
struct Prefetch {
  const char* pf;
  const char* end;
  int64_t per_step;
  Prefetch(const void* next, int64_t next_bytes, int64_t steps)
      : pf(static_cast<const char*>(next)), end(pf + (next_bytes + 63) / 64 * 64),
        per_step(steps > 0 ? ((next_bytes + 63) / 64 + steps - 1) / steps : 0) {}
};

// Calls f(a, la, rows, m, n) for every 32 x 32 output block of an [M, N] product with A row-major [M, Kp] (stride lda)
// except, where M is not a multiple of 16, its last M % 32 rows: those come from `tail`, a [32, Kp] block of
// zero-padded rows (the caller's copy of them; null where M % 16 = 0). a, la: the block's rows and their stride.
template <class F>
MHMOE_AMX_TARGET inline void for_blocks(const uint16_t* A, int64_t lda, const uint16_t* tail, int64_t M, int64_t N,
                                        int64_t Kp, const F& f) {
  for (int64_t m = 0; m < M; m += MB) {
    const int64_t rows = std::min(MB, M - m);
    const bool whole = rows % 16 == 0;
    for (int64_t n = 0; n < N; n += NB) f(whole ? A + m * lda : tail, whole ? lda : Kp, rows, m, n);
  }
}

// c [rows][32] fp32 = a [rows, Kp] · P's 32 columns at n (see block)
MHMOE_AMX_TARGET inline void block_rows(const uint16_t* a, int64_t la, int64_t rows, const uint32_t* P, int64_t N,
                                        int64_t Kp, float* c, Prefetch& pf) {
  if (rows > 16)
    block<2>(a, la, P, N, Kp, c, pf.pf, pf.end, pf.per_step);
  else
    block<1>(a, la, P, N, Kp, c, pf.pf, pf.end, pf.per_step);
}

// out[M, N] (row stride ldo, bf16; N a multiple of 32) = A · P (add: out + A · P), A as for_blocks takes it. `next`:
// memory the caller reads next (the next weight matrix), pulled into L2 a line or two per K step while this GEMM
// computes (the packing of a cold weight otherwise waits on memory; bursts of prefetches stalled the tiles). The
// caller has configured the tiles.
MHMOE_AMX_TARGET inline void gemm(const uint16_t* A, int64_t lda, const uint16_t* tail, const uint32_t* P, int64_t M,
                                  int64_t N, int64_t Kp, uint16_t* out, int64_t ldo, bool add, bool stream,
                                  const void* next = nullptr, int64_t next_bytes = 0) {
  stream = stream && !add && reinterpret_cast<uintptr_t>(out) % 64 == 0 && (ldo * 2) % 64 == 0;
  Prefetch pf(next, next_bytes, ((M + MB - 1) / MB) * (N / NB) * (Kp / KB));
  alignas(64) float c[MB * NB];
  for_blocks(A, lda, tail, M, N, Kp, [&](const uint16_t* a, int64_t la, int64_t rows, int64_t m, int64_t n) {
    block_rows(a, la, rows, P + n, N, Kp, c, pf);
    store(c, rows, out + m * ldo + n, ldo, add, stream);
  });
  if (stream) _mm_sfence();
}

// r [rows][32] bf16 = c [rows][32] fp32 rounded (as store rounds it)
MHMOE_AMX_TARGET inline void round_rows(const float* c, int64_t rows, uint16_t* r) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 lo = _mm512_load_ps(c + i * NB), hi = _mm512_load_ps(c + i * NB + 16);
    _mm512_store_si512(r + i * NB, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
}

// out's rows [rows][32] (row stride ldo) = r [rows][32] bf16; `stream`: around the cache (64-byte aligned rows)
MHMOE_AMX_TARGET inline void copy_rows(const uint16_t* r, int64_t rows, uint16_t* out, int64_t ldo, bool stream) {
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i v = _mm512_load_si512(r + i * NB);
    if (stream)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i * ldo), v);
    else
      _mm512_storeu_si512(out + i * ldo, v);
  }
}

// A SwiGLU expert's up-projection in one pass over the output blocks: h1 = A · P1 and h3 = A · P3, each rounded to
// bf16 as gemm rounds it and written where h1 / h3 are non-null (row stride ldo; past the cache: the backward reads
// them much later), and for every block the caller's epilogue act(r1, r3, rows, m, n) on the rounded blocks r1, r3
// [rows][32] (the activation silu(h1) * h3, from the numbers a separate pass would read back). A as for_blocks
// takes it; `next` as for gemm. The caller has configured the tiles.
template <class Act>
MHMOE_AMX_TARGET inline void gemm_glu(const uint16_t* A, int64_t lda, const uint16_t* tail, const uint32_t* P1,
                                      const uint32_t* P3, int64_t M, int64_t N, int64_t Kp, uint16_t* h1, uint16_t* h3,
                                      int64_t ldo, const void* next, int64_t next_bytes, const Act& act) {
  const bool stream = (ldo * 2) % 64 == 0 && reinterpret_cast<uintptr_t>(h1) % 64 == 0 &&
                      reinterpret_cast<uintptr_t>(h3) % 64 == 0;
  Prefetch pf(next, next_bytes, 2 * ((M + MB - 1) / MB) * (N / NB) * (Kp / KB));
  alignas(64) float c[MB * NB];
  alignas(64) uint16_t r1[MB * NB], r3[MB * NB];
  for_blocks(A, lda, tail, M, N, Kp, [&](const uint16_t* a, int64_t la, int64_t rows, int64_t m, int64_t n) {
    block_rows(a, la, rows, P1 + n, N, Kp, c, pf);
    round_rows(c, rows, r1);
    block_rows(a, la, rows, P3 + n, N, Kp, c, pf);
    round_rows(c, rows, r3);
    if (h1) copy_rows(r1, rows, h1 + m * ldo + n, ldo, stream);
    if (h3) copy_rows(r3, rows, h3 + m * ldo + n, ldo, stream);
    act(r1, r3, rows, m, n);
  });
  if (stream) _mm_sfence();
}

MHMOE_AMX_TARGET inline void release() { _tile_release(); }

}  // namespace mhmoe_native::amx_gemm

#endif
