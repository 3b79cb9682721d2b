// Linear layers on weights kept in GGUF's 32-value block formats (and on 16-bit weights next to
// fp32 activations), without ever materializing a whole dequantized weight:
//
//   q8_0  [half d][int8 q x32]                   34 B / 32 values   w = d * q
//   q4_0  [half d][uint8 qs x16]                 18 B / 32 values   w = d * (q - 8)
//   q4_1  [half d][half m][uint8 qs x16]         20 B / 32 values   w = d * q + m
//         (qs[j] holds value j in its low nibble and value j + 16 in its high nibble)
//
//   linear_q_small(x, w, fmt, k)  x [rows, k] @ W.T with int8 activations: the decode GEMV
//                                 on integer block dots, the same per row at any row count.
//   linear_q_small_path(..., 0)   the same on fp32 activations: each block is widened to fp32
//                                 in registers and multiplied into up to 8 rows, so the
//                                 weights stream from memory exactly once.
//   linear_q_tiled(x, w, fmt, k)  x [rows, k] @ W.T for prefill: each thread widens a tile of
//                                 output rows into a cache-resident fp32 buffer and hands it to
//                                 the library GEMM (single-threaded inside the tile loop).
//   linear_q_tiled_bf16(...)      the same with bf16 tiles and a bf16 GEMM, for a bf16 x.
//
// fmt: 0 = a dense fp16/bf16 weight [n, k], 1 = q8_0, 2 = q4_0, 3 = q4_1, and 4..6 the same
// three interleaved 16 rows at a time (csrc/block_x16.h; layers/quant.py).
// Activations are fp32 inside (a 16-bit x is widened once; the output is cast back), except in
// linear_q_tiled_bf16.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_x16.h"
#include "int_dots.h"
#include "simd.h"

namespace {

constexpr int64_t kBlock = 32;
constexpr int kV = 32 / ES_W;  // vectors per block
constexpr int64_t kMaxSmallRows = 8;

// NOTE: GCC's generic __builtin_convertvector from byte vectors to floats goes one lane at a
// time (vpextrb + vcvtusi2ss per value), so the widening is spelled out with intrinsics.

// W signed bytes as fp32.
inline vf s8_to_vf(const uint8_t* p) {
#if ES_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif ES_W == 8 && defined(__AVX2__)
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  float tmp[ES_W];
  for (int i = 0; i < ES_W; ++i) tmp[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  vf out;
  std::memcpy(&out, tmp, sizeof(out));
  return out;
#endif
}

// The low (high: the high) nibbles of W bytes as fp32 in [0, 15].
inline vf nibbles_to_vf(const uint8_t* p, bool high) {
#if ES_W == 16 && defined(__AVX512F__)
  __m128i x = _mm_loadu_si128((const __m128i*)p);
  if (high) x = _mm_srli_epi16(x, 4);
  x = _mm_and_si128(x, _mm_set1_epi8(0x0f));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x));
#elif ES_W == 8 && defined(__AVX2__)
  __m128i x = _mm_loadl_epi64((const __m128i*)p);
  if (high) x = _mm_srli_epi16(x, 4);
  x = _mm_and_si128(x, _mm_set1_epi8(0x0f));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x));
#else
  float tmp[ES_W];
  for (int i = 0; i < ES_W; ++i) tmp[i] = static_cast<float>(high ? p[i] >> 4 : p[i] & 0x0f);
  vf out;
  std::memcpy(&out, tmp, sizeof(out));
  return out;
#endif
}

enum Fmt { kDense = 0, kQ8_0 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0x16 = 4, kQ4_0x16 = 5, kQ4_1x16 = 6 };

// An interleaved format's standard one (the same blocks, stored 16 rows at a time).
inline int64_t base_fmt(int64_t fmt) { return fmt >= kQ8_0x16 ? fmt - 3 : fmt; }
inline bool is_x16(int64_t fmt) { return fmt >= kQ8_0x16; }
inline int64_t block_bytes(int64_t fmt) {
  const int64_t f = base_fmt(fmt);
  return f == kQ8_0 ? 34 : (f == kQ4_0 ? 18 : 20);
}

