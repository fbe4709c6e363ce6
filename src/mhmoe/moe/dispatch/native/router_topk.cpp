// The router's top-k on a CPU: the k largest scores of every row, best first, in one vectorised pass over the
// row (ATen's CPU topk copies each row into (value, index) pairs and runs nth_element + sort on them: ~0.9 us
// per row of 96 experts, ~0.11 us here). Rows where equal scores or a NaN make torch.topk's choice or order
// depend on its algorithm are flagged, and the caller lets torch.topk decide those rows
// (mhmoe.moe.dispatch.native), so the result is torch.topk's on every row. Registered as torch.ops.mhmoe_cpu.topk_rows.
//
// Shape legend: S rows (routed sub-tokens), E scores per row (experts), K kept per row.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace {

using at::Tensor;
constexpr int64_t kMaxK = 8;  // beyond, the lanes' merge costs more than torch.topk (k = 16 of 32: 937 vs 620 ns)

using fVec = at::vec::Vectorized<float>;
constexpr int64_t W = fVec::size();

// One row: ids[0..K) of its K largest scores, best first; true where a NaN or two equal values among the
// K + 1 largest leave the choice or the order to torch.topk's tie handling. KEEP = K + 1 (a tie at the
// boundary decides which expert gets in). Every vector lane keeps a sorted list of the KEEP largest scores
// it has seen (and their experts, as floats: exact below 2^24) by a compare-exchange chain; the lanes' lists
// are merged at the end. -inf fills the lists and the tail: a -inf among the K + 1 largest is a tie.
template <int64_t KEEP>
bool top_of_row(const float* row, int64_t E, int64_t* ids) {
  const fVec ninf(-std::numeric_limits<float>::infinity()), lane = fVec::arange(0.f, 1.f);
  fVec t[KEEP], id[KEEP];
  for (int64_t j = 0; j < KEEP; ++j) {
    t[j] = ninf;
    id[j] = fVec(0.f);
  }
  fVec nan(0.f);  // lanes that saw a NaN: all bits set
  auto insert = [&](fVec x, fVec xi) {
    for (int64_t j = 0; j < KEEP; ++j) {  // strict >: an equal score stays behind the earlier one
      const fVec m = x > t[j];
      const fVec tj = t[j], ij = id[j];
      t[j] = fVec::blendv(tj, x, m);
      id[j] = fVec::blendv(ij, xi, m);
      x = fVec::blendv(x, tj, m);
      xi = fVec::blendv(xi, ij, m);
    }
  };
  int64_t e = 0;
  for (; e + W <= E; e += W) {
    const fVec x = fVec::loadu(row + e);
    nan = nan | (x != x);
    insert(x, lane + fVec(float(e)));
  }
  if (e < E) {
    const fVec in = lane < fVec(float(E - e)), x = fVec::loadu(row + e, E - e);
    nan = nan | ((x != x) & in);
    insert(fVec::blendv(ninf, x, in), lane + fVec(float(e)));
  }
  if (nan.zero_mask() != (1 << W) - 1) return true;
  // merge: KEEP times take the largest head of the lanes' lists (the lowest such lane) and shift that list up
  float v[KEEP], heads[W];
  for (int64_t r = 0; r < KEEP; ++r) {
    const float best = at::vec::vec_reduce_all<float>(
        [](const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }, t[0]);
    const int l = __builtin_ctz(~(t[0] == fVec(best)).zero_mask());
    v[r] = best;
    if (r + 1 < KEEP) {
      id[0].store(heads);
      ids[r] = std::max<int64_t>(0, int64_t(heads[l]));
    }
    const fVec at_l = lane == fVec(float(l));
    for (int64_t j = 0; j + 1 < KEEP; ++j) {
      t[j] = fVec::blendv(t[j], t[j + 1], at_l);
      id[j] = fVec::blendv(id[j], id[j + 1], at_l);
    }
    t[KEEP - 1] = fVec::blendv(t[KEEP - 1], ninf, at_l);
  }
  for (int64_t r = 0; r + 1 < KEEP; ++r)
    if (v[r] == v[r + 1]) return true;
  return false;
}

using RowFn = bool (*)(const float*, int64_t, int64_t*);

template <int64_t... Keep>
RowFn row_kernel(int64_t k, std::integer_sequence<int64_t, Keep...>) {
  RowFn fns[] = {&top_of_row<Keep + 2>...};  // k = 1 .. kMaxK
  return fns[k - 1];
}

// scores [S, E] float32 contiguous -> (ids [S, K] int64, tied [S] bool); 1 <= K < E, K <= kMaxK.
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
  TORCH_CHECK(E < (1 << 24), "topk_rows: at most 2^24 experts, got E=", E);
  const RowFn top = row_kernel(k, std::make_integer_sequence<int64_t, kMaxK>{});
  at::parallel_for(0, S, 512, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) tp[s] = top(p + s * E, E, ip + s * k);
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
