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

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;  // first query token of the tile, relative to the sequence's first query
  int64_t q_count;
  int64_t cost;  // rows x context, used to start the heaviest items first
};

constexpr int64_t kLanes = 16;

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}


// Sixteen vectors in, one out: lane i holds the sum of a[i]'s lanes. A shuffle tree that
// halves the vector count each level (45 instructions) instead of 16 separate horizontal sums.
inline v16 reduce16(const v16* a) {
  v16 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k)
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int k = 0; k < 4; ++k)
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int k = 0; k < 2; ++k)
    d[k] = __builtin_shufflevector(c[2 * k], c[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * k], c[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

inline float hmax(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 c = a > b ? a : b;
  float m = c[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, c[i]);
  return m;
}

inline v16 loadv(const float* p) {
  v16 out;
  std::memcpy(&out, p, sizeof(out));
  return out;
}

// kNV: head_dim / 16 fixed at compile time (4 for 64, 8 for 128) so the per-row vectors live in
// registers; 0 means "read it at run time" for other head sizes.
//
// Keys are taken 16 at a time (a "tile", within one block): each row's 16 dot products are
// reduced together into one vector of scores, so the online softmax runs on whole vectors.
// An fp32 cache whose head_dim is a multiple of 16 is read in place; other caches are first
// converted (and zero-padded) into a small fp32 copy of the block shared by all rows.
template <typename cache_t, int kNV>
void run_item(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
              const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
              int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = w.q_count * group;
  const int64_t D = head_dim;
  const int64_t nv = kNV > 0 ? kNV : (D + kLanes - 1) / kLanes;
  const int64_t T = block_size;
  const bool in_place = std::is_same<cache_t, float>::value && D % kLanes == 0;
  // Row r = (token r / group, head kv_head * group + r % group): every query head of the kv
  // group for every token of the tile, so one load of a K/V block serves them all.
  std::vector<v16> qbuf(rows * nv), acc(rows * nv, v16{});
  std::vector<v16> kbuf(in_place ? 0 : T * nv), vbuf(in_place ? 0 : T * nv);
  std::vector<float> m(rows, -INFINITY), l(rows, 0.f);
  std::vector<int64_t> last_pos(rows);  // highest key position row r may attend to
  const int64_t first_pos = seq_len - qlen;  // position of the sequence's first query token
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / group;
    const int64_t h = w.kv_head * group + r % group;
    const float* src = q + (tok * num_heads + h) * D;
    for (int64_t j = 0; j < nv; ++j)
      qbuf[r * nv + j] = load16(src + j * kLanes, std::min(kLanes, D - j * kLanes)) * scale;
    last_pos[r] = first_pos + w.q_begin + r / group;
  }
  const int64_t ctx = first_pos + w.q_begin + w.q_count;  // keys the tile's last row sees
  const int64_t n_blocks = (ctx + T - 1) / T;
  const int64_t row_stride = num_kv_heads * D;  // between slots of one block
  const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t pos0 = b * T;
    const int64_t n_tok = std::min(T, ctx - pos0);
    const int64_t base = (block_table[b] * T * num_kv_heads + w.kv_head) * D;
    // The next block is a random jump in the pool, which the hardware prefetcher cannot guess:
    // ask for it now so its lines arrive while this block is computed.
    if (b + 1 < n_blocks) {
      const int64_t ahead = (block_table[b + 1] * T * num_kv_heads + w.kv_head) * D;
      const int64_t n_next = std::min(T, ctx - pos0 - T);
      for (int64_t t = 0; t < n_next; ++t) {
        const char* k_line = reinterpret_cast<const char*>(k_cache + ahead + t * row_stride);
        const char* v_line = reinterpret_cast<const char*>(v_cache + ahead + t * row_stride);
        for (int64_t byte = 0; byte < D * (int64_t)sizeof(cache_t); byte += 64) {
          __builtin_prefetch(k_line + byte);
          __builtin_prefetch(v_line + byte);
        }
      }
    }
    const float* kb;
    const float* vb;
    int64_t stride;  // floats between consecutive keys in kb / vb
    if (in_place) {
      kb = reinterpret_cast<const float*>(k_cache) + base;
      vb = reinterpret_cast<const float*>(v_cache) + base;
      stride = row_stride;
    } else {
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t j = 0; j < nv; ++j) {
          const int64_t off = base + t * row_stride + j * kLanes;
          const int64_t n = std::min(kLanes, D - j * kLanes);
          kbuf[t * nv + j] = load16(k_cache + off, n);
          vbuf[t * nv + j] = load16(v_cache + off, n);
        }
      kb = reinterpret_cast<const float*>(kbuf.data());
      vb = reinterpret_cast<const float*>(vbuf.data());
      stride = nv * kLanes;
    }
    for (int64_t t0 = 0; t0 < n_tok; t0 += kLanes) {
      const int64_t tile = std::min(kLanes, n_tok - t0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::min(tile, last_pos[r] - pos0 - t0 + 1);
        if (visible <= 0) continue;
        const v16* qr = qbuf.data() + r * nv;
        v16 dots[kLanes];
        for (int64_t t = 0; t < kLanes; ++t) {
          if (t >= visible) {
            dots[t] = v16{};
            continue;
          }
          const float* kt = kb + (t0 + t) * stride;
          v16 dot = qr[0] * loadv(kt);
          for (int64_t j = 1; j < nv; ++j) dot += qr[j] * loadv(kt + j * kLanes);
          dots[t] = dot;
        }
        v16 sc = reduce16(dots);
        sc = lane < (int)visible ? sc : v16{} - INFINITY;
        const float m_new = std::max(m[r], hmax(sc));
        const float corr = m[r] == -INFINITY ? 0.f : exp16(v16{} + (m[r] - m_new))[0];
        const v16 e = exp16(sc - m_new);
        l[r] = l[r] * corr + hsum(e);
        m[r] = m_new;
        float ev[kLanes];
        std::memcpy(ev, &e, sizeof(ev));
        v16* acc_r = acc.data() + r * nv;
        if constexpr (kNV > 0) {
          v16 ar[kNV];  // the row's output accumulator, kept in registers
          for (int64_t j = 0; j < kNV; ++j) ar[j] = acc_r[j] * corr;
          for (int64_t t = 0; t < visible; ++t) {
            const float* vt = vb + (t0 + t) * stride;
            for (int64_t j = 0; j < kNV; ++j) ar[j] += ev[t] * loadv(vt + j * kLanes);
          }
          for (int64_t j = 0; j < kNV; ++j) acc_r[j] = ar[j];
        } else {
          for (int64_t j = 0; j < nv; ++j) acc_r[j] *= corr;
          for (int64_t t = 0; t < visible; ++t) {
            const float* vt = vb + (t0 + t) * stride;
            for (int64_t j = 0; j < nv; ++j) acc_r[j] += ev[t] * loadv(vt + j * kLanes);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / group;
    const int64_t h = w.kv_head * group + r % group;
    float* dst = out + (tok * num_heads + h) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    float tmp[kLanes];
    for (int64_t j = 0; j < nv; ++j) {
      const v16 o = acc[r * nv + j] * inv;
      std::memcpy(tmp, &o, sizeof(o));
      for (int64_t i = 0; i < std::min(kLanes, D - j * kLanes); ++i) dst[j * kLanes + i] = tmp[i];
    }
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
  auto item_fn = D == 64 ? &run_item<cache_t, 4> : D == 128 ? &run_item<cache_t, 8>
                                                              : &run_item<cache_t, 0>;
  const int n_threads = std::max(1, std::min<int>(at::get_num_threads(), (int)n_items));
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
  for (int64_t j = 0; j < n_items; ++j) {
    const WorkItem& w = items[j];
    const int64_t i = w.seq;
    item_fn(w, qp, op, kp, vp, bt + i * max_blocks, qsl[i], lens[i],
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