// A block weight: the blocks of rows [n0, n0 + rows) in the standard layout, for the readers
// that take rows one at a time. An interleaved weight's rows are unpacked into `buf`.
inline const uint8_t* standard_rows(const uint8_t* w, int64_t fmt, int64_t row_bytes, int64_t n0,
                                    int64_t rows, std::vector<uint8_t>& buf) {
  if (!is_x16(fmt)) return w + n0 * row_bytes;
  buf.resize(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r)
    x16_unpack_row(w, row_bytes, block_bytes(fmt), n0 + r, buf.data() + r * row_bytes);
  return buf.data();
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

#if ES_W == 16 && defined(__AVX512F__)
// A float in every lane, broadcast from memory: a load-broadcast takes no shuffle port, which
// the nibble lookups keep busy (a register broadcast of each block scale cost the Q4_1 GEMV
// ~15% on Zen 4). Inline assembly: GCC otherwise broadcasts the float from a register.
inline vf broadcast_mem(const float* f) {
  __m512 v;
  asm("vbroadcastss %1, %0" : "=v"(v) : "m"(*f));
  return (vf)v;
}
#endif

template <int F>
struct Block;

template <>
struct Block<kQ8_0> {
  static constexpr int64_t kBytes = 34;
  static inline void load(const uint8_t* b, vf* out) {
    const vf d = vf{} + half_at(b);
    for (int v = 0; v < kV; ++v) out[v] = s8_to_vf(b + 2 + v * ES_W) * d;
  }
};

// The nibble-packed formats: vector v holds values [v * W, (v + 1) * W): low nibbles of bytes
// for the first half of the block, high nibbles for the second.
#if ES_W == 16 && defined(__AVX512F__)
// A block is two vectors here, and its 16 possible values q * d + bias fit one register: each
// weight is looked up there (vpermps indexes by a lane's low 4 bits) rather than converted and
// scaled, two FP ops per vector fewer; the table is computed by the same expression as the
// widened values, so the weights are bit-identical. Q4_1 decode GEMV, one thread, Zen 4:
// 0.78x the time of the widening (with broadcast_mem for the scales).
inline void load_nibbles(const uint8_t* qs, vf d, vf bias, vf* out) {
  const vf iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf table = iota * d + bias;
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  out[0] = (vf)_mm512_permutexvar_ps(bytes, (__m512)table);
  out[1] = (vf)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), (__m512)table);
}
#else
inline void load_nibbles(const uint8_t* qs, vf d, vf bias, vf* out) {
  constexpr int kHalf = kV / 2;
  for (int v = 0; v < kV; ++v) out[v] = nibbles_to_vf(qs + (v % kHalf) * ES_W, v >= kHalf) * d + bias;
}
#endif

template <>
struct Block<kQ4_0> {
  static constexpr int64_t kBytes = 18;
  static inline void load(const uint8_t* b, vf* out) {
    const float d = half_at(b);
#if ES_W == 16 && defined(__AVX512F__)
    const float f[2] = {d, 0.f - 8.f * d};  // the lanes of vf{} - 8.f * d
    load_nibbles(b + 2, broadcast_mem(f), broadcast_mem(f + 1), out);
#else
    load_nibbles(b + 2, vf{} + d, vf{} - 8.f * d, out);
#endif
  }
};

template <>
struct Block<kQ4_1> {
  static constexpr int64_t kBytes = 20;
  static inline void load(const uint8_t* b, vf* out) {
#if ES_W == 16 && defined(__AVX512F__)
    alignas(16) float f[4];
    _mm_store_ps(f, _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(load_u32(b)))));
    load_nibbles(b + 4, broadcast_mem(f), broadcast_mem(f + 1), out);
#else
    load_nibbles(b + 4, vf{} + half_at(b), vf{} + half_at(b + 2), out);
#endif
  }
};

// Output columns per step: R x C accumulators plus C x kV weight vectors fit the register file
// (32 vector registers with AVX-512, 16 with AVX2).
template <int R>
constexpr int kQCols = ES_W == 16 ? (R <= 3 ? 4 : (R <= 6 ? 2 : 1)) : (R <= 2 ? 2 : 1);

template <int F, int R, int C>
void qgemv_columns(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes,
                   int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  constexpr int64_t B = Block<F>::kBytes;
  const int64_t nb = k / kBlock;
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    vf acc[R][C];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j) acc[m][j] = vf{};
    const uint8_t* w0 = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      vf wv[C][kV];
      for (int j = 0; j < C; ++j) {
        // The next group's rows, same offset: keeps 2C streams of cache-line fills in flight.
        __builtin_prefetch(w0 + (C + j) * row_bytes + b * B);
        Block<F>::load(w0 + j * row_bytes + b * B, wv[j]);
      }
      for (int m = 0; m < R; ++m) {
        const float* xb = x + m * k + b * kBlock;
        for (int v = 0; v < kV; ++v) {
          const vf xv = loadv(xb + v * ES_W);
          for (int j = 0; j < C; ++j) acc[m][j] += xv * wv[j][v];
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j) out[m * out_stride + n + j] = hsum(acc[m][j]);
  }
  if constexpr (C > 1) {
    if (n < n_end) qgemv_columns<F, R, 1>(x, k, w, row_bytes, n, n_end, out, out_stride);
  }
}

template <int R = 1, typename Fn>
void with_rows(int64_t rows, const Fn& f) {
  if constexpr (R <= kMaxSmallRows) {
    if (rows == R)
      f(std::integral_constant<int, R>{});
    else
      with_rows<R + 1>(rows, f);
  }
}

