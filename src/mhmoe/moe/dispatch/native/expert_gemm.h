// One expert GEMM of the C++ expert loop (expert_loop.cpp) on the back end the loop was given: ATen's at::mm
// (oneDNN / MKL), the AVX-512 BF16 dot-product kernel of dot_gemm.h, or the AMX tiles of amx_gemm.h; the right
// operand packed into K-pairs in L2-sized column panels for the own kernels; fp32 weights (bf16 autocast) rounded to
// bf16 while packed and fp32 weight gradients widened from the bf16 product (matmul). A SwiGLU expert's two
// up-projections and its activation in one pass on the AMX tiles (fused_glu_up).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "amx_gemm.h"
#include "dot_gemm.h"
#include "swiglu.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace mhmoe_native {

using at::Tensor;

// Where an expert's GEMMs run (decided in Python: native.expert_gemm).
enum Gemm : int64_t { kAten = 0, kDot = 1, kAmx = 2 };

// Outputs of the forward at least this large (bytes, all experts) are written past the cache (larger than the L2 of
// the CPUs measured: 1-2 MiB a core); smaller ones stay in cache for the combine that reads them next.
constexpr int64_t kStreamOutputBytes = int64_t{4} << 20;

#ifdef MHMOE_DOT_GEMM
// n 32-bit elements of per-thread scratch `buf` (grown as needed), starting on a cache line: a std::vector's buffer is
// only 16-byte aligned, and the own kernels' 64-byte tile and vector loads from a misaligned one each touch two lines
// (the AMX kernel ran at about half speed in the processes whose large buffers the allocator placed so).
inline uint32_t* cache_aligned(std::vector<uint32_t>& buf, int64_t n) {
  if ((int64_t)buf.size() < n + 16) buf.resize(n + 16);
  const auto p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<uint32_t*>((p + 63) & ~uintptr_t{63});
}

// dst[r][c] (row stride ldd) = bf16(src[r][c]) (row stride lds) for r < rows, c < cols: fp32 rounded to bf16 as
// Tensor.to(torch.bfloat16) rounds (ATen's conversion, nearest even).
inline void round_rows_bf16(const float* src, int64_t lds, int64_t rows, int64_t cols, at::BFloat16* dst,
                            int64_t ldd) {
  constexpr int64_t W = 2 * mhmoe_native::fVec::size();
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    at::BFloat16* d = dst + r * ldd;
    int64_t c = 0;
#ifdef MHMOE_DOT_GEMM
    if (mhmoe_native::dot_gemm::supported()) c = mhmoe_native::dot_gemm::round_bf16(s, cols, d);
#endif
    for (; c + W <= cols; c += W) {
      mhmoe_native::fVec a, b;
      mhmoe_native::load2(s + c, a, b);
      mhmoe_native::store2(d + c, a, b);
    }
    for (; c < cols; ++c) d[c] = at::BFloat16(s[c]);
  }
}

// Columns [n0, n0 + np) of the own kernels' right operand B [K, N] (row-major, or a transposed view of a row-major
// matrix with K even and rows 4-byte aligned) as K-pairs into P [KK][np], the pair rows past K's zero. An fp32 B
// (a weight under bf16 autocast) is rounded to bf16 on the way, as Tensor.to(torch.bfloat16) rounds it: the panel's
// elements into per-thread scratch first, then packed from there.
inline void pack_b_panel(const Tensor& b, int64_t n0, int64_t np, int64_t KK, uint32_t* P) {
  namespace dg = mhmoe_native::dot_gemm;
  const int64_t K = b.size(0), KKb = (K + 1) / 2;  // KKb pair rows hold B
  if (b.scalar_type() == at::kFloat) {
    thread_local std::vector<uint32_t> scratch;
    auto* bf = reinterpret_cast<at::BFloat16*>(cache_aligned(scratch, (K * np + 1) / 2));
    const auto* rounded = reinterpret_cast<const uint16_t*>(bf);
    const float* src = b.const_data_ptr<float>();
    if (b.stride(1) == 1) {  // B's rows, columns [n0, n0 + np) -> [K, np]
      round_rows_bf16(src + n0, b.stride(0), K, np, bf, np);
      dg::pack_row_pairs(rounded, np, K, np, P);
    } else {  // B = w.t() for w [N, K] row-major: w's rows [n0, n0 + np) -> [np, K]
      round_rows_bf16(src + n0 * b.stride(1), b.stride(1), np, K, bf, K);
      dg::pack_col_pairs(reinterpret_cast<const uint32_t*>(rounded), K / 2, KKb, np, P);
    }
  } else {
    const auto* bp = reinterpret_cast<const uint16_t*>(b.const_data_ptr<at::BFloat16>());
    if (b.stride(1) == 1)
      dg::pack_row_pairs(bp + n0, b.stride(0), K, np, P);
    else
      dg::pack_col_pairs(reinterpret_cast<const uint32_t*>(bp + n0 * b.stride(1)), b.stride(1) / 2, KKb, np, P);
  }
  std::fill(P + KKb * np, P + KK * np, 0u);
}

