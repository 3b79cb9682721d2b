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
// in one parallel region, a whole expert per thread at a time.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// One chosen expert: the rows that chose it (ascending), their routing weights, its output.
struct ExpertRows {
  int64_t expert = 0;
  std::vector<int64_t> rows;
  std::vector<float> weights;
  at::Tensor y;
};

// out[row[i]] += float(y[i]) * w[i], the product rounded to fp32 before the add (as the module
// path's `out.index_add_(0, rows, y.float() * weights)`): no fused multiply-add.
template <typename T>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void add_weighted_rows(float* out, const T* y, int64_t cols, const std::vector<int64_t>& rows,
                       const std::vector<float>& weights) {
  for (size_t i = 0; i < rows.size(); ++i) {
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

namespace ES_NS {
at::Tensor direct_project(const at::Tensor& x, const at::Tensor& w, int64_t fmt, bool int8_dot);
at::Tensor direct_silu_mul(const at::Tensor& gate_up);

// h [tokens, H] -> the block's output in h's dtype; *chosen = the number of experts run.
at::Tensor direct_moe_block(const at::Tensor& h, const at::Tensor& router,
                            const at::Tensor& gate_up, int64_t gate_up_fmt, const at::Tensor& down,
                            int64_t down_fmt, int64_t top_k, bool renormalize, bool int8_dot,
                            int64_t* chosen) {
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
  auto run = [&](ExpertRows& ex) {
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

  // The weighted sum in ascending expert order, as the module path adds.
  at::Tensor out = at::zeros({tokens, hidden}, h.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  for (const ExpertRows& ex : work) {
    switch (ex.y.scalar_type()) {
      case at::kFloat:
        add_weighted_rows(op, ex.y.data_ptr<float>(), hidden, ex.rows, ex.weights);
        break;
      case at::kBFloat16:
        add_weighted_rows(op, ex.y.data_ptr<at::BFloat16>(), hidden, ex.rows, ex.weights);
        break;
      case at::kHalf:
        add_weighted_rows(op, ex.y.data_ptr<at::Half>(), hidden, ex.rows, ex.weights);
        break;
      default: TORCH_CHECK(false, "moe: activations must be fp32, bf16 or fp16");
    }
  }
  return out.to(h.scalar_type());
}
}  // namespace ES_NS
