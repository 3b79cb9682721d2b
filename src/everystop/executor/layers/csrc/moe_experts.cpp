// A sparse mixture-of-experts block (Mixtral, Qwen3-MoE) for a decode-sized batch, inside the
// decoder stack: the ops layers/moe.py's SparseMoeBlock runs with the CPU kernels, in the same
// order on the same values, so the result is bit-identical and only the Python is gone:
//
//   probs = softmax(fp32(h @ router.T)); (weights, ids) = top-k(probs) [/ their sum]
//   for each expert e some row chose, ascending:
//     x = the rows that chose e;  y = silu_mul(x @ gate_up_e.T) @ down_e.T
//     out[row] += fp32(y) * weight(row, e)
//
// Expert e is a row range of the stacked weights (gate_up [E * 2I, H], down [E * H, I]; dense
// or GGUF blocks), multiplied by the decode GEMV: each chosen expert's weights stream once per
// step for all the rows that chose it, and no other expert's are read. The chosen experts run
// in one parallel region, a whole expert per thread at a time. In a prefill pass an expert
// that more rows chose than the GEMV takes (`gemv_rows`, as layers/linear.py's gemv_rows says
// for its weights) multiplies them in fp32 tiles and the library GEMM on its thread instead,
// as the module path's linear() would: the pass's experts never return to Python.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "int_dots.h"
#include "simd.h"

namespace {

// One chosen expert: the rows that chose it (ascending), their routing weights, its output.
struct ExpertRows {
  int64_t expert = 0;
  std::vector<int64_t> rows;
  std::vector<float> weights;
  at::Tensor y;
};

// out[row[i]] += float(y[i]) * w[i] for i in [i0, i1), the product rounded to fp32 before the
// add (as the module path's `out.index_add_(0, rows, y.float() * weights)`): no fused
// multiply-add.
template <typename T>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void add_weighted_rows(float* out, const T* y, int64_t cols, const std::vector<int64_t>& rows,
                       const std::vector<float>& weights, size_t i0, size_t i1) {
  for (size_t i = i0; i < i1; ++i) {
    float* o = out + rows[i] * cols;
    const T* yi = y + static_cast<int64_t>(i) * cols;
    const float w = weights[i];
    for (int64_t c = 0; c < cols; ++c) {
      const float p = static_cast<float>(yi[c]) * w;
      o[c] = o[c] + p;
    }
  }
}

}  // namespace


// --- the experts' GEMVs with int8 activations, two output columns per 512-bit register -----
//
// With int8_decode_dot, fp32 activations and Q8_0/Q4_0 experts, each expert's rows meet its
// blocks through integer dot products as quant_linear.cpp's igemv_columns takes them, but with
// a pair of columns in one 512-bit register: column c's block dot in the low half, c + 1's in
// the high half, x's 32 bytes broadcast to both. The dot, its conversion, its scaling and the
// per-lane accumulation are the same operations on the same values as that kernel's 256-bit
// ones, and each half ends in the same 8-lane sum, so every output is bit-identical to it at
// any row count; the per-row work per column is halved, which is what an expert's few rows at
// 32 streams are bound by. x is rounded once per layer for all experts' gate/up.
#if ES_W == 16 && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define ES_EXPERT_INT_DOTS 1

namespace ES_NS {
void direct_quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d,
                          int32_t* m8);
at::Tensor direct_silu_mul(const at::Tensor& gate_up);
}  // namespace ES_NS