// Whether the own kernels can take b as their right operand (pack_b_panel): bf16, or fp32 (rounded while packed)
// when a is bf16; row-major, or a transposed view of a row-major matrix with K even (bf16: rows 4-byte aligned).
inline bool packable(const Tensor& a, const Tensor& b) {
  const int64_t K = b.size(0);
  const bool f32 = b.scalar_type() == at::kFloat && a.scalar_type() == at::kBFloat16;
  if (!f32 && b.scalar_type() != at::kBFloat16) return false;
  if (b.stride(1) == 1) return true;
  const bool aligned = f32 || reinterpret_cast<uintptr_t>(b.const_data_ptr()) % 4 == 0;
  return b.stride(0) == 1 && K % 2 == 0 && b.stride(1) % 2 == 0 && aligned;
}

// B [K, N] (as pack_b_panel takes it) packed and used one column panel at a time, each small enough to stay in L2
// from its packing to its last use, with `operands` such panels at once (a whole [768, 2048] weight packed at once
// would be read back from L3 or memory). Called outside a parallel region (the loop with one lane), the panels are
// spread over the intra-op threads, at least one each. body(n0, np, pb) gets B's columns [n0, n0 + np) packed
// (pack_b_panel) in per-thread scratch; NB divides every panel's width but the last; a Scope object lives around
// each thread's panels.
template <class Scope, class Body>
inline void for_b_panels(const Tensor& b, int64_t KK, int64_t NB, const Body& body, int64_t operands = 1) {
  namespace dg = mhmoe_native::dot_gemm;
  const int64_t N = b.size(1);
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t NP = std::min(N, std::max<int64_t>(NB, dg::L2_B / (KK * 4 * operands) / NB * NB));
  if (threads > 1) NP = std::min(NP, std::max<int64_t>(NB, (N / threads + NB - 1) / NB * NB));
  const auto panels = [&](int64_t p0, int64_t p1) {  // column panels [p0, p1)
    thread_local std::vector<uint32_t> scratch;
    uint32_t* pb = cache_aligned(scratch, KK * NP);
    [[maybe_unused]] Scope scope;
    for (int64_t n0 = p0 * NP; n0 < std::min(N, p1 * NP); n0 += NP) {
      const int64_t np = std::min(NP, N - n0);
      pack_b_panel(b, n0, np, KK, pb);
      body(n0, np, static_cast<const uint32_t*>(pb));
    }
  };
  const int64_t count = (N + NP - 1) / NP;
  if (threads > 1 && count > 1)
    at::parallel_for(0, count, 1, panels);
  else
    panels(0, count);
}

struct NoScope {};

// `next` (what the caller reads after this GEMM: the next weight matrix) for the own kernels to pull into the cache
// during it, where it is one contiguous block (else nothing), shared out over B's column panels.
struct PrefetchHint {
  const char* p = nullptr;
  int64_t bytes = 0;
  explicit PrefetchHint(const Tensor& next) {
    if (next.defined() && next.is_contiguous())
      p = static_cast<const char*>(next.const_data_ptr()), bytes = next.numel() * next.element_size();
  }
  // the share of the panel of columns [n0, n0 + np) of N: its start (null: none) and bytes
  std::pair<const char*, int64_t> panel(int64_t n0, int64_t np, int64_t N) const {
    const int64_t b0 = bytes * n0 / N, b1 = bytes * (n0 + np) / N;
    return {p ? p + b0 : nullptr, b1 - b0};
  }
};

