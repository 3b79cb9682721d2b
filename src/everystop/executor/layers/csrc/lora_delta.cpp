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
// (no reduction). An adapter's rows are taken kRowBlock at a time, so that each vector of A
// and of B^T read serves every row of the block from registers; each row's sums still run in
// the same order whatever block it is in. Threads split work items of up to kRowsPerItem rows
// of one adapter (a long prefill chunk of one adapter still spreads over every thread); a call
// with little work runs on the calling thread alone, opening no parallel region (a region
// synchronizes the threads, which costs more than a decode pass's deltas on a busy machine).
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

// Rows of one adapter per work item: few enough that a prefill chunk gives every thread items.
constexpr int64_t kRowsPerItem = 16;
// Multiply-adds below which a call runs on one thread (~0.05 ms of work): a 32-row decode
// pass's [q; k; v], [gate; up] and down deltas split over the threads, a few rows' do not.
constexpr int64_t kParallelMacs = int64_t{1} << 20;

// Rows of an item computed together: each vector of A or B^T loaded is used for this many
// rows (from registers). Fewer on AVX2, whose 16 registers hold fewer accumulators.
constexpr int kRowBlock = kW == 16 ? 4 : 2;
// A's rows per pass over x in the shrink (accumulators: kRowBlock x kARows).
constexpr int kARows = 4;

