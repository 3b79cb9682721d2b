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
#include <cstring>
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

// 16 floats: one AVX-512 register (two AVX2 ones); GCC lowers it to whatever -march offers.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

// Load n <= 16 elements as fp32, zero-filling the tail (head_dim need not be a multiple of 16).
template <typename cache_t>
inline v16 load16(const cache_t* src, int64_t n) {
  float tmp[kLanes];
  if (n == kLanes) {
#pragma omp simd
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(src[i]);
  } else {
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = i < n ? static_cast<float>(src[i]) : 0.f;
  }
  v16 out;
  std::memcpy(&out, tmp, sizeof(out));
  return out;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// Full 16-wide loads of 16-bit floats convert as whole vectors (the scalar c10 conversion
// does not vectorize well). bf16 is the top half of an fp32.
template <>
inline v16 load16<c10::BFloat16>(const c10::BFloat16* src, int64_t n) {
  if (n != kLanes) {
    float tmp[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tmp[i] = i < n ? static_cast<float>(src[i]) : 0.f;
    v16 out;
    std::memcpy(&out, tmp, sizeof(out));
    return out;
  }
  v16h h;
  std::memcpy(&h, src, sizeof(h));
  const v16u bits = __builtin_convertvector(h, v16u) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float hsum(v16 v) {
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (scores minus their running max), 16 at a time: 2^n * p(r) with
// r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (rel. error ~1e-7).
// Inputs below -87 (including -inf) give 0.
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.f;
  const v16i underflow = x < lo;
  x = x < lo ? lo : x;
  const v16 fn = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x < 0 ? -0.5f : 0.5f), v16i), v16);
  const v16 r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  v16 p = v16{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const v16i scale_bits = (__builtin_convertvector(fn, v16i) + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &scale_bits, sizeof(two_n));
  const v16 res = p * two_n;
  v16i res_bits;
  std::memcpy(&res_bits, &res, sizeof(res));
  res_bits &= ~underflow;
  v16 out;
  std::memcpy(&out, &res_bits, sizeof(out));
  return out;
}

// kNV: head_dim / 16 fixed at compile time (4 for 64, 8 for 128) so the per-row vectors live in
// registers; 0 means "read it at run time" for other head sizes.
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
  // Row r = (token r / group, head kv_head * group + r % group): every query head of the kv
  // group for every token of the tile, so one load of a K/V block serves them all.
  std::vector<v16> qbuf(rows * nv), acc(rows * nv, v16{}), kbuf(T * nv), vbuf(T * nv);
  std::vector<float> m(rows, -INFINITY), l(rows, 0.f), s(T + kLanes);
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
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t pos0 = b * T;
    const int64_t n_tok = std::min(T, ctx - pos0);
    const int64_t base = (block_table[b] * T * num_kv_heads + w.kv_head) * D;
    for (int64_t t = 0; t < n_tok; ++t) {
      for (int64_t j = 0; j < nv; ++j) {
        const int64_t off = base + t * row_stride + j * kLanes, n = std::min(kLanes, D - j * kLanes);
        kbuf[t * nv + j] = load16(k_cache + off, n);
        vbuf[t * nv + j] = load16(v_cache + off, n);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(n_tok, last_pos[r] - pos0 + 1);
      if (visible <= 0) continue;
      const v16* qsrc = qbuf.data() + r * nv;
      float block_max = -INFINITY;
      for (int64_t t = 0; t < visible; ++t) {
        v16 dot = qsrc[0] * kbuf[t * nv];
        for (int64_t j = 1; j < nv; ++j) dot += qsrc[j] * kbuf[t * nv + j];
        s[t] = hsum(dot);
        block_max = std::max(block_max, s[t]);
      }
      const float m_new = std::max(m[r], block_max);
      v16* acc_r = acc.data() + r * nv;
      const float corr = std::exp(m[r] - m_new);  // 0 on the first block (m = -inf)
      l[r] *= corr;
      m[r] = m_new;
      float sum = 0.f;
      for (int64_t t0 = 0; t0 < visible; t0 += kLanes) {
        v16 x;
        for (int64_t i = 0; i < kLanes; ++i) x[i] = t0 + i < visible ? s[t0 + i] - m_new : -INFINITY;
        const v16 e = exp16(x);
        for (int64_t i = 0; i < kLanes && t0 + i < visible; ++i) s[t0 + i] = e[i];
        sum += hsum(e);
      }
      l[r] += sum;
      if constexpr (kNV > 0) {
        v16 ar[kNV > 0 ? kNV : 1];  // the row's output accumulator, kept in registers
        for (int64_t j = 0; j < nv; ++j) ar[j] = acc_r[j] * corr;
        for (int64_t t = 0; t < visible; ++t)
          for (int64_t j = 0; j < nv; ++j) ar[j] += s[t] * vbuf[t * nv + j];
        for (int64_t j = 0; j < nv; ++j) acc_r[j] = ar[j];
      } else {
        for (int64_t j = 0; j < nv; ++j) acc_r[j] *= corr;
        for (int64_t t = 0; t < visible; ++t)
          for (int64_t j = 0; j < nv; ++j) acc_r[j] += s[t] * vbuf[t * nv + j];
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