namespace {

constexpr int64_t kBlk = 32;
constexpr int kFmtQ8_0 = 1, kFmtQ4_0 = 2;  // layers/quant.py's format codes
constexpr int64_t kMaxRows = 8;            // rows per pass over a column group's blocks
constexpr int64_t kGroupColumns = 128;     // a column group's blocks stay in L2 across passes

// x [rows, k] rounded to int8 per block (quant_linear.cpp's quantize_rows).
struct Int8Rows {
  int64_t k = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> m8;
  Int8Rows(const float* x, int64_t rows, int64_t k_)
      : k(k_), q(rows * k_), d(rows * (k_ / kBlk)), m8(rows * (k_ / kBlk) * 8) {
    ES_NS::direct_quantize_rows(x, rows, k, q.data(), d.data(), m8.data());
  }
};

inline __m512i pair(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Two blocks' fp16 scales: the first in the low 8 lanes, the second in the high 8.
inline __m512 pair_scales(const uint8_t* b0, const uint8_t* b1) {
  uint16_t h0, h1;
  std::memcpy(&h0, b0, 2);
  std::memcpy(&h1, b1, 2);
  return _mm512_cvtph_ps(_mm256_set_m128i(_mm_set1_epi16(static_cast<short>(h1)),
                                          _mm_set1_epi16(static_cast<short>(h0))));
}

// acc + dot of unsigned bytes u and signed bytes s, each int32 lane summing 4 products.
template <bool kVnni>
inline __m512i dot(__m512i acc, __m512i u, __m512i s) {
  if constexpr (kVnni) {
    return vpdpbusd_512(acc, u, s);  // the caller checked the CPU flag
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                   _mm512_set1_epi16(1)));
  }
}

// out[i, c] = x[rows[i]] . w[c] for i < R and columns [c0, c1), 2P at a time; a last odd
// column is paired with itself. w: blocks of format F, row_bytes per column.
template <bool kVnni, int F, int R, int P>
void pair_columns(const Int8Rows& xq, const int64_t* rows, const uint8_t* w, int64_t row_bytes,
                  int64_t c0, int64_t c1, float* out, int64_t out_stride) {
  constexpr int64_t B = F == kFmtQ8_0 ? 34 : 18;
  const int64_t k = xq.k, nb = k / kBlk;
  for (int64_t n = c0; n < c1; n += 2 * P) {
    if (n + 2 * P > c1 && P > 1) {
      pair_columns<kVnni, F, R, 1>(xq, rows, w, row_bytes, n, c1, out, out_stride);
      return;
    }
    const int64_t last = c1 - 1;
    const uint8_t* col[2 * P];
    for (int j = 0; j < 2 * P; ++j) col[j] = w + std::min(n + j, last) * row_bytes;
    __m512 acc[R][P];
    for (int m = 0; m < R; ++m)
      for (int p = 0; p < P; ++p) acc[m][p] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i wq[P];
      __m512 dw[P];
      for (int p = 0; p < P; ++p) {
        const uint8_t* b0 = col[2 * p] + b * B;
        const uint8_t* b1 = col[2 * p + 1] + b * B;
        __builtin_prefetch(b0 + 2 * P * row_bytes);
        __builtin_prefetch(b1 + 2 * P * row_bytes);
        dw[p] = pair_scales(b0, b1);
        if constexpr (F == kFmtQ8_0)
          wq[p] = pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2)),
                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)));
        else
          wq[p] = pair(nibbles_u8(b0 + 2), nibbles_u8(b1 + 2));
      }
      for (int m = 0; m < R; ++m) {
        const int64_t r = rows[m];
        const __m512i xv = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + r * k + b * kBlk)));
        const __m512 dx = _mm512_set1_ps(xq.d[r * nb + b]);
        // q4_0: the dot starts from -8 * x's lane sums, so it sums (q - 8) * qx exactly.
        __m512i start = _mm512_setzero_si512();
        if constexpr (F == kFmtQ4_0)
          start = _mm512_broadcast_i64x4(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq.m8.data() + (r * nb + b) * 8)));
        for (int p = 0; p < P; ++p) {
          __m512i d;
          if constexpr (F == kFmtQ8_0) {
            // |w| against x with w's sign (as _mm256_sign_epi8; where w is 0 so is |w|).
            const __mmask64 neg = _mm512_movepi8_mask(wq[p]);
            d = dot<kVnni>(start, _mm512_abs_epi8(wq[p]),
                           _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv));
          } else {
            d = dot<kVnni>(start, wq[p], xv);
          }
          acc[m][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dw[p], dx), acc[m][p]);
        }
      }
    }
    for (int m = 0; m < R; ++m) {
      for (int p = 0; p < P; ++p) {
        const int64_t c = n + 2 * p;
        if (c <= last) out[m * out_stride + c] = hsum8(_mm512_castps512_ps256(acc[m][p]));
        if (c + 1 <= last) out[m * out_stride + c + 1] = hsum8(_mm512_extractf32x8_ps(acc[m][p], 1));
      }
    }
  }
}

