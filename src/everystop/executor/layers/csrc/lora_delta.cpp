// LoRA deltas of one linear for a pass whose rows belong to different adapters (SGMV-style):
//
//   out[r, c:c+n] += (x[r] @ A_k^T) @ B_k^T   for each row r of adapter k (k < 0: base)
//
// A_k [rank, in] and B_k^T [rank, n] are one adapter's pair on this linear's output columns
// c..c+n (one part of a fused projection: q, k or v of [q; k; v]), the scaling folded into B
// (layers/lora.py; B is held transposed, as split_parts cuts it at load time); an empty A means
// the adapter leaves those columns alone. B^T's rows may be strided (a view of a wider matrix).
// Each row is computed alone, in a fixed order, so a row's delta does not depend on the other
// rows.
//
// x @ A^T is dot products against A's rows, kW of them at a time, their lanes reduced together
// (reduce_lanes); (x @ A^T) @ B^T is kW output columns at a time, a multiply-add per rank
// (no reduction). Rows are taken adapter by adapter and B^T a chunk of output columns at a
// time, so that each chunk is read once per item and reused from L1 for each of its rows. Threads split work items of up to kRowsPerItem rows of one adapter (a
// long prefill chunk of one adapter still spreads over every thread); a call with little
// work runs on the calling thread alone, opening no parallel region (a region synchronizes
// the threads, which costs more than a decode pass's deltas on a busy machine).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora.h"
#include "simd.h"

namespace {

using ES_NS::LoraPart;

// Output columns of a part computed together: a chunk of B (64 x rank) stays in L1 across the
// rows of its adapter.
constexpr int64_t kOutChunk = 64;
// Rows of one adapter per work item: enough to reuse each chunk of B from L1, few enough that
// a prefill chunk gives every thread items.
constexpr int64_t kRowsPerItem = 16;
// Multiply-adds below which a call runs on one thread (~0.1 ms of work).
constexpr int64_t kParallelMacs = int64_t{4} << 20;

// out[i] = v[0:k] . m[i * ld : i * ld + k] for i in [0, n).
template <typename T>
void dot_rows(const float* v, const T* m, int64_t n, int64_t k, int64_t ld, float* out) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) {
    vf acc[kW];
    for (int64_t r = 0; r < kW; ++r) {
      const T* row = m + (i + r) * ld;
      vf a = {};
      int64_t j = 0;
      for (; j + kW <= k; j += kW) a += loadv(v + j) * loadv(row + j);
      if (j < k) a += loadv_n(v + j, k - j) * loadv_n(row + j, k - j);
      acc[r] = a;
    }
    const vf s = reduce_lanes(acc);
    std::memcpy(out + i, &s, sizeof(s));
  }
  for (; i < n; ++i) {
    const T* row = m + i * ld;
    vf a = {};
    int64_t j = 0;
    for (; j + kW <= k; j += kW) a += loadv(v + j) * loadv(row + j);
    if (j < k) a += loadv_n(v + j, k - j) * loadv_n(row + j, k - j);
    out[i] = hsum(a);
  }
}