// Columns over threads: chunks of 32 columns so both threads share even the small
// projections; a weight that streams in a few microseconds stays on one thread.
template <typename Fn>
void over_columns(int64_t n, int64_t row_bytes, const Fn& body) {
  if (n * row_bytes < (int64_t{1} << 16)) {
    body(0, n);
  } else {
    at::parallel_for(0, (n + 31) / 32, 1, [&](int64_t b, int64_t e) {
      body(b * 32, std::min(e * 32, n));
    });
  }
}

// Up to kMaxSmallRows rows: one pass over the weights, every block widened once for all rows.
// More rows (a decode batch of 9 or more sequences; any pass in batch-invariant mode): the rows
// go 8 at a time over a group of columns whose blocks (~256 KiB) stay in L2, so the weights
// still stream from memory once and only the widening is repeated per 8 rows. Dequantizing the whole weight for a GEMM
// instead costs a write and a read of it as fp32 per call: a 9-row decode step of the default
// model took ~3x an 8-row one that way.
constexpr int64_t kGroupBytes = int64_t{256} << 10;

template <int F>
void linear_q_small_impl(const at::Tensor& x32, const at::Tensor& w, int64_t k, bool x16,
                         at::Tensor& out) {
  const int64_t n = w.size(0), row_bytes = w.size(1), rows = x32.size(0);
  const float* xp = x32.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (x16) {
    // A group of 16 rows unpacked to the standard layout (it stays in L1/L2) and multiplied
    // into every row of x there: each column's sums are the standard layout's.
    over_columns(n, row_bytes, [&](int64_t b, int64_t e) {
      std::vector<uint8_t> buf;
      for (int64_t c0 = b; c0 < e; c0 += kX16) {
        const uint8_t* g = standard_rows(wp, F + 3, row_bytes, c0, kX16, buf);
        for (int64_t r0 = 0; r0 < rows; r0 += kMaxSmallRows) {
          with_rows(std::min(kMaxSmallRows, rows - r0), [&](auto r) {
            constexpr int R = decltype(r)::value;
            qgemv_columns<F, R, kQCols<R>>(xp + r0 * k, k, g, row_bytes, 0, kX16,
                                           op + r0 * n + c0, n);
          });
        }
      }
    });
    return;
  }
  if (rows <= kMaxSmallRows) {
    with_rows(rows, [&](auto r) {
      constexpr int R = decltype(r)::value;
      over_columns(n, row_bytes, [&](int64_t b, int64_t e) {
        qgemv_columns<F, R, kQCols<R>>(xp, k, wp, row_bytes, b, e, op, n);
      });
    });
    return;
  }
  const int64_t group = std::max<int64_t>(8, kGroupBytes / row_bytes / 8 * 8);
  over_columns(n, row_bytes, [&](int64_t b, int64_t e) {
    for (int64_t c0 = b; c0 < e; c0 += group) {
      const int64_t c1 = std::min(e, c0 + group);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxSmallRows) {
        with_rows(std::min(kMaxSmallRows, rows - r0), [&](auto r) {
          constexpr int R = decltype(r)::value;
          qgemv_columns<F, R, kQCols<R>>(xp + r0 * k, k, wp, row_bytes, c0, c1, op + r0 * n, n);
        });
      }
    }
  });
}

// --- decode with integer dot products -------------------------------------------------------
//
// As llama.cpp does: each 32-value block of x is quantized to int8 with its own scale (q8_0's
// rounding), and a block of weights meets it as 32 byte products summed in int32; one float
// multiply-add per block applies both scales. Weights enter the dot as unsigned bytes (nibbles
// 0..15, or |w| for q8_0 with w's sign moved onto x), the form vpdpbusd and vpmaddubsw take;
// the zero point comes from x's sums (q4_0's 8 in int32: the dot starts from -8 * x's lane
// sums, computed once per block of x; q4_1's m in fp32 per block):
//
//   q8_0  sum d q * dx qx                = d dx sum(|q| * sign(q) qx)
//   q4_0  sum d (q - 8) * dx qx          = d dx (sum(q qx) - 8 sum(qx))
//   q4_1  sum (d q + m) * dx qx          = d dx sum(q qx) + m * dx sum(qx)
//
// Three ways to take the 32-byte dot, chosen at run time from the CPU's flags (or by the
// caller, for tests and benchmarks): AVX2 vpmaddubsw + vpmaddwd, AVX-VNNI vpdpbusd, and
// AVX512-VNNI vpdpbusd on 256-bit registers (a block is 32 bytes: one register).
enum DotPath { kFloatPath = 0, kMaddubs = 1, kAvxVnni = 2, kAvx512Vnni = 3 };

