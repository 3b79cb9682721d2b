// Paged attention for a packed mixed batch on CPU, reading K/V straight from the block pool.
//
// One work item = (sequence, tile of query tokens). All heads of all tokens of the tile form
// the item's "rows", so each K/V block is streamed once per item, front to back, and reused by
// every row. Prefill chunks in AVX-512 builds split instead into (16 tokens, one kv group)
// items scored against transposed key tiles (run_item_prefill). Softmax is online (running max
// and sum per row), accumulation is fp32. Only ATen core and torch/library.h are included so
// the build stays short; the op is registered as torch.ops.<ES_NS>.paged_attention (simd.h).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <omp.h>

#include "simd.h"

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
  int64_t q_begin;  // first query token of the tile, relative to the sequence's first query
  int64_t q_count;
  int64_t cost;  // rows x context, used to start the heaviest items first
  int64_t kv_group = -1;  // a prefill item's one kv group (run_item_prefill); -1: every head
};

constexpr int64_t kMaxTile = ES_W;
// Rows of one work item held on the stack by run_item_grouped (rows_per_item is capped there).
constexpr int64_t kMaxItemRows = 64;

// The next block is a random jump in the pool, which the hardware prefetcher cannot guess:
// ask for its first n_tok slots of K and V while the current block is computed.
template <typename cache_t>
inline void prefetch_block(const cache_t* k_cache, const cache_t* v_cache, int64_t block,
                           int64_t n_tok, int64_t T, int64_t slot_elems) {
  const char* k = reinterpret_cast<const char*>(k_cache + block * T * slot_elems);
  const char* v = reinterpret_cast<const char*>(v_cache + block * T * slot_elems);
  for (int64_t byte = 0; byte < n_tok * slot_elems * (int64_t)sizeof(cache_t); byte += 64) {
    __builtin_prefetch(k + byte);
    __builtin_prefetch(v + byte);
  }
}

