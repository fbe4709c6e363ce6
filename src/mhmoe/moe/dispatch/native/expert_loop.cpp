// The CPU expert loop of the fused MoE path in C++: every expert's GEMMs (ATen's, so oneDNN / MKL as in
// Python) with the SwiGLU / ReLU element-wise work fused into one vectorised pass per direction, experts
// spread over the intra-op threads (whole experts per thread, each GEMM single-threaded), no Python between
// the kernels. Registered as torch.ops.mhmoe_cpu.{expert_forward, expert_backward}; the Python path
// (mhmoe/moe/dispatch/fused.py) is the same computation op for op and the reference the tests hold it to.
// With `gemm` = kDot (bf16 experts on CPUs with AVX-512 BF16 and no AMX, decided in Python: native.dot_gemm) the
// GEMMs run on the dot-product kernel of dot_gemm.h instead of at::mm; with kAmx (bf16 experts on CPUs with AMX,
// native.expert_gemm) on the AMX tiles of amx_gemm.h. Under bf16 autocast the weights may stay fp32 for bf16 rows:
// each expert's matrices are rounded to bf16 (as Tensor.to does) as they are used (the own kernels while packing
// them, ATen's GEMMs on a cast of the matrix), and every fp32 weight gradient is the bf16 product widened (matmul):
// the numbers of casting the weights first (tests/moe/test_native_fp32_weights.py).
//
// Shape legend: R rows of the expert-grouped buffer (expert e owns rows [starts[e], starts[e] + sizes[e])),
// D expert width, F expert hidden width, E experts, C rows of one expert.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "amx_gemm.h"
#include "dot_gemm.h"
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
using mhmoe_native::swiglu_backward;
using mhmoe_native::swiglu_forward;

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
void for_b_panels(const Tensor& b, int64_t KK, int64_t NB, const Body& body, int64_t operands = 1) {
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
void matmul(Tensor out, const Tensor& a, const Tensor& b, bool add, int64_t gemm, const Tensor& next = Tensor(),
            bool stream = false) {
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
bool fused_glu_up(const Tensor& a1, const Tensor& a3, Tensor& act, const Tensor& x, const Tensor& w1,
                  const Tensor& w3, const Tensor& next, bool keep, int64_t gemm) {
#ifdef MHMOE_AMX_GEMM
  if (gemm == kAmx && AmxGemm::fits_glu(act, x, w1, w3)) {
    AmxGemm::run_glu(keep ? a1 : Tensor(), keep ? a3 : Tensor(), act, x, w1, w3, next);
    return true;
  }
#endif
  return false;
}

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