template <bool kVnni, int F, int R = 1>
void rows_columns(const Int8Rows& xq, const int64_t* rows, int64_t count, const uint8_t* w,
                  int64_t row_bytes, int64_t c0, int64_t c1, float* out, int64_t out_stride) {
  if constexpr (R < kMaxRows) {
    if (count != R)
      return rows_columns<kVnni, F, R + 1>(xq, rows, count, w, row_bytes, c0, c1, out, out_stride);
  }
  pair_columns<kVnni, F, R, (R <= 3 ? 4 : 2)>(xq, rows, w, row_bytes, c0, c1, out, out_stride);
}

// out [count, n] (fp32) = x[rows] @ w.T for w [n, k] in blocks of format fmt.
template <bool kVnni>
void expert_gemv(const Int8Rows& xq, const int64_t* rows, int64_t count, const at::Tensor& w,
                 int64_t fmt, float* out) {
  const int64_t n = w.size(0), row_bytes = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  for (int64_t c0 = 0; c0 < n; c0 += kGroupColumns) {
    const int64_t c1 = std::min(n, c0 + kGroupColumns);
    for (int64_t r0 = 0; r0 < count; r0 += kMaxRows) {
      const int64_t r = std::min(kMaxRows, count - r0);
      float* o = out + r0 * n;
      if (fmt == kFmtQ8_0)
        rows_columns<kVnni, kFmtQ8_0>(xq, rows + r0, r, wp, row_bytes, c0, c1, o, n);
      else
        rows_columns<kVnni, kFmtQ4_0>(xq, rows + r0, r, wp, row_bytes, c0, c1, o, n);
    }
  }
}

// y [count, hidden] = silu_mul(x[rows] @ gate_up.T) @ down.T, x given rounded (xq).
at::Tensor expert_int8(const Int8Rows& xq, const std::vector<int64_t>& rows,
                       const at::Tensor& gate_up, int64_t gate_up_fmt, const at::Tensor& down,
                       int64_t down_fmt) {
  const int64_t count = static_cast<int64_t>(rows.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor g = at::empty({count, gate_up.size(0)}, f32);
  const bool vnni = avx512_vnni_allowed();
  if (vnni) expert_gemv<true>(xq, rows.data(), count, gate_up, gate_up_fmt, g.data_ptr<float>());
  else expert_gemv<false>(xq, rows.data(), count, gate_up, gate_up_fmt, g.data_ptr<float>());
  const at::Tensor a = ES_NS::direct_silu_mul(g);
  const Int8Rows aq(a.data_ptr<float>(), count, a.size(1));
  std::vector<int64_t> own(count);
  for (int64_t i = 0; i < count; ++i) own[i] = i;
  at::Tensor y = at::empty({count, down.size(0)}, f32);
  if (vnni) expert_gemv<true>(aq, own.data(), count, down, down_fmt, y.data_ptr<float>());
  else expert_gemv<false>(aq, own.data(), count, down, down_fmt, y.data_ptr<float>());
  return y;
}

}  // namespace
#endif  // ES_W == 16 && AVX512BW

namespace ES_NS {
at::Tensor direct_project(const at::Tensor& x, const at::Tensor& w, int64_t fmt, bool int8_dot);
at::Tensor direct_project_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                                bool int8_dot);
at::Tensor direct_silu_mul(const at::Tensor& gate_up);
}  // namespace ES_NS

