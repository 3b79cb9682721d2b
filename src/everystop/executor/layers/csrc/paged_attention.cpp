// Paged attention for a packed mixed batch on CPU, reading K/V straight from the block pool.
//
// One work item = (sequence, kv head, tile of query tokens). All query heads of the kv group
// and all tokens of the tile form the item's "rows", so each K/V block is loaded (and converted
// to fp32) once per item and reused by every row. Softmax is online (running max and sum per
// row), accumulation is fp32. Only ATen core and torch/library.h are included so the build stays
// short; the op is registered as torch.ops.everystop.paged_attention.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;  // first query token of the tile, relative to the sequence's first query
  int64_t q_count;
  int64_t cost;  // rows x context, used to start the heaviest items first
};

template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename cache_t>
void run_item(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
              const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
              int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = w.q_count * group;
  const int64_t D = head_dim;
  const int64_t T = block_size;
  // Row r = (token t = r / group, head h = kv_head * group + r % group).
  std::vector<float> qbuf(rows * D), acc(rows * D, 0.f), m(rows, -INFINITY), l(rows, 0.f);
  std::vector<float> kt(D * T), vbuf(T * D), s(T);
  std::vector<int64_t> last_pos(rows);  // highest key position row r may attend to
  const int64_t first_pos = seq_len - qlen;  // position of the sequence's first query token
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / group;
    const int64_t h = w.kv_head * group + r % group;
    const float* src = q + (tok * num_heads + h) * D;
    for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = src[d] * scale;
    last_pos[r] = first_pos + w.q_begin + r / group;
  }
  const int64_t ctx = first_pos + w.q_begin + w.q_count;  // keys the tile's last row sees
  const int64_t n_blocks = (ctx + T - 1) / T;
  const int64_t row_stride = num_kv_heads * D;  // between slots of one block
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t pos0 = b * T;
    const int64_t n_tok = std::min(T, ctx - pos0);
    const int64_t base = (block_table[b] * T * num_kv_heads + w.kv_head) * D;
    // K transposed to [D, T] so scores for the whole block are one vector FMA per d,
    // with no horizontal reductions; V converted to fp32 rows.
    for (int64_t t = 0; t < n_tok; ++t) {
      const cache_t* ks = k_cache + base + t * row_stride;
      for (int64_t d = 0; d < D; ++d) kt[d * T + t] = static_cast<float>(ks[d]);
      load_row(v_cache + base + t * row_stride, vbuf.data() + t * D, D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(n_tok, last_pos[r] - pos0 + 1);
      if (visible <= 0) continue;
      const float* qr = qbuf.data() + r * D;
      float* sp = s.data();
      std::fill(sp, sp + T, 0.f);
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qr[d];
        const float* kd = kt.data() + d * T;
#pragma omp simd
        for (int64_t t = 0; t < T; ++t) sp[t] += qd * kd[t];
      }
      float block_max = -INFINITY;
      for (int64_t t = 0; t < visible; ++t) block_max = std::max(block_max, sp[t]);
      const float m_new = std::max(m[r], block_max);
      float* ar = acc.data() + r * D;
      if (m_new > m[r]) {
        const float corr = std::exp(m[r] - m_new);  // exp(-inf) = 0 on the first block
        l[r] *= corr;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
        m[r] = m_new;
      }
      float sum = 0.f;
      for (int64_t t = 0; t < visible; ++t) {
        const float p = std::exp(sp[t] - m_new);
        sum += p;
        const float* vt = vbuf.data() + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * vt[d];
      }
      l[r] += sum;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / group;
    const int64_t h = w.kv_head * group + r % group;
    float* dst = out + (tok * num_heads + h) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

template <typename cache_t>
void run_all(const at::Tensor& q, at::Tensor& out, const at::Tensor& key_cache,
             const at::Tensor& value_cache, const at::Tensor& block_tables,
             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
             int64_t rows_per_item) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t tile = std::max<int64_t>(1, rows_per_item / group);

  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t qlen = qsl[i + 1] - qsl[i];
    for (int64_t q0 = 0; q0 < qlen; q0 += tile) {
      const int64_t cnt = std::min(tile, qlen - q0);
      const int64_t ctx = lens[i] - qlen + q0 + cnt;
      for (int64_t kh = 0; kh < num_kv_heads; ++kh)
        items.push_back({i, kh, q0, cnt, cnt * group * ctx});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const cache_t* kp = key_cache.data_ptr<cache_t>();
  const cache_t* vp = value_cache.data_ptr<cache_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int n_threads = std::max(1, std::min<int>(at::get_num_threads(), (int)n_items));
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
  for (int64_t j = 0; j < n_items; ++j) {
    const WorkItem& w = items[j];
    const int64_t i = w.seq;
    run_item<cache_t>(w, qp, op, kp, vp, bt + i * max_blocks, qsl[i], lens[i],
                      qsl[i + 1] - qsl[i], num_heads, num_kv_heads, D, block_size,
                      static_cast<float>(scale));
  }
}

// q: [num_tokens, num_heads, head_dim] fp32; caches: [num_blocks, block_size, kv_heads, head_dim]
// fp32/bf16/fp16; block_tables [num_seqs, max_blocks], query_start_loc, seq_lens: int64.
// Returns fp32 [num_tokens, num_heads, head_dim].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t rows_per_item) {
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3,
              "q must be contiguous fp32 [tokens, heads, dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.dim() == 4,
              "caches must be contiguous [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "K/V dtypes differ");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "K/V shapes differ");
  TORCH_CHECK(key_cache.size(3) == q.size(2), "head_dim mismatch");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of kv heads");
  for (const auto* t : {&block_tables, &query_start_loc, &seq_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "int64 metadata expected");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1, "query_start_loc size");
  TORCH_CHECK(rows_per_item >= 1, "rows_per_item must be positive");
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      run_all<float>(q, out, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                     scale, rows_per_item);
      break;
    case at::kBFloat16:
      run_all<c10::BFloat16>(q, out, key_cache, value_cache, block_tables, query_start_loc,
                             seq_lens, scale, rows_per_item);
      break;
    case at::kHalf:
      run_all<c10::Half>(q, out, key_cache, value_cache, block_tables, query_start_loc,
                         seq_lens, scale, rows_per_item);
      break;
    default:
      TORCH_CHECK(false, "unsupported cache dtype ", key_cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(everystop, m) {
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int rows_per_item) -> Tensor");
}

TORCH_LIBRARY_IMPL(everystop, CPU, m) { m.impl("paged_attention", &paged_attention); }