// acc[i][r] = lanes of x_i . A[r] (one vector per row and A row, reduced afterwards), for
// NR rows x_i (fp32) and NA rows of A from `a`, each k long. NR and NA are compile-time so the
// NR x NA accumulators stay in registers. Each (row, A row) sum is taken in the same order
// whatever NR and NA are, so a row's result does not depend on the rows computed beside it.
template <int NR, int NA, typename W>
inline void shrink_block(const float* const* xs, const W* a, int64_t k, vf (*acc)[ES_W]) {
  vf s[NR][NA] = {};
  int64_t j = 0;
  for (; j + kW <= k; j += kW) {
    vf xv[NR];
    for (int i = 0; i < NR; ++i) xv[i] = loadv(xs[i] + j);
    for (int r = 0; r < NA; ++r) {
      const vf av = loadv(a + r * k + j);
      for (int i = 0; i < NR; ++i) s[i][r] += xv[i] * av;
    }
  }
  if (j < k) {
    vf xv[NR];
    for (int i = 0; i < NR; ++i) xv[i] = loadv_n(xs[i] + j, k - j);
    for (int r = 0; r < NA; ++r) {
      const vf av = loadv_n(a + r * k + j, k - j);
      for (int i = 0; i < NR; ++i) s[i][r] += xv[i] * av;
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int r = 0; r < NA; ++r) acc[i][r] = s[i][r];
}

// t_i[0:rank] = x_i @ A^T for NR rows: kW A rows at a time, their lanes reduced together.
template <int NR, typename W>
void shrink_rows(const float* const* xs, const W* a, int64_t rank, int64_t k, float* const* ts) {
  vf acc[NR][ES_W];
  for (int64_t r0 = 0; r0 < rank; r0 += kW) {
    const int64_t n = std::min(kW, rank - r0);
    for (int i = 0; i < NR; ++i)
      for (int64_t r = n; r < kW; ++r) acc[i][r] = vf{};
    int64_t r = 0;
    for (; r + kARows <= n; r += kARows) {
      vf part[NR][ES_W];
      shrink_block<NR, kARows>(xs, a + (r0 + r) * k, k, part);
      for (int i = 0; i < NR; ++i)
        for (int q = 0; q < kARows; ++q) acc[i][r + q] = part[i][q];
    }
    for (; r < n; ++r) {
      vf part[NR][ES_W];
      shrink_block<NR, 1>(xs, a + (r0 + r) * k, k, part);
      for (int i = 0; i < NR; ++i) acc[i][r] = part[i][0];
    }
    for (int i = 0; i < NR; ++i) {
      const vf s = reduce_lanes(acc[i]);
      std::memcpy(ts[i] + r0, &s, sizeof(float) * static_cast<size_t>(n));
    }
  }
}

// dst_i[0:n] += t_i[0:rank] @ B^T[:, 0:n] for NR rows: two vectors of output columns at a
// time, a multiply-add per rank in rank order (the same for any NR).
template <int NR, typename T, typename W>
void expand_rows(const float* const* ts, const W* bt, int64_t rank, int64_t n, int64_t ldb,
                 T* const* dsts) {
  for (int64_t j = 0; j < n; j += 2 * kW) {
    const int64_t m0 = std::min(kW, n - j), m1 = std::max<int64_t>(0, std::min(kW, n - j - kW));
    vf acc[NR][2] = {};
    for (int64_t r = 0; r < rank; ++r) {
      const vf b0 = loadv_n(bt + r * ldb + j, m0);
      const vf b1 = m1 ? loadv_n(bt + r * ldb + j + kW, m1) : vf{};
      for (int i = 0; i < NR; ++i) {
        acc[i][0] += ts[i][r] * b0;
        acc[i][1] += ts[i][r] * b1;
      }
    }
    for (int i = 0; i < NR; ++i) {
      T* d = dsts[i] + j;
      if constexpr (std::is_same_v<T, float>) {
        const vf d0 = loadv_n(d, m0) + acc[i][0];
        std::memcpy(d, &d0, sizeof(float) * static_cast<size_t>(m0));
        if (m1) {
          const vf d1 = loadv_n(d + kW, m1) + acc[i][1];
          std::memcpy(d + kW, &d1, sizeof(float) * static_cast<size_t>(m1));
        }
      } else {
        for (int64_t c = 0; c < m0; ++c) d[c] = static_cast<T>(static_cast<float>(d[c]) + acc[i][0][c]);
        for (int64_t c = 0; c < m1; ++c)
          d[kW + c] = static_cast<T>(static_cast<float>(d[kW + c]) + acc[i][1][c]);
      }
    }
  }
}

// One block of NR rows of one adapter: every part's shrink, then its expand.
template <int NR, typename T, typename W>
void lora_rows_block(const T* xp, T* op, const int64_t* rows, int64_t in, int64_t ld_out,
                     at::TensorList weights, const std::vector<LoraPart>& parts,
                     int64_t base, float* xbuf, float* tbuf, int64_t max_rank) {
  const float* xs[NR];
  float* ts[NR];
  for (int i = 0; i < NR; ++i) {
    const T* xr = xp + rows[i] * in;
    if constexpr (std::is_same_v<T, float>) {
      xs[i] = xr;
    } else {
      float* xf = xbuf + i * in;
      for (int64_t c = 0; c < in; ++c) xf[c] = static_cast<float>(xr[c]);
      xs[i] = xf;
    }
    ts[i] = tbuf + i * max_rank;
  }
  for (const LoraPart& part : parts) {
    const at::Tensor& a = weights[part.first + base];
    if (a.numel() == 0) continue;
    const at::Tensor& bt = weights[part.first + base + 1];
    const int64_t rank = a.size(0);
    shrink_rows<NR>(xs, a.data_ptr<W>(), rank, in, ts);
    T* dsts[NR];
    for (int i = 0; i < NR; ++i) dsts[i] = op + rows[i] * ld_out + part.col_offset;
    expand_rows<NR>(ts, bt.data_ptr<W>(), rank, bt.size(1), bt.stride(0), dsts);
  }
}

template <typename T, typename W>
void lora_add_typed(at::Tensor& out, const at::Tensor& x,
                    const std::vector<std::vector<int64_t>>& groups, at::TensorList weights,
                    const std::vector<LoraPart>& parts, int64_t stride) {
  const int64_t in = x.size(1), ld_out = out.size(1);
  const int64_t num_groups = static_cast<int64_t>(groups.size());
  const at::ScalarType wtype = c10::CppTypeToScalarType<W>::value;
  int64_t max_rank = 0;
  for (const LoraPart& part : parts) {
    int64_t n_out = -1;  // the part's output columns (every adapter's B has as many rows)
    for (int64_t g = 0; g < num_groups; ++g) {
      const at::Tensor& a = weights[part.first + g * stride];
      if (groups[g].empty() || a.numel() == 0) continue;
      const at::Tensor& bt = weights[part.first + g * stride + 1];
      TORCH_CHECK(a.dim() == 2 && a.size(1) == in && a.is_contiguous() &&
                      a.scalar_type() == wtype,
                  "lora: A must be [rank, ", in, "], contiguous, of the adapters' dtype");
      if (n_out < 0 && bt.dim() == 2) n_out = bt.size(1);
      TORCH_CHECK(bt.dim() == 2 && bt.size(1) == n_out && bt.size(0) == a.size(0) &&
                      bt.stride(1) == 1 && bt.stride(0) >= bt.size(1) &&
                      bt.scalar_type() == wtype && part.col_offset >= 0 &&
                      part.col_offset + n_out <= ld_out,
                  "lora: B^T must be [rank, n] with unit column stride, of A's dtype, n the ",
                  "same for every adapter and within out's columns from col_offset");
      max_rank = std::max(max_rank, a.size(0));
    }
  }
  if (max_rank == 0) return;
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
    std::vector<float> xbuf(std::is_same_v<T, float> ? 0 : static_cast<size_t>(kRowBlock * in));
    std::vector<float> tbuf(static_cast<size_t>(kRowBlock * max_rank));
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = items[it].first;
      const int64_t* rows = groups[g].data() + items[it].second;
      const int64_t num_rows =
          std::min(kRowsPerItem, static_cast<int64_t>(groups[g].size()) - items[it].second);
      int64_t i = 0;
      for (; i + kRowBlock <= num_rows; i += kRowBlock)
        lora_rows_block<kRowBlock, T, W>(xp, op, rows + i, in, ld_out, weights, parts,
                                         g * stride, xbuf.data(), tbuf.data(), max_rank);
      for (; i < num_rows; ++i)
        lora_rows_block<1, T, W>(xp, op, rows + i, in, ld_out, weights, parts, g * stride,
                                 xbuf.data(), tbuf.data(), max_rank);
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
  // The adapters' dtype: x's, or bf16 under fp32 activations (layers/lora.py's adapter_dtype).
  at::ScalarType wtype = x.scalar_type();
  for (const LoraPart& part : parts)
    for (size_t g = 0; g < groups.size(); ++g) {
      const at::Tensor& a = weights[part.first + static_cast<int64_t>(g) * stride];
      if (!groups[g].empty() && a.numel()) wtype = a.scalar_type();
    }
  switch (x.scalar_type()) {
    case at::kFloat:
      if (wtype == at::kBFloat16)
        return lora_add_typed<float, c10::BFloat16>(out, x, groups, weights, parts, stride);
      return lora_add_typed<float, float>(out, x, groups, weights, parts, stride);
    case at::kBFloat16:
      return lora_add_typed<c10::BFloat16, c10::BFloat16>(out, x, groups, weights, parts, stride);
    case at::kHalf:
      return lora_add_typed<c10::Half, c10::Half>(out, x, groups, weights, parts, stride);
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
