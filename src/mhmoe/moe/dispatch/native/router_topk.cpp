// The router's top-k on a CPU: the k largest scores of every row, best first, in one vectorised pass over the
// row (ATen's CPU topk copies each row into (value, index) pairs and runs nth_element + sort on them: ~0.9 us
// per row of 96 experts, ~0.11 us here). Rows where equal scores or a NaN make torch.topk's choice or order
// depend on its algorithm are flagged, and the caller lets torch.topk decide those rows
// (mhmoe.moe.dispatch.native), so the result is torch.topk's on every row. Registered as torch.ops.mhmoe_cpu.topk_rows.
// The softmax router's whole per-row work around it (softmax, top-k, combine weights) and its backward:
// torch.ops.mhmoe_cpu.softmax_topk / softmax_topk_backward (mhmoe/moe/dispatch/native/router.py).
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
#include <vector>

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

// The softmax router's per-row work after its score GEMM, in one pass per row (mhmoe/moe/dispatch/native/router.py):
// probs = softmax(logits) (ATen's formula: exp(l - max) times the reciprocal of their sum), the top-k of
// probs + bias (as topk_rows: tied rows flagged for torch.topk), weights = the chosen probs, divided by their sum
// (floored at 1e-9) when `renorm`, times the token mask; and the reductions the router losses read: each row's
// logsumexp (max + log of the sum) and entropy (log of the sum minus the probs' mean of l - max: -sum p log p
// without a log per element), and the routed rows' sum of probs per expert.
// softmax_row: p = softmax(l); returns log(sum of exp(l - max)) and writes max to *mx_out.
float softmax_row(const float* l, float* p, int64_t E, float* mx_out) {
  const int64_t full = E / W * W, rest = E - full;
  const fVec ninf(-std::numeric_limits<float>::infinity());
  fVec mx = ninf;
  for (int64_t e = 0; e < full; e += W) mx = at::vec::maximum(mx, fVec::loadu(l + e));
  if (rest) mx = at::vec::maximum(mx, fVec::set(ninf, fVec::loadu(l + full, rest), rest));
  const float mxs = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, mx);
  const fVec m(mxs);
  fVec sum(0.f);
  for (int64_t e = 0; e < full; e += W) {
    const fVec x = (fVec::loadu(l + e) - m).exp();
    x.store(p + e);
    sum = sum + x;
  }
  if (rest) {
    const fVec x = fVec::set(fVec(0.f), (fVec::loadu(l + full, rest) - m).exp(), rest);
    x.store(p + full, rest);
    sum = sum + x;
  }
  const float total = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return a + b; }, sum);
  const fVec inv(1.f / total);
  for (int64_t e = 0; e < full; e += W) (fVec::loadu(p + e) * inv).store(p + e);
  if (rest) (fVec::loadu(p + full, rest) * inv).store(p + full, rest);
  *mx_out = mxs;
  return std::log(total);
}

// -sum_e p_e log p_e of a softmax row p of logits l with max m and log-sum `log_sum`: log p_e = l_e - m - log_sum, so
// the entropy is log_sum - sum_e p_e (l_e - m) (p_e = 0 adds nothing, as p log p -> 0).
float row_entropy(const float* l, const float* p, int64_t E, float m, float log_sum) {
  const fVec mv(m);
  const float mean = at::vec::map2_reduce_all<float>([mv](fVec x, fVec y) {
        return fVec::blendv(x * (y - mv), fVec(0.f), x == fVec(0.f)); },
      [](fVec a, fVec b) { return a + b; }, p, l, E);
  return log_sum - mean;
}

constexpr int64_t kRowBlock = 256;  // rows per parallel block: the probs' per-expert sums add block partials in order