struct QuantizedRows {
  std::vector<int8_t> q;   // [rows, k]
  std::vector<float> d;    // [rows, k / 32] scale
  std::vector<float> s;    // [rows, k / 32] dx * sum(qx): the block's sum as the dot sees it
  // [rows, k / 32, 8] -8 * the sum of each 4 consecutive qx: the int32 lanes a 32-byte dot
  // starts from so that it takes q4_0's nibbles q as q - 8 (one add per block saved per column).
  std::vector<int32_t> m8;
  std::vector<int32_t> sum;  // [rows, k / 32] sum(qx), for the interleaved layout's dots
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock;
  QuantizedRows out{std::vector<int8_t>(rows * k), std::vector<float>(rows * nb),
                    std::vector<float>(rows * nb), std::vector<int32_t>(rows * nb * 8),
                    std::vector<int32_t>(rows * nb)};
  for (int64_t i = 0; i < rows * nb; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(xb[j] * inv));
      out.q[i * kBlock + j] = static_cast<int8_t>(q);
      out.m8[i * 8 + j / 4] -= 8 * q;
      sum += q;
    }
    out.d[i] = d;
    out.s[i] = d * static_cast<float>(sum);
    out.sum[i] = sum;
  }
  return out;
}

// x with every 32-value block replaced by the values the integer dots see (d * q, fp32): what
// every other row count multiplies when int8 activations are on, so a token computes the same
// product (up to the order of fp32 sums) whether it is decoded alone or inside a prefill chunk.
at::Tensor round_int8_blocks(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0,
              "round_int8_blocks: x [rows, k] with k divisible by 32");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t rows = x32.size(0), k = x32.size(1);
  at::Tensor out = at::empty({rows, k}, x32.options());
  const float* xp = x32.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // quantize_rows' arithmetic, block by block over the threads (a prefill chunk rounds each
  // projection's input: serial, it cost a 128-row step ~3%).
  at::parallel_for(0, rows * (k / kBlock), 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = xp + i * kBlock;
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(xb[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t j = 0; j < kBlock; ++j)
        op[i * kBlock + j] = d * static_cast<float>(static_cast<int32_t>(std::nearbyint(xb[j] * inv)));
    }
  });
  return out;
}

#if defined(__AVX2__)

inline float half_scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A block's fp16 scale in all 8 lanes.
inline __m256 half_broadcast(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16(static_cast<short>(h)));
}

// acc + the dot of unsigned bytes u and signed bytes s, each int32 lane summing 4 products.
struct DotMaddubs {
  static constexpr bool kSigned8 = true;  // saturates on unsigned bytes above 127 (block_x16.h)
  static inline __m256i dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
  }
};

// The VNNI paths (int_dots.h's inline assembly); the caller checks the CPU flag (path_runs).
struct DotAvxVnni {
  static constexpr bool kSigned8 = false;
  static inline __m256i dot(__m256i acc, __m256i u, __m256i s) { return vpdpbusd_vex(acc, u, s); }
};

struct DotAvx512Vnni {
  static constexpr bool kSigned8 = false;
  static inline __m256i dot(__m256i acc, __m256i u, __m256i s) {
    return vpdpbusd_evex(acc, u, s);
  }
};

// Output columns per step for R rows: R x C float accumulators and C weight registers.
template <int R>
constexpr int kICols = R <= 1 ? 4 : (R <= 4 ? 2 : 1);

template <typename Dot, int F, int R, int C>
void igemv_columns(
    const QuantizedRows& xq, int64_t r0, int64_t k, const uint8_t* w, int64_t row_bytes,
    int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  constexpr int64_t B = Block<F>::kBytes;
  const int64_t nb = k / kBlock;
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    __m256 acc[R][C];
    float corr[R][C];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j) acc[m][j] = _mm256_setzero_ps(), corr[m][j] = 0.f;
    const uint8_t* w0 = w + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i wq[C];
      __m256 dw[C];
      float zw[C];
      for (int j = 0; j < C; ++j) {
        const uint8_t* blk = w0 + j * row_bytes + b * B;
        __builtin_prefetch(w0 + (C + j) * row_bytes + b * B);
        dw[j] = half_broadcast(blk);
        if constexpr (F == kQ8_0) {
          wq[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
        } else if constexpr (F == kQ4_0) {
          wq[j] = nibbles_u8(blk + 2);
        } else {
          wq[j] = nibbles_u8(blk + 4);
          zw[j] = half_scalar(blk + 2);
        }
      }
      for (int m = 0; m < R; ++m) {
        const int64_t xr = r0 + m;  // the row of xq
        const __m256i xv =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q.data() + xr * k + b * kBlock));
        const __m256 dx = _mm256_set1_ps(xq.d[xr * nb + b]);
        // q4_0: the dot starts from -8 * x's lane sums, so it sums (q - 8) * qx exactly.
        __m256i start = _mm256_setzero_si256();
        if constexpr (F == kQ4_0)
          start = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq.m8.data() + (xr * nb + b) * 8));
        for (int j = 0; j < C; ++j) {
          __m256i p;
          if constexpr (F == kQ8_0)
            p = Dot::dot(start, _mm256_sign_epi8(wq[j], wq[j]), _mm256_sign_epi8(xv, wq[j]));
          else
            p = Dot::dot(start, wq[j], xv);
          acc[m][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw[j], dx), acc[m][j]);
          // std::fma: one rounding whether or not the compiler would vectorize this sum.
          if constexpr (F == kQ4_1) corr[m][j] = std::fma(zw[j], xq.s[xr * nb + b], corr[m][j]);
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j) out[m * out_stride + n + j] = hsum8(acc[m][j]) + corr[m][j];
  }
  if constexpr (C > 1) {
    if (n < n_end)
      igemv_columns<Dot, F, R, 1>(xq, r0, k, w, row_bytes, n, n_end, out, out_stride);
  }
}

