// The router's top-k on a CPU: the k largest scores of every row, best first, in one pass over the row
// (ATen's CPU topk copies each row into (value, index) pairs and runs nth_element + sort on them: ~1 us per
// row of 96 experts). Rows where equal scores or a NaN make torch.topk's choice or order depend on its
// algorithm are flagged, and the caller lets torch.topk decide those rows (mhmoe.moe.dispatch.native), so the
// result is torch.topk's on every row. Registered as torch.ops.mhmoe_cpu.topk_rows.
//
// Shape legend: S rows (routed sub-tokens), E scores per row (experts), K kept per row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

namespace {

using at::Tensor;
constexpr int64_t kMaxK = 16;

// A row's k + 1 largest scores so far, best first (insertion; equal values keep the earlier expert first).
struct Best {
  float v[kMaxK + 1];
  int64_t id[kMaxK + 1];
  int64_t len = 0, keep;
  explicit Best(int64_t keep_) : keep(keep_) {}
  void offer(float x, int64_t e) {
    if (len == keep && !(x > v[keep - 1])) return;
    int64_t j = len < keep ? len++ : keep - 1;
    for (; j > 0 && x > v[j - 1]; --j) {
      v[j] = v[j - 1];
      id[j] = id[j - 1];
    }
    v[j] = x;
    id[j] = e;
  }
};

// One row: ids[0..K) of its K largest scores, best first; true where a NaN or two equal values among the
// K + 1 largest leave the choice or the order to torch.topk's tie handling. After the first K + 1 scores, a
// vector of scores is only looked at one by one where one of them beats the current (K + 1)-th best.
bool top_of_row(const float* row, int64_t E, int64_t K, int64_t* ids) {
  using fVec = at::vec::Vectorized<float>;
  constexpr int64_t W = fVec::size();
  constexpr int kAll = (1 << W) - 1;
  Best best(K + 1);  // one more than K: a tie at the boundary decides which expert gets in
  int64_t e = 0;
  for (; e < E && best.len < best.keep; ++e) {
    if (std::isnan(row[e])) return true;
    best.offer(row[e], e);
  }
  for (; e + W <= E; e += W) {
    const fVec x = fVec::loadu(row + e);
    if ((x == x).zero_mask()) return true;  // a NaN
    int hits = ~(x > fVec(best.v[best.keep - 1])).zero_mask() & kAll;
    for (; hits; hits &= hits - 1) {
      const int64_t i = e + __builtin_ctz(hits);
      best.offer(row[i], i);
    }
  }
  for (; e < E; ++e) {
    if (std::isnan(row[e])) return true;
    best.offer(row[e], e);
  }
  for (int64_t j = 0; j < K; ++j) ids[j] = best.id[j];
  for (int64_t j = 0; j < K; ++j)
    if (best.v[j] == best.v[j + 1]) return true;
  return false;
}

// scores [S, E] float32 contiguous -> (ids [S, K] int64, tied [S] bool); 1 <= K < E, K <= 16.
std::tuple<Tensor, Tensor> topk_rows(const Tensor& scores, int64_t k) {
  TORCH_CHECK(scores.dim() == 2 && scores.is_contiguous() && scores.scalar_type() == at::kFloat,
              "topk_rows: scores must be a contiguous float32 [S, E] tensor");
  const int64_t S = scores.size(0), E = scores.size(1);
  TORCH_CHECK(k >= 1 && k < E && k <= kMaxK, "topk_rows: need 1 <= k < E and k <= ", kMaxK, ", got k=", k,
              " for E=", E);
  Tensor ids = at::empty({S, k}, scores.options().dtype(at::kLong));
  Tensor tied = at::empty({S}, scores.options().dtype(at::kBool));
  const float* p = scores.const_data_ptr<float>();
  int64_t* ip = ids.mutable_data_ptr<int64_t>();
  bool* tp = tied.mutable_data_ptr<bool>();
  at::parallel_for(0, S, 512, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) tp[s] = top_of_row(p + s * E, E, k, ip + s * k);
  });
  return {ids, tied};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhmoe_cpu, m) {
  m.def("topk_rows(Tensor scores, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("topk_rows", &topk_rows);
}