// bf16 GEMMs on the AVX-512 BF16 dot-product kernel of dot_gemm.h: out [M, N] contiguous, N a multiple of 32; the
// left operand row-major (its pairs read in place; K even, rows 4-byte aligned) or a transposed view (packed: the
// weight gradients' X^T, K the expert's rows, odd counts padded with a zero pair); the right one row-major or a
// transposed view of a row-major matrix (K even, rows 4-byte aligned), packed into pairs. Per-thread scratch.
struct DotGemm {
  static bool aligned(const Tensor& t, int64_t stride) {
    return stride % 2 == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0;
  }
  static bool fits(const Tensor& out, const Tensor& a, const Tensor& b) {
    const int64_t K = a.size(1), N = b.size(1);
    const bool a_rows = a.stride(1) == 1 && K % 2 == 0 && aligned(a, a.stride(0));
    const bool a_cols = a.stride(0) == 1;
    return mhmoe_native::dot_gemm::supported() && a.scalar_type() == at::kBFloat16 && packable(a, b) &&
           out.scalar_type() == at::kBFloat16 && (a_rows || a_cols) && N % 32 == 0 && out.is_contiguous() &&
           K > 0 && a.size(0) > 0;
  }
  static void run(Tensor& out, const Tensor& a, const Tensor& b, bool add, const Tensor& next, bool stream) {
    RECORD_FUNCTION("mhmoe::dot_gemm", std::vector<c10::IValue>());  // a profiler label (benchmarks/moe_profile.py)
    namespace dg = mhmoe_native::dot_gemm;
    const int64_t M = a.size(0), K = a.size(1), N = b.size(1), KK = (K + 1) / 2;
    const auto* ap = reinterpret_cast<const uint16_t*>(a.const_data_ptr<at::BFloat16>());
    auto* o = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
    const PrefetchHint hint(next);
    const uint32_t* A = reinterpret_cast<const uint32_t*>(ap);
    int64_t a_row = a.stride(0) / 2, a_k = 1;
    thread_local std::vector<uint32_t> scratch;
    if (a.stride(0) == 1) {  // a = t.t() for a row-major t [K, M]: t's rows in pairs, element (i, kk) at kk * M + i
      uint32_t* pa = cache_aligned(scratch, KK * M);
      dg::pack_row_pairs(ap, a.stride(1), K, M, pa);
      A = pa, a_row = 1, a_k = M;
    }
    for_b_panels<NoScope>(b, KK, dg::NB, [&](int64_t n0, int64_t np, const uint32_t* pb) {
      const auto [pf, pf_bytes] = hint.panel(n0, np, N);
      dg::gemm(A, a_row, a_k, pb, M, np, KK, o + n0, N, add, pf, pf_bytes, stream);
    });
  }
};
#endif

#ifdef MHMOE_AMX_GEMM
// The AMX tile configuration, loaded for a thread's panels and released after them.
struct TileScope {
  TileScope() { mhmoe_native::amx_gemm::configure(); }
  ~TileScope() { mhmoe_native::amx_gemm::release(); }
};