bool path_runs(int64_t path) {
  switch (path) {
    case kFloatPath:
    case kMaddubs: return true;
    case kAvxVnni: return __builtin_cpu_supports("avxvnni") != 0;
    case kAvx512Vnni: return avx512_vnni_allowed();
    default: return false;
  }
}

// Any rows, each row's arithmetic the same whatever the row count (so a batch-invariant pass
// computes every row as a single-row decode does): x quantized once, then up to 8 rows in one
// pass over the weights; more rows go 8 at a time over column groups whose blocks stay in L2,
// as in linear_q_small_impl. Per output, the block dots accumulate in block order into one
// register whatever R and C are, and the threads split columns, never a sum.
template <typename Dot, int F>
void linear_q_int_rows(const QuantizedRows& xq, int64_t rows, int64_t k, const at::Tensor& w,
                       bool x16, float* op) {
  const int64_t n = w.size(0), row_bytes = w.size(1), nb = k / kBlock;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  auto columns = [&](int64_t r0, int64_t c0, int64_t c1) {
    with_rows(std::min(kMaxSmallRows, rows - r0), [&](auto r) {
      constexpr int R = decltype(r)::value;
      if (!x16) {
        igemv_columns<Dot, F, R, kICols<R>>(xq, r0, k, wp, row_bytes, c0, c1, op + r0 * n, n);
        return;
      }
      constexpr int Bytes = Block<F>::kBytes;
      const XRows x{xq.q.data() + r0 * k, xq.d.data() + r0 * nb, xq.s.data() + r0 * nb,
                    xq.sum.data() + r0 * nb};
#if defined(__AVX512F__)
      if constexpr (std::is_same<Dot, DotAvx512Vnni>::value) {
        x16_columns_512<Bytes, R, (R <= 2 ? 2 : 1)>(x, k, wp, row_bytes, c0, c1, op + r0 * n, n);
        return;
      }
#endif
      x16_columns_256<Dot, Bytes, R>(x, k, wp, row_bytes, c0, c1, op + r0 * n, n);
    });
  };
  if (rows <= kMaxSmallRows) {
    over_columns(n, row_bytes, [&](int64_t b, int64_t e) { columns(0, b, e); });
    return;
  }
  // A multiple of 16 columns: an interleaved group is never split.
  const int64_t group = std::max<int64_t>(16, kGroupBytes / row_bytes / 16 * 16);
  over_columns(n, row_bytes, [&](int64_t b, int64_t e) {
    for (int64_t c0 = b; c0 < e; c0 += group)
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxSmallRows) columns(r0, c0, std::min(e, c0 + group));
  });
}

template <int F>
void linear_q_int_impl(const at::Tensor& x32, const at::Tensor& w, int64_t k, int64_t path,
                       bool x16, at::Tensor& out) {
  const int64_t rows = x32.size(0);
  const QuantizedRows xq = quantize_rows(x32.data_ptr<float>(), rows, k);
  float* op = out.data_ptr<float>();
  if (path == kAvx512Vnni)
    linear_q_int_rows<DotAvx512Vnni, F>(xq, rows, k, w, x16, op);
  else if (path == kAvxVnni)
    linear_q_int_rows<DotAvxVnni, F>(xq, rows, k, w, x16, op);
  else
    linear_q_int_rows<DotMaddubs, F>(xq, rows, k, w, x16, op);
}

#else  // no AVX2 in this build: only the float path

bool path_runs(int64_t path) { return path == kFloatPath; }

#endif

// The fastest path this build and CPU run.
int64_t best_path() {
  static const int64_t best = [] {
    for (int64_t p : {kAvx512Vnni, kAvxVnni, kMaddubs})
      if (path_runs(p)) return p;
    return int64_t{kFloatPath};
  }();
  return best;
}