// logits [S, E] float32 contiguous, bias [E] float32 or undefined, mask [S] bool -> (probs [S, E], weights [S, K],
// ids [S, K] int64, tied [S] bool, lse [S], entropy [S], prob_sum [E]); 1 <= K < E, K <= kMaxK. prob_sum sums the
// rows of mask's tokens, per block of kRowBlock rows and the blocks in order: the same numbers on any thread count.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> softmax_topk(
    const Tensor& logits, const std::optional<Tensor>& bias, const Tensor& mask, int64_t k, bool renorm) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
              "softmax_topk: logits must be a contiguous float32 [S, E] tensor");
  const int64_t S = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k < E && k <= kMaxK && E < (1 << 24), "softmax_topk: need 1 <= k < E, k <= ", kMaxK);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == S, "softmax_topk: mask [S] bool");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == E), "softmax_topk: bias [E] float32");
  const auto f32 = logits.options();
  Tensor probs = at::empty_like(logits), weights = at::empty({S, k}, f32);
  Tensor ids = at::empty({S, k}, f32.dtype(at::kLong)), tied = at::empty({S}, mask.options());
  Tensor lse = at::empty({S}, f32), ent = at::empty({S}, f32);
  const int64_t blocks = (S + kRowBlock - 1) / kRowBlock;
  Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), E}, f32);
  const Tensor b = bias ? bias->contiguous() : Tensor(), m = mask.contiguous();
  const float *lp = logits.const_data_ptr<float>(), *bp = bias ? b.const_data_ptr<float>() : nullptr;
  const bool* mp = m.const_data_ptr<bool>();
  float *pp = probs.mutable_data_ptr<float>(), *wp = weights.mutable_data_ptr<float>();
  float *lsep = lse.mutable_data_ptr<float>(), *entp = ent.mutable_data_ptr<float>();
  float* partp = partial.mutable_data_ptr<float>();
  int64_t* ip = ids.mutable_data_ptr<int64_t>();
  bool* tp = tied.mutable_data_ptr<bool>();
  const RowFn top = row_kernel(k, std::make_integer_sequence<int64_t, kMaxK>{});
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> choice(bp ? E : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      float* col = partp + blk * E;
      for (int64_t s = blk * kRowBlock; s < std::min(S, (blk + 1) * kRowBlock); ++s) {
        float* p = pp + s * E;
        float mx;
        const float log_sum = softmax_row(lp + s * E, p, E, &mx);
        lsep[s] = mx + log_sum;
        entp[s] = row_entropy(lp + s * E, p, E, mx, log_sum);
        if (mp[s]) at::vec::map2([](fVec x, fVec y) { return x + y; }, col, col, p, E);
        if (bp) at::vec::map2([](fVec x, fVec y) { return x + y; }, choice.data(), p, bp, E);
        tp[s] = top(bp ? choice.data() : p, E, ip + s * k);
        float* w = wp + s * k;
        if (tp[s]) {  // the ids may be unset: the caller runs torch.topk's rule instead
          std::fill(ip + s * k, ip + (s + 1) * k, int64_t{0});
          std::fill(w, w + k, 0.f);
          continue;
        }
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) sum += (w[j] = p[ip[s * k + j]]);
        const float den = std::max(sum, 1e-9f);
        for (int64_t j = 0; j < k; ++j) w[j] = mp[s] ? (renorm ? w[j] / den : w[j]) : 0.f;
      }
    }
  });
  Tensor prob_sum = partial[0].clone();
  float* ps = prob_sum.mutable_data_ptr<float>();
  for (int64_t blk = 1; blk < blocks; ++blk)
    at::vec::map2([](fVec x, fVec y) { return x + y; }, ps, ps, partp + blk * E, E);
  return {probs, weights, ids, tied, lse, ent, prob_sum};
}