// kInPlace: the inner loops read the cache itself (head_dim a multiple of kW), or a converted,
// zero-padded fp32 copy of each block.
// NOTE: an fp32 cache whose head_dim is not a multiple of kW needs the copy too: read in place,
// a head's last vector runs past it, and past the pool's end at its last slot (a NaN there
// made the scores NaN; the tests' head_dim 40 with 16-wide vectors).
//
// A work item covers every head of its tokens, so it walks each K/V block front to back: a
// block's slots hold all kv heads side by side ([block_size, kv_heads, head_dim]), and reading
// only one head's slice of each slot would touch a quarter or less of every few cache lines.
//
// `window` > 0: a query at position p sees keys p-window+1..p only, and the blocks wholly
// before the item's first query's window are never read (their table entries may be freed);
// `softcap` > 0: scores become softcap * tanh(score / softcap) before the mask.
template <typename cache_t, bool kInPlace, int kNV>
void run_item_src(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
                  const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
                  int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
                  int64_t head_dim, int64_t block_size, float scale, int64_t window = 0,
                  float softcap = 0.f) {
  constexpr bool in_place = kInPlace;
  using src_t = typename std::conditional<kInPlace, cache_t, float>::type;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t rows = w.q_count * num_heads;
  const int64_t D = head_dim;
  const int64_t nv = kNV > 0 ? kNV : (D + kW - 1) / kW;
  const int64_t T = block_size;
  const int64_t slot_elems = num_kv_heads * D;  // one slot of the cache: every kv head
  // Within a slot as the inner loops read it: the cache itself, or the padded fp32 copy.
  const int64_t src_head = in_place ? D : nv * kW;
  const int64_t src_slot = num_kv_heads * src_head;
  // Row r = (token r / num_heads, head r % num_heads); the heads of one kv group are adjacent,
  // so the K/V lines one row loads are still in L1 for the next rows of its group.
  std::vector<vf> qbuf(rows * nv), acc(rows * nv, vf{});
  std::vector<vf> kbuf(in_place ? 0 : T * num_kv_heads * nv);
  std::vector<vf> vbuf(in_place ? 0 : T * num_kv_heads * nv);
  std::vector<float> m(rows, -INFINITY), l(rows, 0.f);
  std::vector<int64_t> last_pos(rows), head_off(rows), first_seen(rows, 0);
  const int64_t first_pos = seq_len - qlen;  // position of the sequence's first query token
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / num_heads;
    const int64_t h = r % num_heads;
    const float* src = q + (tok * num_heads + h) * D;
    for (int64_t j = 0; j < nv; ++j)
      qbuf[r * nv + j] = loadv_n(src + j * kW, std::min(kW, D - j * kW)) * scale;
    last_pos[r] = first_pos + w.q_begin + r / num_heads;
    head_off[r] = (h / group) * src_head;
    if (window > 0) first_seen[r] = std::max<int64_t>(0, last_pos[r] - window + 1);
  }
  const int64_t ctx = first_pos + w.q_begin + w.q_count;  // keys the tile's last row sees
  const int64_t n_blocks = (ctx + T - 1) / T;
  vi lane;
  for (int64_t i = 0; i < kW; ++i) lane[i] = static_cast<int32_t>(i);
  // Row 0 (the item's first token) has the earliest window: no row reads a block before it.
  for (int64_t b = first_seen[0] / T; b < n_blocks; ++b) {
    const int64_t pos0 = b * T;
    const int64_t n_tok = std::min(T, ctx - pos0);
    const int64_t base = block_table[b] * T * slot_elems;
    if (b + 1 < n_blocks)
      prefetch_block(k_cache, v_cache, block_table[b + 1], std::min(T, ctx - pos0 - T), T,
                     slot_elems);
    const src_t* kb;
    const src_t* vb;
    if constexpr (in_place) {
      kb = k_cache + base;
      vb = v_cache + base;
    } else {
      for (int64_t t = 0; t < n_tok; ++t)
        for (int64_t kh = 0; kh < num_kv_heads; ++kh)
          for (int64_t j = 0; j < nv; ++j) {
            const int64_t off = base + t * slot_elems + kh * D + j * kW;
            const int64_t n = std::min(kW, D - j * kW);
            kbuf[(t * num_kv_heads + kh) * nv + j] = loadv_n(k_cache + off, n);
            vbuf[(t * num_kv_heads + kh) * nv + j] = loadv_n(v_cache + off, n);
          }
      kb = reinterpret_cast<const float*>(kbuf.data());
      vb = reinterpret_cast<const float*>(vbuf.data());
    }
    for (int64_t t0 = 0; t0 < n_tok; t0 += kMaxTile) {
      const int64_t tile = std::min(kMaxTile, n_tok - t0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = std::min(tile, last_pos[r] - pos0 - t0 + 1);
        const int64_t hidden_below = first_seen[r] - pos0 - t0;  // lanes before the window
        if (visible <= 0 || hidden_below >= visible) continue;
        const vf* qr = qbuf.data() + r * nv;
        const src_t* kr = kb + t0 * src_slot + head_off[r];
        const src_t* vr = vb + t0 * src_slot + head_off[r];
        vf dots[ES_W];
        for (int64_t t = 0; t < kW; ++t) {
          if (t >= visible) {
            dots[t] = vf{};
            continue;
          }
          const src_t* kt = kr + t * src_slot;
          vf dot = qr[0] * loadv(kt);
          for (int64_t j = 1; j < nv; ++j) dot += qr[j] * loadv(kt + j * kW);
          dots[t] = dot;
        }
        vf sc = reduce_lanes(dots);
        if (softcap > 0.f) {
          float s_arr[ES_W];
          std::memcpy(s_arr, &sc, sizeof(s_arr));
          for (int64_t i = 0; i < kW; ++i) s_arr[i] = softcap * std::tanh(s_arr[i] / softcap);
          std::memcpy(&sc, s_arr, sizeof(s_arr));
        }
        sc = (lane < (int)visible) & (lane >= (int)hidden_below) ? sc : vf{} - INFINITY;
        const float m_new = std::max(m[r], hmax(sc));
        const float corr = m[r] == -INFINITY ? 0.f : exp_v(vf{} + (m[r] - m_new))[0];
        const vf e = exp_v(sc - m_new);
        l[r] = l[r] * corr + hsum(e);
        m[r] = m_new;
        float ev[ES_W];
        std::memcpy(ev, &e, sizeof(ev));
        vf* acc_r = acc.data() + r * nv;
        if constexpr (kNV > 0) {
          vf ar[kNV];  // the row's output accumulator, kept in registers
          for (int64_t j = 0; j < kNV; ++j) ar[j] = acc_r[j] * corr;
          for (int64_t t = 0; t < visible; ++t) {
            const src_t* vt = vr + t * src_slot;
            for (int64_t j = 0; j < kNV; ++j) ar[j] += ev[t] * loadv(vt + j * kW);
          }
          for (int64_t j = 0; j < kNV; ++j) acc_r[j] = ar[j];
        } else {
          for (int64_t j = 0; j < nv; ++j) acc_r[j] *= corr;
          for (int64_t t = 0; t < visible; ++t) {
            const src_t* vt = vr + t * src_slot;
            for (int64_t j = 0; j < nv; ++j) acc_r[j] += ev[t] * loadv(vt + j * kW);
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / num_heads;
    const int64_t h = r % num_heads;
    float* dst = out + (tok * num_heads + h) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    float tmp[ES_W];
    for (int64_t j = 0; j < nv; ++j) {
      const vf o = acc[r * nv + j] * inv;
      std::memcpy(tmp, &o, sizeof(o));
      for (int64_t i = 0; i < std::min(kW, D - j * kW); ++i) dst[j * kW + i] = tmp[i];
    }
  }
}

// Keys a grouped item scores before each online-softmax update: 16 (two vectors on AVX2, one
// on AVX-512), so the per-update work (max, rescale, two exponentials) is paid once per block
// of 16 keys instead of once per 8 on AVX2.
constexpr int64_t kGroupTile = 16;
constexpr int kTileVecs = static_cast<int>(kGroupTile / kW);

// Asks for the next n elements (whole cache lines) of the next block's K and V.
template <typename cache_t>
inline void prefetch_some(const cache_t*& pk, const cache_t*& pv, int64_t& left, int64_t n,
                          int64_t line_elems) {
  if (left <= 0) return;
  n = std::min(n, left);
  for (int64_t e = 0; e < n; e += line_elems) {
    __builtin_prefetch(pk + e);
    __builtin_prefetch(pv + e);
  }
  pk += n;
  pv += n;
  left -= n;
}

// The heads of one kv group (G of them, adjacent in a token's rows) read the same K/V slots:
// each K/V vector is loaded (and widened, for a 16-bit cache) once and multiplied into all G
// rows, straight from the cache, instead of once per row.
// Needs head_dim == kNV * kW (kNV > 0) and num_heads == G * num_kv_heads.
template <typename cache_t, int kNV, int G>
void run_item_grouped(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
                      const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
                      int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, float scale) {
  constexpr int64_t D = kNV * kW;
  // V is accumulated JC vectors of the head at a time so that G x JC accumulators stay in
  // registers (16 on AVX2, 32 on AVX-512).
  constexpr int JC = kNV % 4 == 0 ? 4 : (kNV % 2 == 0 ? 2 : 1);
  // bf16 K/V in the split order (simd.h's load_bf16_split), where the head is a whole number
  // of pairs; the rows' q and accumulators are kept in that order and interleaved at the end.
  constexpr bool kSplit = kSplitBf16 && std::is_same<cache_t, c10::BFloat16>::value &&
                          kNV % 2 == 0 && JC % 2 == 0;
  static_assert(G <= kW, "a group's corrections share one vector");
  const int64_t rows = w.q_count * num_heads;
  const int64_t T = block_size;
  const int64_t slot_elems = num_kv_heads * D;
  alignas(64) vf qbuf[kMaxItemRows * kNV];
  alignas(64) vf acc[kMaxItemRows * kNV];
  float m[kMaxItemRows], l[kMaxItemRows];
  const int64_t first_pos = seq_len - qlen;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / num_heads;
    const int64_t h = r % num_heads;
    const float* src = q + (tok * num_heads + h) * D;
    for (int64_t j = 0; j < kNV; ++j) {
      if constexpr (kSplit) {
        if (j % 2 == 0) split_even_odd(src + j * kW, qbuf[r * kNV + j], qbuf[r * kNV + j + 1]);
      } else {
        qbuf[r * kNV + j] = loadv(src + j * kW);
      }
      acc[r * kNV + j] = vf{};
    }
    for (int64_t j = 0; j < kNV; ++j) qbuf[r * kNV + j] *= scale;
    m[r] = -INFINITY;
    l[r] = 0.f;
  }
  const int64_t ctx = first_pos + w.q_begin + w.q_count;
  const int64_t n_blocks = (ctx + T - 1) / T;
  vi lane;
  for (int64_t i = 0; i < kW; ++i) lane[i] = static_cast<int32_t>(i);
  // The next block's K/V lines are requested a few at a time, spread over the keys of this
  // one: asked for all at once, they overflow the core's miss buffers and the loads behind
  // them wait (a slice per group step of 16 keys was 10-15% slower than a slice per key;
  // blocks 2 or 3 ahead were slower too).
  const int64_t line_elems = 64 / static_cast<int64_t>(sizeof(cache_t));
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t pos0 = b * T;
    const int64_t n_tok = std::min(T, ctx - pos0);
    const cache_t* kb = k_cache + block_table[b] * T * slot_elems;
    const cache_t* vb = v_cache + block_table[b] * T * slot_elems;
    const cache_t* pk = nullptr;
    const cache_t* pv = nullptr;
    int64_t pf_left = 0, pf_step = 0;
    if (b + 1 < n_blocks) {
      pk = k_cache + block_table[b + 1] * T * slot_elems;
      pv = v_cache + block_table[b + 1] * T * slot_elems;
      pf_left = std::min(T, ctx - pos0 - T) * slot_elems;
      const int64_t steps = ((n_tok + kGroupTile - 1) / kGroupTile) * w.q_count * num_kv_heads *
                            kGroupTile;
      pf_step = ((pf_left + steps - 1) / steps + line_elems - 1) / line_elems * line_elems;
    }
    for (int64_t t0 = 0; t0 < n_tok; t0 += kGroupTile) {
      const int64_t tile = std::min(kGroupTile, n_tok - t0);
      for (int64_t i = 0; i < w.q_count; ++i) {
        const int64_t visible = std::min(tile, first_pos + w.q_begin + i - pos0 - t0 + 1);
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          if (visible <= 0) {
            prefetch_some(pk, pv, pf_left, pf_step * kGroupTile, line_elems);
            continue;
          }
          const int64_t r0 = i * num_heads + g * G;
          const vf* qr = qbuf + r0 * kNV;
          const cache_t* kr = kb + t0 * slot_elems + g * D;
          const cache_t* vr = vb + t0 * slot_elems + g * D;
          vf sc[G][kTileVecs];
          for (int tv = 0; tv < kTileVecs; ++tv) {
            vf dots[G][ES_W];
            for (int64_t t = 0; t < kW; ++t) {
              const int64_t key = tv * kW + t;
              prefetch_some(pk, pv, pf_left, pf_step, line_elems);
              if (key >= visible) {
                for (int gg = 0; gg < G; ++gg) dots[gg][t] = vf{};
                continue;
              }
              const cache_t* kt = kr + key * slot_elems;
              vf a[G];
              if constexpr (kSplit) {
                vf ke, ko;
                load_bf16_split(kt, ke, ko);
                for (int gg = 0; gg < G; ++gg) a[gg] = qr[gg * kNV] * ke + qr[gg * kNV + 1] * ko;
                for (int64_t j = 2; j < kNV; j += 2) {
                  load_bf16_split(kt + j * kW, ke, ko);
                  for (int gg = 0; gg < G; ++gg)
                    a[gg] += qr[gg * kNV + j] * ke + qr[gg * kNV + j + 1] * ko;
                }
              } else {
                const vf k0 = loadv(kt);
                for (int gg = 0; gg < G; ++gg) a[gg] = qr[gg * kNV] * k0;
                for (int64_t j = 1; j < kNV; ++j) {
                  const vf kj = loadv(kt + j * kW);
                  for (int gg = 0; gg < G; ++gg) a[gg] += qr[gg * kNV + j] * kj;
                }
              }
              for (int gg = 0; gg < G; ++gg) dots[gg][t] = a[gg];
            }
            for (int gg = 0; gg < G; ++gg) {
              const vf s = reduce_lanes(dots[gg]);
              sc[gg][tv] = lane + (int)(tv * kW) < (int)visible ? s : vf{} - INFINITY;
            }
          }
          // One exponential for the G rows' rescale factors, one per score vector.
          float m_new[G];
          vf shift{};
          for (int gg = 0; gg < G; ++gg) {
            vf mx = sc[gg][0];
            for (int tv = 1; tv < kTileVecs; ++tv) mx = mx > sc[gg][tv] ? mx : sc[gg][tv];
            m_new[gg] = std::max(m[r0 + gg], hmax(mx));
            shift[gg] = m[r0 + gg] - m_new[gg];  // -inf before the first key: factor 0
          }
          const vf corrv = exp_v(shift);
          float ev[G][kGroupTile];
          float corr[G];
          for (int gg = 0; gg < G; ++gg) {
            const int64_t r = r0 + gg;
            vf sum{};
            for (int tv = 0; tv < kTileVecs; ++tv) {
              const vf e = exp_v(sc[gg][tv] - m_new[gg]);
              sum += e;
              std::memcpy(ev[gg] + tv * kW, &e, sizeof(e));
            }
            corr[gg] = corrv[gg];
            l[r] = l[r] * corr[gg] + hsum(sum);
            m[r] = m_new[gg];
          }
          for (int64_t jc = 0; jc < kNV; jc += JC) {
            vf ar[G][JC];
            for (int gg = 0; gg < G; ++gg)
              for (int j = 0; j < JC; ++j) ar[gg][j] = acc[(r0 + gg) * kNV + jc + j] * corr[gg];
            for (int64_t t = 0; t < visible; ++t) {
              const cache_t* vt = vr + t * slot_elems + jc * kW;
              if constexpr (kSplit) {
                for (int j = 0; j < JC; j += 2) {
                  vf ve, vo;
                  load_bf16_split(vt + j * kW, ve, vo);
                  for (int gg = 0; gg < G; ++gg) {
                    ar[gg][j] += ev[gg][t] * ve;
                    ar[gg][j + 1] += ev[gg][t] * vo;
                  }
                }
              } else {
                for (int j = 0; j < JC; ++j) {
                  const vf v = loadv(vt + j * kW);
                  for (int gg = 0; gg < G; ++gg) ar[gg][j] += ev[gg][t] * v;
                }
              }
            }
            for (int gg = 0; gg < G; ++gg)
              for (int j = 0; j < JC; ++j) acc[(r0 + gg) * kNV + jc + j] = ar[gg][j];
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / num_heads;
    const int64_t h = r % num_heads;
    float* dst = out + (tok * num_heads + h) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t j = 0; j < kNV; ++j) {
      const vf o = acc[r * kNV + j] * inv;
      if constexpr (kSplit) {
        if (j % 2 == 1) merge_even_odd(acc[r * kNV + j - 1] * inv, o, dst + (j - 1) * kW);
      } else {
        std::memcpy(dst + j * kW, &o, sizeof(o));
      }
    }
  }
}

// --- prefill: query tiles against transposed key tiles --------------------------------------
// A prefill chunk has many query rows per sequence, so its items are (16 query tokens, one kv
// group): up to 16 x G rows that read each K/V tile once. The tile's 16 keys are widened and
// transposed once (kt[d][key]) so a row's 16 scores come out of head_dim FMAs with the keys
// on the lanes: no horizontal sums per key, which the decode kernel pays for each row and
// which bound it here (~35 GFLOP/s a core). V is widened once per tile too, for all rows.
constexpr int64_t kPrefillTokens = 16;
// Keys per tile, gathered across blocks: 32, so each broadcast q value feeds two key vectors;
// at 16 keys the broadcasts, not the FMAs, bound the scores.
constexpr int64_t kKeyTile = 32;
constexpr int kKeyVecs = static_cast<int>(kKeyTile / kW);
// Register blocks (rows x vectors) for the scores and for P.V: as many accumulators as
// AVX-512's 32 registers hold beside the vectors they multiply.
constexpr int kScoreRows = 8;
constexpr int kValueRows = 6;
constexpr int kValueVecs = 4;
constexpr int64_t kRowPad = 24;  // a multiple of both row blocks

template <typename cache_t, int kNV>
void run_item_prefill(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
                      const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
                      int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
                      int64_t block_size, float scale) {
  constexpr int64_t D = kNV * kW;
  const int64_t G = num_heads / num_kv_heads;
  const int64_t g = w.kv_group;
  const int64_t rows = w.q_count * G;  // row r: token r / G, head g * G + r % G
  // Padded to whole register blocks; padded rows see nothing and are never stored.
  const int64_t padded = (rows + kRowPad - 1) / kRowPad * kRowPad;
  const int64_t T = block_size;
  const int64_t slot_elems = num_kv_heads * D;
  std::vector<float> qs(padded * D, 0.f), acc(padded * D, 0.f), m(padded, -INFINITY),
      l(padded, 0.f), p(padded * kKeyTile, 0.f), corr(padded, 1.f);
  std::vector<int64_t> last(padded, -1);
  const int64_t first_pos = seq_len - qlen;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / G;
    const float* src = q + (tok * num_heads + g * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
    last[r] = first_pos + w.q_begin + r / G;
  }
  alignas(64) float kt[D * kKeyTile];  // kt[d * kKeyTile + key]
  alignas(64) float vt[kKeyTile * D];  // vt[key * D + d]
  vi lane;
  for (int64_t i = 0; i < kW; ++i) lane[i] = static_cast<int32_t>(i);
  const int64_t ctx = first_pos + w.q_begin + w.q_count;
  const int64_t line_elems = 64 / static_cast<int64_t>(sizeof(cache_t));
  auto slot = [&](int64_t key) {  // offset of this kv group's head for a key position
    return block_table[key / T] * T * slot_elems + (key % T) * slot_elems + g * D;
  };
  for (int64_t pos = 0; pos < ctx; pos += kKeyTile) {
    const int64_t n = std::min(kKeyTile, ctx - pos);
    // The next tile's K/V lines, while this one computes (hundreds of FMAs per line).
    for (int64_t key = pos + kKeyTile; key < std::min(ctx, pos + 2 * kKeyTile); ++key) {
      const int64_t off = slot(key);
      for (int64_t e = 0; e < D; e += line_elems) {
        __builtin_prefetch(k_cache + off + e);
        __builtin_prefetch(v_cache + off + e);
      }
    }
    for (int64_t t = 0; t < kKeyTile; ++t) {
      if (t < n) {
        const cache_t* ks = k_cache + slot(pos + t);
        const cache_t* vs = v_cache + slot(pos + t);
        for (int64_t j = 0; j < kNV; ++j) {
          const vf kv = loadv(ks + j * kW);
          for (int64_t i = 0; i < kW; ++i) kt[(j * kW + i) * kKeyTile + t] = kv[i];
          const vf vv = loadv(vs + j * kW);
          std::memcpy(vt + t * D + j * kW, &vv, sizeof(vv));
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          kt[d * kKeyTile + t] = 0.f;
          vt[t * D + d] = 0.f;
        }
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kScoreRows) {
      vf s[kScoreRows][kKeyVecs];
      for (int rr = 0; rr < kScoreRows; ++rr)
        for (int j = 0; j < kKeyVecs; ++j) s[rr][j] = vf{};
      const float* q0 = qs.data() + r0 * D;
      for (int64_t d = 0; d < D; ++d) {
        vf kd[kKeyVecs];
        for (int j = 0; j < kKeyVecs; ++j)
          std::memcpy(&kd[j], kt + d * kKeyTile + j * kW, sizeof(vf));
        for (int rr = 0; rr < kScoreRows; ++rr) {
          const float qd = q0[rr * D + d];
          for (int j = 0; j < kKeyVecs; ++j) s[rr][j] += qd * kd[j];
        }
      }
      vf shift{};  // per row: old max - new max, for one exponential of all corrections
      float sums[kScoreRows];
      for (int rr = 0; rr < kScoreRows; ++rr) {
        const int64_t r = r0 + rr;
        const int64_t visible = std::min(n, last[r] - pos + 1);
        sums[rr] = 0.f;
        if (visible <= 0) {  // a later token's key (or a padded row): nothing to add
          std::memset(p.data() + r * kKeyTile, 0, kKeyTile * sizeof(float));
          continue;  // shift 0: correction 1
        }
        vf mx = vf{} - INFINITY;
        for (int j = 0; j < kKeyVecs; ++j) {
          s[rr][j] = lane + (int)(j * kW) < (int)visible ? s[rr][j] : vf{} - INFINITY;
          mx = mx > s[rr][j] ? mx : s[rr][j];
        }
        const float m_new = std::max(m[r], hmax(mx));
        shift[rr] = m[r] - m_new;  // -inf before the row's first key: correction 0
        vf sum{};
        for (int j = 0; j < kKeyVecs; ++j) {
          const vf e = exp_v(s[rr][j] - m_new);
          sum += e;
          std::memcpy(p.data() + r * kKeyTile + j * kW, &e, sizeof(e));
        }
        sums[rr] = hsum(sum);
        m[r] = m_new;
      }
      const vf cv = exp_v(shift);
      for (int rr = 0; rr < kScoreRows; ++rr) {
        corr[r0 + rr] = cv[rr];
        l[r0 + rr] = l[r0 + rr] * cv[rr] + sums[rr];
      }
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kValueRows)
      for (int64_t j0 = 0; j0 < kNV; j0 += kValueVecs) {
        vf a[kValueRows][kValueVecs];
        for (int rr = 0; rr < kValueRows; ++rr)
          for (int j = 0; j < kValueVecs; ++j) {
            vf x;
            std::memcpy(&x, acc.data() + (r0 + rr) * D + (j0 + j) * kW, sizeof(x));
            a[rr][j] = x * corr[r0 + rr];
          }
        for (int64_t t = 0; t < n; ++t) {
          vf v[kValueVecs];
          for (int j = 0; j < kValueVecs; ++j)
            std::memcpy(&v[j], vt + t * D + (j0 + j) * kW, sizeof(vf));
          for (int rr = 0; rr < kValueRows; ++rr) {
            const float pt = p[(r0 + rr) * kKeyTile + t];
            for (int j = 0; j < kValueVecs; ++j) a[rr][j] += pt * v[j];
          }
        }
        for (int rr = 0; rr < kValueRows; ++rr)
          for (int j = 0; j < kValueVecs; ++j)
            std::memcpy(acc.data() + (r0 + rr) * D + (j0 + j) * kW, &a[rr][j], sizeof(vf));
      }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t tok = q_token0 + w.q_begin + r / G;
    float* dst = out + (tok * num_heads + g * G + r % G) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[r * D + d] * inv;
  }
}

// kNV: head_dim / kW fixed at compile time (e.g. 4 or 8 for head_dim 64) so the per-row
// vectors live in registers; 0 means "read it at run time" for other head sizes.
//
// Keys are taken kW at a time (a "tile", within one block): each row's kW dot products are
// reduced together into one vector of scores, so the online softmax runs on whole vectors.
// An fp32 cache whose head_dim is a multiple of kW is read in place; a 16-bit one too when the
// item has one row per kv head (16-bit values widen in registers). Otherwise each block is
// first converted (and zero-padded) into a small fp32 copy shared by all rows.
template <typename cache_t, int kNV>
void run_item(const WorkItem& w, const float* q, float* out, const cache_t* k_cache,
              const cache_t* v_cache, const int64_t* block_table, int64_t q_token0,
              int64_t seq_len, int64_t qlen, int64_t num_heads, int64_t num_kv_heads,
              int64_t head_dim, int64_t block_size, float scale, int64_t window,
              float softcap) {
  const int64_t D = head_dim;
  if (window > 0 || softcap > 0.f) {  // only the one-pass kernel masks windows and caps
    if (D % kW == 0 && std::is_same<cache_t, float>::value)
      run_item_src<cache_t, true, kNV>(w, q, out, k_cache, v_cache, block_table, q_token0,
                                       seq_len, qlen, num_heads, num_kv_heads, D, block_size,
                                       scale, window, softcap);
    else
      run_item_src<cache_t, false, kNV>(w, q, out, k_cache, v_cache, block_table, q_token0,
                                        seq_len, qlen, num_heads, num_kv_heads, D, block_size,
                                        scale, window, softcap);
    return;
  }
  if constexpr (kNV > 0) {
    if (w.kv_group >= 0) {
      run_item_prefill<cache_t, kNV>(w, q, out, k_cache, v_cache, block_table, q_token0,
                                     seq_len, qlen, num_heads, num_kv_heads, block_size, scale);
      return;
    }
    const int64_t group = num_heads / num_kv_heads;
    if (w.q_count * num_heads <= kMaxItemRows && group <= 4) {
      auto fn = group == 1 ? &run_item_grouped<cache_t, kNV, 1>
              : group == 2 ? &run_item_grouped<cache_t, kNV, 2>
              : group == 3 ? &run_item_grouped<cache_t, kNV, 3>
                           : &run_item_grouped<cache_t, kNV, 4>;
      fn(w, q, out, k_cache, v_cache, block_table, q_token0, seq_len, qlen, num_heads,
         num_kv_heads, D, block_size, scale);
      return;
    }
  }
  // A 16-bit cache read in place is widened once per row; with several rows per kv head one
  // widening into the block copy, shared by all rows, is cheaper (measured both ways).
  const bool one_row = w.q_count * (num_heads / num_kv_heads) == 1;
  if (D % kW == 0 && (std::is_same<cache_t, float>::value || one_row)) {
    run_item_src<cache_t, true, kNV>(w, q, out, k_cache, v_cache, block_table, q_token0,
                                     seq_len, qlen, num_heads, num_kv_heads, D, block_size,
                                     scale);
  } else {
    // kNV > 0 only when head_dim == kNV * kW: the copy keeps the register-resident rows too.
    run_item_src<cache_t, false, kNV>(w, q, out, k_cache, v_cache, block_table, q_token0,
                                      seq_len, qlen, num_heads, num_kv_heads, D, block_size,
                                      scale);
  }
}

template <typename cache_t>
void run_all(const at::Tensor& q, at::Tensor& out, const at::Tensor& key_cache,
             const at::Tensor& value_cache, const at::Tensor& block_tables,
             const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
             int64_t rows_per_item, int64_t window, double softcap) {
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t num_heads = q.size(1), D = q.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  // Query tokens per item: all heads of this many tokens share each pass over the K/V blocks.
  const int64_t tile = std::max<int64_t>(1, rows_per_item / num_heads);

  // Prefill chunks take the tiled kernel in AVX-512 builds, where head_dim has a compiled
  // register layout; decode rows keep the kernel that shares K/V across all heads. A 1,500-token
  // prompt's three 512-token chunks, bf16 cache, per layer: AVX-512 21.8 -> 13.9 ms; with
  // AVX2's 16 registers every register block tried was slower than the grouped kernel
  // (26.7 ms vs 34-67), so AVX2 and generic builds keep it.
  const bool tiled_prefill = kW == 16 && (D == 4 * kW || D == 8 * kW || D == 16 * kW) &&
                             window == 0 && softcap == 0.0;
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t qlen = qsl[i + 1] - qsl[i];
    if (tiled_prefill && qlen >= kPrefillTokens) {
      for (int64_t q0 = 0; q0 < qlen; q0 += kPrefillTokens) {
        const int64_t cnt = std::min(kPrefillTokens, qlen - q0);
        const int64_t ctx = lens[i] - qlen + q0 + cnt;
        for (int64_t g = 0; g < num_kv_heads; ++g)
          items.push_back({i, q0, cnt, cnt * (num_heads / num_kv_heads) * ctx, g});
      }
      continue;
    }
    for (int64_t q0 = 0; q0 < qlen; q0 += tile) {
      const int64_t cnt = std::min(tile, qlen - q0);
      const int64_t ctx = lens[i] - qlen + q0 + cnt;
      items.push_back({i, q0, cnt, cnt * num_heads * ctx});
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
  // Head sizes with a fixed vector count per row; others read it at run time.
  auto item_fn = D == 4 * kW    ? &run_item<cache_t, 4>
                 : D == 8 * kW  ? &run_item<cache_t, 8>
                 : D == 16 * kW ? &run_item<cache_t, 16>  // head_dim 128 on AVX2
                                : &run_item<cache_t, 0>;
  const int n_threads = std::max(1, std::min<int>(at::get_num_threads(), (int)n_items));
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads)
  for (int64_t j = 0; j < n_items; ++j) {
    const WorkItem& w = items[j];
    const int64_t i = w.seq;
    item_fn(w, qp, op, kp, vp, bt + i * max_blocks, qsl[i], lens[i], qsl[i + 1] - qsl[i],
            num_heads, num_kv_heads, D, block_size, static_cast<float>(scale), window,
            static_cast<float>(softcap));
  }
}

// q: [num_tokens, num_heads, head_dim] fp32; caches: [num_blocks, block_size, kv_heads, head_dim]
// fp32/bf16/fp16; block_tables [num_seqs, max_blocks], query_start_loc, seq_lens: int64.
// Returns fp32 [num_tokens, num_heads, head_dim].
// window > 0: a sliding window; softcap > 0: capped scores (see run_item_src).
at::Tensor paged_attention_ext(const at::Tensor& q, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               double scale, int64_t rows_per_item, int64_t window,
                               double softcap) {
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
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must not be negative");
  at::Tensor out = at::empty(q.sizes(), q.options());
  switch (key_cache.scalar_type()) {
    case at::kFloat:
      run_all<float>(q, out, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                     scale, rows_per_item, window,
                     softcap);
      break;
    case at::kBFloat16:
      run_all<c10::BFloat16>(q, out, key_cache, value_cache, block_tables, query_start_loc,
                             seq_lens, scale, rows_per_item, window,
                     softcap);
      break;
    case at::kHalf:
      run_all<c10::Half>(q, out, key_cache, value_cache, block_tables, query_start_loc,
                         seq_lens, scale, rows_per_item, window,
                     softcap);
      break;
    default:
      TORCH_CHECK(false, "unsupported cache dtype ", key_cache.scalar_type());
  }
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                           double scale, int64_t rows_per_item) {
  return paged_attention_ext(q, key_cache, value_cache, block_tables, query_start_loc,
                             seq_lens, scale, rows_per_item, 0, 0.0);
}

}  // namespace

ES_LIBRARY(m) {
  m.def("paged_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int rows_per_item) -> Tensor");
  m.def("paged_attention_ext(Tensor q, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
        "int rows_per_item, int window, float softcap) -> Tensor");
}

ES_LIBRARY_IMPL(m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_ext", &paged_attention_ext);
}

// With external linkage for the decoder stack (see the note at the end of fused_ops.cpp).
namespace ES_NS {
at::Tensor direct_paged_attention(const at::Tensor& q, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                                  double scale, int64_t rows_per_item) {
  return paged_attention(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                         scale, rows_per_item);
}
at::Tensor direct_paged_attention_ext(const at::Tensor& q, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache,
                                      const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc,
                                      const at::Tensor& seq_lens, double scale,
                                      int64_t rows_per_item, int64_t window, double softcap) {
  return paged_attention_ext(q, key_cache, value_cache, block_tables, query_start_loc,
                             seq_lens, scale, rows_per_item, window, softcap);
}
}  // namespace ES_NS