namespace {
// The weighted sum of the experts' outputs into out [tokens, hidden] (fp32), each row adding
// its experts in ascending order (as the module path adds), the rows split over the threads:
// at a prefill chunk's thousands of rows it is ~64 MB of reads a layer.
void add_experts(float* out, int64_t tokens, int64_t hidden, const std::vector<ExpertRows>& work) {
  auto add_range = [&](int64_t t0, int64_t t1) {
    for (const ExpertRows& ex : work) {
      const auto lo = std::lower_bound(ex.rows.begin(), ex.rows.end(), t0) - ex.rows.begin();
      const auto hi = std::lower_bound(ex.rows.begin(), ex.rows.end(), t1) - ex.rows.begin();
      if (lo == hi) continue;
      switch (ex.y.scalar_type()) {
        case at::kFloat:
          add_weighted_rows(out, ex.y.data_ptr<float>(), hidden, ex.rows, ex.weights, lo, hi);
          break;
        case at::kBFloat16:
          add_weighted_rows(out, ex.y.data_ptr<at::BFloat16>(), hidden, ex.rows, ex.weights, lo,
                            hi);
          break;
        case at::kHalf:
          add_weighted_rows(out, ex.y.data_ptr<at::Half>(), hidden, ex.rows, ex.weights, lo, hi);
          break;
        default: TORCH_CHECK(false, "moe: activations must be fp32, bf16 or fp16");
      }
    }
  };
  if (at::in_parallel_region() || tokens < 64) add_range(0, tokens);
  else at::parallel_for(0, tokens, 32, add_range);
}

// The block (see the file's head); an expert with more than gemv_rows rows takes fp32 tiles.
at::Tensor moe_block_rows(const at::Tensor& h, const at::Tensor& router,
                          const at::Tensor& gate_up, int64_t gate_up_fmt, const at::Tensor& down,
                          int64_t down_fmt, int64_t top_k, bool renormalize, bool int8_dot,
                          int64_t gemv_rows, int64_t* chosen) {
  const int64_t tokens = h.size(0), hidden = h.size(1);
  const int64_t num_experts = router.size(0);
  TORCH_CHECK(top_k > 0 && top_k <= num_experts, "moe: top_k must be in 1..experts");
  TORCH_CHECK(gate_up.size(0) % num_experts == 0 && down.size(0) == num_experts * hidden,
              "moe: stacked expert weights must hold the same rows per expert");
  // As layers/moe.route: softmax over every expert in fp32, then the k largest.
  at::Tensor probs = at::softmax(at::linear(h, router.to(h.scalar_type())).to(at::kFloat), -1);
  auto [weights, ids] = at::topk(probs, top_k, -1);
  if (renormalize) weights = weights / weights.sum({-1}, true);
  ids = ids.contiguous();
  weights = weights.contiguous();

  // Each expert's slots (token * k + j) in ascending order: a stable sort by expert.
  std::vector<std::vector<int64_t>> slots(num_experts);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  for (int64_t s = 0; s < tokens * top_k; ++s) slots[id[s]].push_back(s);

  // The chosen experts, ascending, each with its rows and their weights.
  std::vector<ExpertRows> work;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (slots[e].empty()) continue;
    ExpertRows& ex = work.emplace_back();
    ex.expert = e;
    for (int64_t s : slots[e]) {
      ex.rows.push_back(s / top_k);
      ex.weights.push_back(wt[s]);
    }
  }
  *chosen = static_cast<int64_t>(work.size());