at::Tensor linear_q_small_path(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t k,
                               int64_t path) {
  // Any rows on every path (column groups in L2, 8 rows at a time over each).
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(0) >= 1,
              "linear_q_small: x must be [rows >= 1, k] on dot path ", path);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && k % kBlock == 0,
              "linear_q_small: w must be contiguous uint8 blocks [n, k / 32 * block bytes]");
  TORCH_CHECK(path_runs(path), "linear_q_small: dot path ", path, " does not run here");
  TORCH_CHECK(fmt >= kQ8_0 && fmt <= kQ4_1x16, "linear_q_small: unknown format ", fmt);
  TORCH_CHECK(w.size(1) == k / kBlock * block_bytes(fmt), "linear_q_small: row size");
  TORCH_CHECK(!is_x16(fmt) || w.size(0) % kX16 == 0,
              "linear_q_small: an interleaved weight has a multiple of 16 rows");
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
  const bool x16 = is_x16(fmt);
  if (path == kFloatPath) {
    switch (base_fmt(fmt)) {
      case kQ8_0: linear_q_small_impl<kQ8_0>(x32, w, k, x16, out); break;
      case kQ4_0: linear_q_small_impl<kQ4_0>(x32, w, k, x16, out); break;
      default: linear_q_small_impl<kQ4_1>(x32, w, k, x16, out); break;
    }
  } else {
#if defined(__AVX2__)
    switch (base_fmt(fmt)) {
      case kQ8_0: linear_q_int_impl<kQ8_0>(x32, w, k, path, x16, out); break;
      case kQ4_0: linear_q_int_impl<kQ4_0>(x32, w, k, path, x16, out); break;
      default: linear_q_int_impl<kQ4_1>(x32, w, k, path, x16, out); break;
    }
#endif
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The decode GEMV with int8 activations, at any row count: the fastest integer path here, so a
// row computes bit-identically alone or among others (batch invariance holds with int8
// activations); a build with no integer path widens the weights to fp32 and multiplies x
// rounded per block as the integer paths round it (round_int8_blocks), also the same per row.
// Measured on SmolLM2-135M's Q4_1 projections (gemv bench, Zen 4, AVX512-VNNI): the integer
// dots take 0.71-0.88x the time of the fp32 widening at 1 row, 0.76-1.04x at 2 to 8 rows.
at::Tensor linear_q_small(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t k) {
  if (best_path() != kFloatPath) return linear_q_small_path(x, w, fmt, k, best_path());
  const at::Tensor out = linear_q_small_path(round_int8_blocks(x), w, fmt, k, kFloatPath);
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The dot paths this build runs on this CPU, best last (tests run each).
std::vector<int64_t> int_dot_paths() {
  std::vector<int64_t> out;
  for (int64_t p : {kFloatPath, kMaddubs, kAvxVnni, kAvx512Vnni})
    if (path_runs(p)) out.push_back(p);
  return out;
}

// --- prefill: dequantized tiles into a library GEMM ----------------------------------------
//
// The tiles are fp32, or bf16 where the caller found bf16 GEMMs faster (a CPU with AVX512-BF16
// dot products: oneDNN's bf16 GEMM runs 2.3-3x the fp32 one on the Llama-3.2-1B shapes). A bf16
// tile holds each weight rounded to bf16 (8 significant bits; q8_0's d * q carries up to 19),
// the same rounding a bf16 model's weights have.

// kW fp32 values stored as T.
template <typename T>
inline void store_as(T* dst, vf v) {
  if constexpr (std::is_same<T, float>::value) {
    std::memcpy(dst, &v, sizeof(v));
  } else {
    static_assert(std::is_same<T, c10::BFloat16>::value, "fp32 or bf16 tiles");
    const vh h = vf_to_bf16(v);
    std::memcpy(dst, &h, sizeof(h));
  }
}

template <int F, typename T>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t k, T* dst) {
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + r * row_bytes;
    T* d = dst + r * k;
    for (int64_t b = 0; b < nb; ++b) {
      vf v[kV];
      Block<F>::load(row + b * Block<F>::kBytes, v);
      for (int i = 0; i < kV; ++i) store_as(d + b * kBlock + i * kW, v[i]);
    }
  }
}

template <typename S, typename T>
void widen_rows(const S* w, int64_t rows, int64_t k, T* dst) {
  const int64_t n = rows * k, nv = n - n % kW;
  if constexpr (std::is_same<S, T>::value) {
    std::memcpy(dst, w, n * sizeof(T));
    return;
  }
  for (int64_t i = 0; i < nv; i += kW) store_as(dst + i, loadv(w + i));
  for (int64_t i = nv; i < n; ++i) dst[i] = static_cast<T>(static_cast<float>(w[i]));
}

template <typename T>
void dequant_tile(const at::Tensor& w, int64_t fmt, int64_t k, int64_t n0, int64_t rows,
                  T* dst) {
  if (fmt == kDense) {
    if (w.scalar_type() == at::kBFloat16)
      widen_rows(w.data_ptr<c10::BFloat16>() + n0 * k, rows, k, dst);
    else
      widen_rows(w.data_ptr<c10::Half>() + n0 * k, rows, k, dst);
    return;
  }
  const int64_t rb = w.size(1);
  std::vector<uint8_t> buf;
  const uint8_t* p = standard_rows(w.data_ptr<uint8_t>(), fmt, rb, n0, rows, buf);
  switch (base_fmt(fmt)) {
    case kQ8_0: dequant_rows<kQ8_0>(p, rb, rows, k, dst); break;
    case kQ4_0: dequant_rows<kQ4_0>(p, rb, rows, k, dst); break;
    default: dequant_rows<kQ4_1>(p, rb, rows, k, dst); break;
  }
}