// The gradient of softmax_topk's probs, weights, lse, entropy and prob_sum with respect to the logits: dlogits [S, E]
// from logits and probs [S, E], lse [S], ids [S, K], mask [S] and the gradients g_probs [S, E], g_weights [S, K],
// g_lse [S], g_ent [S] and g_sum [E] (any undefined: zero). On each row: the gradient on probs g (g_probs, the
// weights', mask * g_sum and the entropy's -g_ent (log p + 1), log p = l - lse), then dl = p (g - p.g + g_lse).
Tensor softmax_topk_backward(const Tensor& logits, const Tensor& probs, const Tensor& lse, const Tensor& ids,
                             const Tensor& mask, const std::optional<Tensor>& g_probs,
                             const std::optional<Tensor>& g_weights, const std::optional<Tensor>& g_lse,
                             const std::optional<Tensor>& g_ent, const std::optional<Tensor>& g_sum, bool renorm) {
  const int64_t S = probs.size(0), E = probs.size(1), k = ids.size(1);
  TORCH_CHECK(probs.is_contiguous() && probs.scalar_type() == at::kFloat && ids.scalar_type() == at::kLong &&
              ids.size(0) == S && mask.numel() == S && logits.sizes() == probs.sizes() && logits.is_contiguous() &&
              logits.scalar_type() == at::kFloat && lse.numel() == S && lse.scalar_type() == at::kFloat,
              "softmax_topk_backward: shapes");
  const auto opt = [](const std::optional<Tensor>& t) { return t ? t->contiguous() : Tensor(); };
  const Tensor gp = opt(g_probs), gw = opt(g_weights), gl = opt(g_lse), ge = opt(g_ent), gs = opt(g_sum);
  TORCH_CHECK(!gp.defined() || (gp.sizes() == probs.sizes() && gp.scalar_type() == at::kFloat), "g_probs [S, E]");
  TORCH_CHECK(!gw.defined() || (gw.sizes() == ids.sizes() && gw.scalar_type() == at::kFloat), "g_weights [S, K]");
  for (const Tensor* t : {&gl, &ge})
    TORCH_CHECK(!t->defined() || (t->numel() == S && t->scalar_type() == at::kFloat), "g_lse / g_ent [S]");
  TORCH_CHECK(!gs.defined() || (gs.numel() == E && gs.scalar_type() == at::kFloat), "g_sum [E]");
  Tensor dl = at::empty_like(probs);
  const Tensor ic = ids.contiguous(), m = mask.contiguous(), lsec = lse.contiguous();
  const auto ptr = [](const Tensor& t) { return t.defined() ? t.const_data_ptr<float>() : nullptr; };
  const float *pp = probs.const_data_ptr<float>(), *lp = logits.const_data_ptr<float>(), *lsep = ptr(lsec);
  const float *gpp = ptr(gp), *gwp = ptr(gw), *glp = ptr(gl), *gep = ptr(ge), *gsp = ptr(gs);
  const int64_t* ip = ic.const_data_ptr<int64_t>();
  const bool* mp = m.const_data_ptr<bool>();
  float* dp = dl.mutable_data_ptr<float>();
  at::parallel_for(0, S, 256, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* p = pp + s * E;
      float* g = dp + s * E;  // the gradient on probs, then on the logits
      if (gpp)
        std::copy(gpp + s * E, gpp + (s + 1) * E, g);
      else
        std::fill(g, g + E, 0.f);
      if (gsp && mp[s]) at::vec::map2([](fVec x, fVec y) { return x + y; }, g, g, gsp, E);
      if (gep && gep[s] != 0.f) {  // d(-p log p)/dp = -(log p + 1), log p = l - lse, floored as log(p + tiny) is
        const fVec c(-gep[s]), lse_s(lsep[s]), one(1.f), floor(std::log(std::numeric_limits<float>::min()));
        at::vec::map2([=](fVec x, fVec l) { return x + c * (at::vec::maximum(l - lse_s, floor) + one); }, g, g,
                      lp + s * E, E);
      }
      if (gwp && mp[s]) {
        const int64_t* id = ip + s * k;
        const float* gws = gwp + s * k;
        float sum = 0.f, dot = 0.f;
        for (int64_t j = 0; j < k; ++j) sum += p[id[j]], dot += gws[j] * p[id[j]];
        const bool floor = sum < 1e-9f;  // w = raw / 1e-9: the sum's gradient is zero
        const float den = renorm ? std::max(sum, 1e-9f) : 1.f;
        for (int64_t j = 0; j < k; ++j)
          g[id[j]] += renorm ? (floor ? gws[j] / den : gws[j] / den - dot / (den * den)) : gws[j];
      }
      const float dot = at::vec::map2_reduce_all<float>([](fVec x, fVec y) { return x * y; },
                                                        [](fVec x, fVec y) { return x + y; }, g, p, E);
      const fVec shift(dot - (glp ? glp[s] : 0.f));
      at::vec::map2([shift](fVec x, fVec y) { return y * (x - shift); }, g, g, p, E);
    }
  });
  return dl;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mhmoe_cpu, m) {
  m.def("topk_rows(Tensor scores, int k) -> (Tensor, Tensor)");
  m.def("softmax_topk(Tensor logits, Tensor? bias, Tensor mask, int k, bool renorm) -> (Tensor, Tensor, Tensor, "
        "Tensor, Tensor, Tensor, Tensor)");
  m.def("softmax_topk_backward(Tensor logits, Tensor probs, Tensor lse, Tensor ids, Tensor mask, Tensor? g_probs, "
        "Tensor? g_weights, Tensor? g_lse, Tensor? g_ent, Tensor? g_sum, bool renorm) -> Tensor");
}

TORCH_LIBRARY_IMPL(mhmoe_cpu, CPU, m) {
  m.impl("topk_rows", &topk_rows);
  m.impl("softmax_topk", &softmax_topk);
  m.impl("softmax_topk_backward", &softmax_topk_backward);
}