// bf16 GEMMs on AMX tiles (amx_gemm.h): out [M, N] contiguous, N a multiple of 32; the left operand any layout (read
// in place when row-major with K a multiple of 32, but, where M is not a multiple of 16, for its last M % 32 rows;
// else copied into a zero-padded block, a transposed view made contiguous first); the right one row-major or a
// transposed view of a row-major matrix (K even, rows 4-byte aligned), packed into pairs panel by panel
// (for_b_panels).
struct AmxGemm {
  static bool fits(const Tensor& out, const Tensor& a, const Tensor& b) {
    const int64_t K = a.size(1), N = b.size(1);
    return mhmoe_native::amx_gemm::supported() && a.scalar_type() == at::kBFloat16 && packable(a, b) &&
           out.scalar_type() == at::kBFloat16 && N % 32 == 0 && out.is_contiguous() && K > 0 && a.size(0) > 0;
  }
  // The left operand as the tiles read it: A row-major [.., Kp] (stride lda), in place or a zero-padded copy, and
  // `tail`, where M is not a multiple of 16, a zero-padded copy of its last M % 32 rows (amx_gemm::for_blocks).
  struct Left {
    Tensor padded;
    const uint16_t* A = nullptr;
    const uint16_t* tail = nullptr;
    int64_t lda = 0;
  };
  static Left left(const Tensor& a, int64_t Kp) {
    namespace ag = mhmoe_native::amx_gemm;
    namespace dg = mhmoe_native::dot_gemm;
    const int64_t M = a.size(0), K = a.size(1), KK = Kp / 2, full = M / ag::MB * ag::MB;
    Left l;
    l.lda = Kp;
    if (a.stride(1) == 1 && K % ag::KB == 0) {
      l.A = reinterpret_cast<const uint16_t*>(a.const_data_ptr<at::BFloat16>()), l.lda = a.stride(0);
      if (M % 16 != 0) {  // rows the tiles cannot read in place
        l.padded = at::zeros({ag::MB, Kp}, a.options());
        l.padded.narrow(0, 0, M - full).copy_(a.narrow(0, full, M - full));
        l.tail = reinterpret_cast<const uint16_t*>(l.padded.const_data_ptr<at::BFloat16>());
      }
      return l;
    }
    const int64_t Mp = (M + ag::MB - 1) / ag::MB * ag::MB;
    if (a.stride(0) == 1) {  // a = t.t(), t [K, M] row-major: t's rows in pairs, then those transposed
      const int64_t KKa = (K + 1) / 2;
      thread_local std::vector<uint32_t> scratch;
      uint32_t* pairs = cache_aligned(scratch, KK * M);
      dg::pack_row_pairs(reinterpret_cast<const uint16_t*>(a.const_data_ptr<at::BFloat16>()), a.stride(1), K, M,
                         pairs);
      std::fill(pairs + KKa * M, pairs + KK * M, 0u);
      l.padded = at::empty({Mp, Kp}, a.options());
      auto* rows = reinterpret_cast<uint32_t*>(l.padded.mutable_data_ptr<at::BFloat16>());
      dg::pack_col_pairs(pairs, M, M, KK, rows);  // [KK][M] pairs -> [M][KK]: A's rows, K zero-padded
      std::fill(rows + M * KK, rows + Mp * KK, 0u);
    } else {
      l.padded = at::zeros({Mp, Kp}, a.options());
      l.padded.narrow(0, 0, M).narrow(1, 0, K).copy_(a);
    }
    l.A = reinterpret_cast<const uint16_t*>(l.padded.const_data_ptr<at::BFloat16>());
    l.tail = l.A + full * Kp;
    return l;
  }
  static int64_t padded_k(int64_t K) {
    namespace ag = mhmoe_native::amx_gemm;
    return (K + ag::KB - 1) / ag::KB * ag::KB;
  }
  static void run(Tensor& out, const Tensor& a, const Tensor& b, bool add, const Tensor& next, bool stream) {
    RECORD_FUNCTION("mhmoe::amx_gemm", std::vector<c10::IValue>());  // a profiler label (benchmarks/moe_profile.py)
    namespace ag = mhmoe_native::amx_gemm;
    const int64_t M = a.size(0), N = b.size(1), Kp = padded_k(a.size(1));
    const Left l = left(a, Kp);
    auto* o = reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>());
    const PrefetchHint hint(next);
    for_b_panels<TileScope>(b, Kp / 2, ag::NB, [&](int64_t n0, int64_t np, const uint32_t* pb) {
      const auto [pf, pf_bytes] = hint.panel(n0, np, N);
      ag::gemm(l.A, l.lda, l.tail, pb, M, np, Kp, o + n0, N, add, stream, pf, pf_bytes);
    });
  }
  // A SwiGLU expert's up-projection and activation in one pass (amx_gemm::gemm_glu): h1 = x · w1 and h3 = x · w3
  // (written where defined, else not kept), act = silu(h1) * h3 over the bf16 h1, h3, as swiglu_forward computes it
  // from them (bit for bit); every output [C, F] contiguous, w1 and w3 laid out alike.
  static bool fits_glu(const Tensor& act, const Tensor& x, const Tensor& w1, const Tensor& w3) {
    return fits(act, x, w1) && w3.strides() == w1.strides();
  }
  static void run_glu(const Tensor& h1, const Tensor& h3, Tensor& act, const Tensor& x, const Tensor& w1,
                      const Tensor& w3, const Tensor& next) {
    RECORD_FUNCTION("mhmoe::amx_gemm", std::vector<c10::IValue>());
    namespace ag = mhmoe_native::amx_gemm;
    using mhmoe_native::swiglu_forward;
    const int64_t M = x.size(0), N = w1.size(1), Kp = padded_k(x.size(1)), KK = Kp / 2;
    const Left l = left(x, Kp);
    auto* o1 = h1.defined() ? reinterpret_cast<uint16_t*>(h1.data_ptr<at::BFloat16>()) : nullptr;
    auto* o3 = h3.defined() ? reinterpret_cast<uint16_t*>(h3.data_ptr<at::BFloat16>()) : nullptr;
    auto* a = act.mutable_data_ptr<at::BFloat16>();
    const PrefetchHint hint(next);
    for_b_panels<TileScope>(w1, KK, ag::NB, [&](int64_t n0, int64_t np, const uint32_t* p1) {
      thread_local std::vector<uint32_t> scratch;  // w3's panel beside w1's
      uint32_t* p3 = cache_aligned(scratch, KK * np);
      pack_b_panel(w3, n0, np, KK, p3);
      const auto [pf, pf_bytes] = hint.panel(n0, np, N);
      const auto epilogue = [&](const uint16_t* r1, const uint16_t* r3, int64_t rows, int64_t m, int64_t n) {
        for (int64_t i = 0; i < rows; ++i)
          swiglu_forward<at::BFloat16>(reinterpret_cast<const at::BFloat16*>(r1 + i * ag::NB),
                                       reinterpret_cast<const at::BFloat16*>(r3 + i * ag::NB),
                                       a + (m + i) * N + n0 + n, ag::NB);
      };
      ag::gemm_glu(l.A, l.lda, l.tail, p1, p3, M, np, Kp, o1 ? o1 + n0 : nullptr, o3 ? o3 + n0 : nullptr, N,
                   pf, pf_bytes, epilogue);
    }, 2);
  }
};
#endif