// x @ w.T through oneDNN where torch has it (mkldnn::_linear_pointwise), in x's dtype (fp32 or
// bf16): on AMD Zen MKL's sgemm runs its generic path, 1.15x (AVX2) to 2.2x (AVX-512) slower
// per thread (benchmarks/gemm_backends.py). Inside a parallel_for it runs on the calling thread.
at::Tensor gemm_nt(const at::Tensor& x, const at::Tensor& w) {
  static const auto handle =
      c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  if (handle) {
    static const auto op = handle->typed<at::Tensor(
        const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
        c10::string_view, c10::List<std::optional<at::Scalar>>,
        std::optional<c10::string_view>)>();
    return op.call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(),
                   std::nullopt);
  }
  return at::mm(x, w.t());
}

// Weights up to this size (every projection of a model with hidden size <= ~1k) are widened
// whole for inputs of at least kWholeWidenRows rows, where the GEMM's work dwarfs the widening;
// larger ones (an output head, a big model's MLP) go tile by tile so no large buffer is made.
constexpr int64_t kWholeWidenBytes = int64_t{16} << 20;
constexpr int64_t kWholeWidenRows = 32;

void check_tiled_weight(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && w.dim() == 2 && w.is_contiguous(),
              "linear_q_tiled: x [rows, k] and contiguous w expected");
  if (fmt == kDense) {
    TORCH_CHECK((w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) &&
                    w.size(1) == k, "linear_q_tiled: a dense weight must be fp16/bf16 [n, k]");
  } else {
    TORCH_CHECK(fmt >= kQ8_0 && fmt <= kQ4_1x16, "linear_q_tiled: unknown format ", fmt);
    TORCH_CHECK(w.scalar_type() == at::kByte && k % kBlock == 0, "linear_q_tiled: uint8 blocks");
    TORCH_CHECK(w.size(1) == k / kBlock * block_bytes(fmt), "linear_q_tiled: row size");
    TORCH_CHECK(!is_x16(fmt) || w.size(0) % kX16 == 0,
                "linear_q_tiled: an interleaved weight has a multiple of 16 rows");
  }
}

// x @ W.T with W's tiles made as T (fp32 or bf16) and the GEMM in T; x's dtype out.
template <typename T>
at::Tensor tiled_gemm(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t k) {
  const auto tdtype = std::is_same<T, float>::value ? at::kFloat : at::kBFloat16;
  const at::Tensor xt = x.to(tdtype).contiguous();
  const int64_t n = w.size(0);
  const int64_t esize = sizeof(T);
  if (n * k * esize <= kWholeWidenBytes && xt.size(0) >= kWholeWidenRows) {
    // The weight widened whole into a transient buffer and one library GEMM over all of it,
    // threaded by the library: a GEMM call per tile costs ~6% more (AVX2, 280 rows) and splits
    // less evenly over the threads. The buffer lives for this call only.
    at::Tensor buf = at::empty({n, k}, xt.options());
    T* bp = buf.data_ptr<T>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      dequant_tile(w, fmt, k, begin, end - begin, bp + begin * k);
    });
    const at::Tensor out = gemm_nt(xt, buf);
    return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
  }
  at::Tensor out = at::empty({xt.size(0), n}, xt.options());
  // A tile of ~256 KiB stays in L2 while the GEMM reads it once per row block of x.
  const int64_t max_tile = std::max<int64_t>(
      16, std::min<int64_t>(256, (int64_t{1} << 18) / esize / k / 16 * 16));
  // As many tiles for every thread (parallel_for hands each a contiguous run): 960 rows cut
  // into 112-row tiles leave one thread 5 tiles and the other 4.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_thread = (n + max_tile * threads - 1) / (max_tile * threads);
  const int64_t tile = std::min(max_tile, ((n + per_thread * threads - 1) /
                                           (per_thread * threads) + 15) / 16 * 16);
  const int64_t tiles = (n + tile - 1) / tile;
  const int64_t m = xt.size(0);
  T* op = out.data_ptr<T>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // NOTE: only tensors made on this thread are written through ATen here: the caller's
    // inference mode is thread-local, so `out` (an inference tensor) is filled by memcpy.
    at::Tensor buf = at::empty({tile, k}, xt.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, n - n0);
      dequant_tile(w, fmt, k, n0, rows, buf.data_ptr<T>());
      // Inside parallel_for the library GEMM runs on this thread only.
      const at::Tensor r = gemm_nt(xt, buf.narrow(0, 0, rows)).contiguous();
      const T* rp = r.data_ptr<T>();
      for (int64_t i = 0; i < m; ++i) std::memcpy(op + i * n + n0, rp + i * rows, rows * esize);
    }
  });
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

// fp32 tiles and GEMM, whatever x's dtype.
at::Tensor linear_q_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt, int64_t k) {
  check_tiled_weight(x, w, fmt, k);
  return tiled_gemm<float>(x, w, fmt, k);
}