  // Each expert's SwiGLU on its own thread (gate/up, activation and down back to back, the
  // GEMVs inside single-threaded): one parallel region per layer instead of two per expert.
  // Threads take experts from a shared counter, most rows first, so a thread the OS holds back
  // leaves its share to the other. Every column sums in the same order on any thread.
  const int64_t gate_up_rows = gate_up.size(0) / num_experts;
#ifdef ES_EXPERT_INT_DOTS
  // The integer expert GEMVs (above): x rounded once for every expert's gate/up.
  const bool int8_experts = int8_dot && h.scalar_type() == at::kFloat &&
                            (gate_up_fmt == kFmtQ8_0 || gate_up_fmt == kFmtQ4_0) &&
                            (down_fmt == kFmtQ8_0 || down_fmt == kFmtQ4_0) &&
                            hidden % kBlk == 0 && (gate_up_rows / 2) % kBlk == 0;
  std::optional<Int8Rows> hq;
  if (int8_experts) hq.emplace(h.contiguous().data_ptr<float>(), tokens, hidden);
#endif
  auto run = [&](ExpertRows& ex) {
    const int64_t count = static_cast<int64_t>(ex.rows.size());
    if (count > gemv_rows) {
      const int64_t e = ex.expert;
      const at::Tensor x = h.index_select(
          0, at::from_blob(ex.rows.data(), {count}, at::TensorOptions().dtype(at::kLong)));
      const at::Tensor y = ES_NS::direct_project_tiled(
          x, gate_up.narrow(0, e * gate_up_rows, gate_up_rows), gate_up_fmt, int8_dot);
      ex.y = ES_NS::direct_project_tiled(ES_NS::direct_silu_mul(y),
                                         down.narrow(0, e * hidden, hidden), down_fmt, int8_dot)
                 .contiguous();
      return;
    }
#ifdef ES_EXPERT_INT_DOTS
    if (int8_experts) {
      const int64_t e = ex.expert;
      ex.y = expert_int8(*hq, ex.rows, gate_up.narrow(0, e * gate_up_rows, gate_up_rows),
                         gate_up_fmt, down.narrow(0, e * hidden, hidden), down_fmt);
      return;
    }
#endif
    at::Tensor x = h;
    if (tokens > 1) {
      x = h.index_select(0, at::from_blob(ex.rows.data(), {static_cast<int64_t>(ex.rows.size())},
                                          at::TensorOptions().dtype(at::kLong)));
    }
    const int64_t e = ex.expert;
    at::Tensor y = ES_NS::direct_project(x, gate_up.narrow(0, e * gate_up_rows, gate_up_rows),
                                         gate_up_fmt, int8_dot);
    ex.y = ES_NS::direct_project(ES_NS::direct_silu_mul(y), down.narrow(0, e * hidden, hidden),
                                 down_fmt, int8_dot)
               .contiguous();
  };
  std::vector<size_t> order(work.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return work[a].rows.size() > work[b].rows.size();
  });
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), work.size());
  if (threads <= 1 || at::in_parallel_region()) {
    for (ExpertRows& ex : work) run(ex);
  } else {
    std::atomic<size_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (size_t i = next++; i < order.size(); i = next++) run(work[order[i]]);
    });
  }

  at::Tensor out = at::zeros({tokens, hidden}, h.options().dtype(at::kFloat));
  add_experts(out.data_ptr<float>(), tokens, hidden, work);
  return out.to(h.scalar_type());
}
}  // namespace

namespace ES_NS {
// h [tokens, H] -> the block's output in h's dtype; *chosen = the number of experts run. The
// decoder stack's decode-sized passes: every expert on the GEMV.
at::Tensor direct_moe_block(const at::Tensor& h, const at::Tensor& router,
                            const at::Tensor& gate_up, int64_t gate_up_fmt, const at::Tensor& down,
                            int64_t down_fmt, int64_t top_k, bool renormalize, bool int8_dot,
                            int64_t* chosen) {
  return moe_block_rows(h, router, gate_up, gate_up_fmt, down, down_fmt, top_k, renormalize,
                        int8_dot, std::numeric_limits<int64_t>::max(), chosen);
}
}  // namespace ES_NS

namespace {
// The block as an op of its own (layers/moe.py's SparseMoeBlock with kernels calls it, so its
// module path and the stack compute alike): the output in h's dtype and the number of experts
// run, as a 0-d int64 tensor. Experts with more than gemv_rows rows take fp32 tiles.
std::tuple<at::Tensor, at::Tensor> moe_block(const at::Tensor& h, const at::Tensor& router,
                                             const at::Tensor& gate_up, int64_t gate_up_fmt,
                                             const at::Tensor& down, int64_t down_fmt,
                                             int64_t top_k, bool renormalize, bool int8_dot,
                                             int64_t gemv_rows) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(0) > 0,
              "moe_block: h must be contiguous [tokens > 0, hidden]");
  int64_t chosen = 0;
  TORCH_CHECK(gemv_rows > 0, "moe_block: gemv_rows must be positive");
  at::Tensor out = moe_block_rows(h, router, gate_up, gate_up_fmt, down, down_fmt, top_k,
                                  renormalize, int8_dot, gemv_rows, &chosen);
  return {out, at::scalar_tensor(chosen, at::TensorOptions().dtype(at::kLong))};
}
}  // namespace

ES_LIBRARY_FRAGMENT(m) {
  m.def("moe_block(Tensor h, Tensor router, Tensor gate_up, int gate_up_fmt, Tensor down, "
        "int down_fmt, int top_k, bool renormalize, bool int8_decode_dot, int gemv_rows) "
        "-> (Tensor, Tensor)");
}

ES_LIBRARY_IMPL(m) { m.impl("moe_block", &moe_block); }