// dst [n] fp32 = src [n] bf16 (exact); `stream`: around the cache where dst starts on a cache line (AVX-512 builds).
inline void widen_bf16(const at::BFloat16* src, float* dst, int64_t n, bool stream) {
  constexpr int64_t W = 2 * mhmoe_native::fVec::size();
  int64_t i = 0;
#if defined(__AVX512F__)
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    for (; i + W <= n; i += W) {
      mhmoe_native::fVec lo, hi;
      mhmoe_native::load2(src + i, lo, hi);
      _mm512_stream_ps(dst + i, __m512(lo));
      _mm512_stream_ps(dst + i + mhmoe_native::fVec::size(), __m512(hi));
    }
    _mm_sfence();
  }
#endif
  for (; i + W <= n; i += W) {
    mhmoe_native::fVec lo, hi;
    mhmoe_native::load2(src + i, lo, hi);
    mhmoe_native::store2(dst + i, lo, hi);
  }
  for (; i < n; ++i) dst[i] = float(src[i]);
}

// out = a · b (add: out += a · b, rounded once as addmm_) where `gemm` says, where that kernel fits; else ATen's.
// Hints for the own kernels: `next`, what the caller reads after this GEMM (the next weight matrix), pulled into the
// cache during it; `stream`, an output not read again soon (the weight gradients), written around the cache.
// Under bf16 autocast (bf16 a, fp32 weights): an fp32 b is rounded to bf16 as Tensor.to rounds it (while packed, or
// cast for ATen), and an fp32 `out` (a weight's gradient) gets the bf16 product widened, the numbers of the bf16
// GEMM followed by autograd's cast of the gradient back to the weight's dtype, without the bf16 copies in memory.
inline void matmul(Tensor out, const Tensor& a, const Tensor& b, bool add, int64_t gemm,
                   const Tensor& next = Tensor(), bool stream = false) {
  if (out.scalar_type() != a.scalar_type()) {
    TORCH_CHECK(!add && out.is_contiguous() && out.scalar_type() == at::kFloat && a.scalar_type() == at::kBFloat16,
                "matmul: an fp32 output of bf16 operands is written whole and contiguous");
    thread_local std::vector<uint32_t> scratch;
    Tensor r = at::from_blob(cache_aligned(scratch, (out.numel() + 1) / 2), out.sizes(), a.options());
    matmul(r, a, b, false, gemm, next, false);
    widen_bf16(r.const_data_ptr<at::BFloat16>(), out.mutable_data_ptr<float>(), out.numel(), stream);
    return;
  }
#ifdef MHMOE_AMX_GEMM
  if (gemm == kAmx && AmxGemm::fits(out, a, b)) {
    AmxGemm::run(out, a, b, add, next, stream);
    return;
  }
#endif
#ifdef MHMOE_DOT_GEMM
  if (gemm == kDot && DotGemm::fits(out, a, b)) {
    DotGemm::run(out, a, b, add, next, stream);
    return;
  }
#endif
  const Tensor bb = b.scalar_type() == a.scalar_type() ? b : b.to(a.scalar_type());
  if (add)
    out.addmm_(a, bb);
  else
    at::mm_out(out, a, bb);
}

// A SwiGLU expert's up-projection and activation in one pass where the AMX kernel runs them (AmxGemm::run_glu: a1,
// a3 written only when `keep`, act = silu(a1) * a3 as the separate pass computes it); false where it does not.
inline bool fused_glu_up(const Tensor& a1, const Tensor& a3, Tensor& act, const Tensor& x, const Tensor& w1,
                         const Tensor& w3, const Tensor& next, bool keep, int64_t gemm) {
#ifdef MHMOE_AMX_GEMM
  if (gemm == kAmx && AmxGemm::fits_glu(act, x, w1, w3)) {
    AmxGemm::run_glu(keep ? a1 : Tensor(), keep ? a3 : Tensor(), act, x, w1, w3, next);
    return true;
  }
#endif
  return false;
}

}  // namespace mhmoe_native