// bf16 tiles and a bf16 GEMM (fp32 accumulation inside the library), for a bf16 x.
at::Tensor linear_q_tiled_bf16(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                               int64_t k) {
  check_tiled_weight(x, w, fmt, k);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_q_tiled_bf16: x must be bf16");
  return tiled_gemm<c10::BFloat16>(x, w, fmt, k);
}

// The whole weight as fp32 [n, k] (tests, and the embedding rows a step looks up).
at::Tensor dequantize(const at::Tensor& w, int64_t fmt, int64_t k) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "dequantize: contiguous 2-D weight");
  TORCH_CHECK(fmt >= kDense && fmt <= kQ4_1x16, "dequantize: unknown format ", fmt);
  TORCH_CHECK(fmt == kDense || w.size(1) == k / kBlock * block_bytes(fmt), "dequantize: row size");
  TORCH_CHECK(!is_x16(fmt) || w.size(0) % kX16 == 0,
              "dequantize: an interleaved weight has a multiple of 16 rows");
  at::Tensor out = at::empty({w.size(0), k}, w.options().dtype(at::kFloat));
  at::parallel_for(0, w.size(0), 64, [&](int64_t b, int64_t e) {
    dequant_tile(w, fmt, k, b, e - b, out.data_ptr<float>() + b * k);
  });
  return out;
}

}  // namespace

ES_LIBRARY_FRAGMENT(m) {
  m.def("linear_q_small(Tensor x, Tensor weight, int fmt, int k) -> Tensor");
  m.def("linear_q_tiled(Tensor x, Tensor weight, int fmt, int k) -> Tensor");
  m.def("linear_q_tiled_bf16(Tensor x, Tensor weight, int fmt, int k) -> Tensor");
  m.def("dequantize(Tensor weight, int fmt, int k) -> Tensor");
  m.def("linear_q_small_path(Tensor x, Tensor weight, int fmt, int k, int path) -> Tensor");
  m.def("int_dot_paths() -> int[]", &int_dot_paths);  // no tensor: a catch-all kernel
  m.def("round_int8_blocks(Tensor x) -> Tensor");
}

ES_LIBRARY_IMPL(m) {
  m.impl("linear_q_small", &linear_q_small);
  m.impl("linear_q_tiled", &linear_q_tiled);
  m.impl("linear_q_tiled_bf16", &linear_q_tiled_bf16);
  m.impl("dequantize", &dequantize);
  m.impl("linear_q_small_path", &linear_q_small_path);
  m.impl("round_int8_blocks", &round_int8_blocks);
}

// With external linkage for the decoder stack (see the note at the end of fused_ops.cpp): the
// block-weight GEMVs the layers call for a decode, with int8_decode_dot off and on.
namespace ES_NS {
at::Tensor direct_linear_q_small_fp32(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                                      int64_t k) {
  return linear_q_small_path(x, w, fmt, k, kFloatPath);
}
at::Tensor direct_linear_q_small_int8(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                                      int64_t k) {
  return linear_q_small(x, w, fmt, k);
}
at::Tensor direct_linear_small(const at::Tensor& x, const at::Tensor& w);  // fused_ops.cpp

// x @ w.T as a layer computes it for a decode: a dense weight (format 0) or blocks, these with
// int8 activations where int8_decode_dot is on (CpuKernels.linear_q_small).
at::Tensor direct_project(const at::Tensor& x, const at::Tensor& w, int64_t fmt, bool int8_dot) {
  if (fmt == 0) return direct_linear_small(x, w);
  return int8_dot ? linear_q_small(x, w, fmt, x.size(1))
                  : linear_q_small_path(x, w, fmt, x.size(1), kFloatPath);
}

// x @ w.T for block weights past the GEMV's rows, as CpuKernels.linear_q_tiled takes it with
// fp32 tiles (x rounded as the integer dots round it when int8_dot): the expert kernel's
// many-row experts in a prefill pass (csrc/moe_experts.cpp).
at::Tensor direct_project_tiled(const at::Tensor& x, const at::Tensor& w, int64_t fmt,
                                bool int8_dot) {
  if (!int8_dot) return linear_q_tiled(x, w, fmt, x.size(1));
  const at::Tensor out = linear_q_tiled(round_int8_blocks(x), w, fmt, x.size(1));
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}
}  // namespace ES_NS

namespace ES_NS {
// x [rows, k] fp32 rounded to int8 per 32 values exactly as the integer dots above take it
// (quantize_rows), for the expert kernel (csrc/moe_experts.cpp): q [rows, k], and per block its
// scale d [rows, k / 32] and q4_0's start lanes m8 [rows, k / 32, 8].
void direct_quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d,
                          int32_t* m8) {
  const QuantizedRows xq = quantize_rows(x, rows, k);
  std::copy(xq.q.begin(), xq.q.end(), q);
  std::copy(xq.d.begin(), xq.d.end(), d);
  std::copy(xq.m8.begin(), xq.m8.end(), m8);
}
}  // namespace ES_NS