template <typename T>
void lora_add_typed(at::Tensor& out, const at::Tensor& x,
                    const std::vector<std::vector<int64_t>>& groups, at::TensorList weights,
                    const std::vector<LoraPart>& parts, int64_t stride) {
  const int64_t in = x.size(1), ld_out = out.size(1);
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  int64_t max_rank = 0;
  for (const LoraPart& part : parts) {
    int64_t n_out = -1;  // the part's output columns (every adapter's B has as many rows)
    for (int64_t g = 0; g < num_groups; ++g) {
      const at::Tensor& a = weights[part.first + g * stride];
      if (groups[g].empty() || a.numel() == 0) continue;
      const at::Tensor& bt = weights[part.first + g * stride + 1];
      TORCH_CHECK(a.dim() == 2 && a.size(1) == in && a.is_contiguous() &&
                      a.scalar_type() == x.scalar_type(),
                  "lora: A must be [rank, ", in, "], contiguous, of x's dtype");
      if (n_out < 0 && bt.dim() == 2) n_out = bt.size(1);
      TORCH_CHECK(bt.dim() == 2 && bt.size(1) == n_out && bt.size(0) == a.size(0) &&
                      bt.stride(1) == 1 && bt.stride(0) >= bt.size(1) &&
                      bt.scalar_type() == x.scalar_type() && part.col_offset >= 0 &&
                      part.col_offset + n_out <= ld_out,
                  "lora: B^T must be [rank, n] with unit column stride, of x's dtype, n the ",
                  "same for every adapter and within out's columns from col_offset");
      max_rank = std::max(max_rank, a.size(0));
    }
  }
  if (max_rank == 0) return;
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  // Work items (adapter, first row) and the multiply-adds of the whole call.
  std::vector<std::pair<int64_t, int64_t>> items;
  int64_t macs = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t num_rows = static_cast<int64_t>(groups[g].size());
    for (int64_t i = 0; i < num_rows; i += kRowsPerItem) items.emplace_back(g, i);
    for (const LoraPart& part : parts) {
      const at::Tensor& a = weights[part.first + g * stride];
      if (num_rows && a.numel())
        macs += num_rows * a.size(0) * (in + weights[part.first + g * stride + 1].size(1));
    }
  }
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t num_items = static_cast<int64_t>(items.size());
  // grain: every item in one chunk (no parallel region) when the work is small.
  const int64_t grain = macs < kParallelMacs ? num_items : 1;
  at::parallel_for(0, num_items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(in));
    std::vector<float> t(static_cast<size_t>(kRowsPerItem * num_parts * max_rank));
    float delta[kOutChunk];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = items[it].first;
      const int64_t* rows = groups[g].data() + items[it].second;
      const int64_t num_rows =
          std::min(kRowsPerItem, static_cast<int64_t>(groups[g].size()) - items[it].second);
      // t[row][part][rank]: x @ A^T of each of the item's rows, every part.
      for (int64_t i = 0; i < num_rows; ++i) {
        const T* xr = xp + rows[i] * in;
        const float* v;
        if constexpr (std::is_same_v<T, float>) {
          v = xr;
        } else {
          for (int64_t c = 0; c < in; ++c) xf[c] = static_cast<float>(xr[c]);
          v = xf.data();
        }
        for (int64_t p = 0; p < num_parts; ++p) {
          const at::Tensor& a = weights[parts[p].first + g * stride];
          if (a.numel() == 0) continue;
          dot_rows(v, a.data_ptr<T>(), a.size(0), in, in,
                   t.data() + (i * num_parts + p) * max_rank);
        }
      }
      // Then B^T a chunk of output columns at a time, each chunk reused from L1 for every row:
      // delta[o] = sum over r of t[r] * B^T[r, o], r in order.
      for (int64_t p = 0; p < num_parts; ++p) {
        const at::Tensor& a = weights[parts[p].first + g * stride];
        if (a.numel() == 0) continue;
        const at::Tensor& bt = weights[parts[p].first + g * stride + 1];
        const int64_t rank = a.size(0), n_out = bt.size(1), ldb = bt.stride(0);
        const T* bp = bt.data_ptr<T>();
        for (int64_t o0 = 0; o0 < n_out; o0 += kOutChunk) {
          const int64_t n = std::min(kOutChunk, n_out - o0);
          for (int64_t i = 0; i < num_rows; ++i) {
            const float* ti = t.data() + (i * num_parts + p) * max_rank;
            for (int64_t j = 0; j < n; j += kW) {
              const int64_t m = std::min(kW, n - j);
              vf acc = {};
              for (int64_t r = 0; r < rank; ++r) acc += ti[r] * loadv_n(bp + r * ldb + o0 + j, m);
              std::memcpy(delta + j, &acc, sizeof(acc));
            }
            T* dst = op + rows[i] * ld_out + parts[p].col_offset + o0;
            for (int64_t j = 0; j < n; ++j)
              dst[j] = static_cast<T>(static_cast<float>(dst[j]) + delta[j]);
          }
        }
      }
    }
  });
}

}  // namespace

namespace ES_NS {

std::vector<std::vector<int64_t>> lora_groups(const at::Tensor& slots, int64_t num_adapters) {
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "lora: slots must be a contiguous int64 [rows]");
  std::vector<std::vector<int64_t>> groups(static_cast<size_t>(num_adapters));
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.size(0); ++r) {
    TORCH_CHECK(s[r] < num_adapters, "lora: row ", r, " has adapter slot ", s[r], " of ",
                num_adapters);
    if (s[r] >= 0) groups[s[r]].push_back(r);
  }
  return groups;
}

void direct_lora_add_(at::Tensor& out, const at::Tensor& x,
                      const std::vector<std::vector<int64_t>>& groups, at::TensorList weights,
                      const std::vector<LoraPart>& parts, int64_t stride) {
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) &&
                  x.is_contiguous() && out.is_contiguous() &&
                  x.scalar_type() == out.scalar_type(),
              "lora: x [rows, in] and out [rows, out] must be contiguous, of one dtype");
  switch (x.scalar_type()) {
    case at::kFloat:
      return lora_add_typed<float>(out, x, groups, weights, parts, stride);
    case at::kBFloat16:
      return lora_add_typed<c10::BFloat16>(out, x, groups, weights, parts, stride);
    case at::kHalf:
      return lora_add_typed<c10::Half>(out, x, groups, weights, parts, stride);
    default:
      TORCH_CHECK(false, "lora: x must be float32, bfloat16 or float16");
  }
}

}  // namespace ES_NS

namespace {

// The op alone (the layer-by-layer path, tests): weights = per adapter, per part, (A, B), the
// parts' deltas landing in out's columns from col_offsets.
void lora_add_op(at::Tensor out, const at::Tensor& x, const at::Tensor& slots,
                 at::TensorList weights, at::IntArrayRef col_offsets) {
  const int64_t num_parts = static_cast<int64_t>(col_offsets.size());
  TORCH_CHECK(num_parts > 0 && weights.size() % (2 * num_parts) == 0,
              "lora: weights are (A, B) pairs, one per part per adapter");
  const int64_t num_adapters = static_cast<int64_t>(weights.size()) / (2 * num_parts);
  TORCH_CHECK(slots.size(0) == x.size(0), "lora: one slot per row of x expected");
  std::vector<ES_NS::LoraPart> parts;
  for (int64_t p = 0; p < num_parts; ++p) parts.push_back({2 * p, col_offsets[p]});
  ES_NS::direct_lora_add_(out, x, ES_NS::lora_groups(slots, num_adapters), weights, parts,
                          2 * num_parts);
}

}  // namespace

ES_LIBRARY_FRAGMENT(m) {
  m.def("lora_add_(Tensor(a!) out, Tensor x, Tensor slots, Tensor[] weights, "
        "int[] col_offsets) -> ()");
}

ES_LIBRARY_IMPL(m) { m.impl("lora_add_", &lora_add_op); }
