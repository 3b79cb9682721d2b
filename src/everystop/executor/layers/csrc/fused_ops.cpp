// Small fused CPU ops for the decoder's non-matmul work, built into the same extension as the
// paged-attention kernel. Each replaces a chain of 4-8 ATen ops (one dispatch and one pass over
// memory each) with one pass: at small batches the per-op overhead, not the arithmetic, is what
// costs. All arithmetic is fp32; 16-bit inputs are widened on load and rounded once on store.
//
//   rms_norm(x, w, eps)        w * to_dtype(x * rsqrt(mean(x^2) + eps))   (Llama's order)
//   add_rms_norm_(r, x, w, eps) r += x in place, then rms_norm(r, w, eps)
//   silu_mul(gate_up)          silu(gate_up[:, :I]) * gate_up[:, I:]
//   rope_(x, cos, sin)         in place, half-split ("rotate_half") layout, x: [T, heads, D]
//   rope_write_kv_(qkv, ...)   rope_ on a fused qkv row's q and k heads, then k and v stored
//                              into their KV cache slots
//   argmax_rows(x)             first index of each row's maximum (NaN counts as maximal)
//   linear_small(x, w)         x @ w.T for a few rows of x (decode): a weight-streaming GEMV,
//                              fp32 accumulation (bf16 dot products where the CPU has them);
//                              a row's sums come out the same for any row count
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }
template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

// out = rms_norm(x); with a residual (kAdd), first residual += x (rounded to the dtype, as
// torch's x + residual) and out = rms_norm(residual): the residual add before each norm of a
// pre-norm decoder, in one pass instead of two ops.
template <typename T, bool kAdd>
void rms_norm_impl(T* rp, int64_t rs, const at::Tensor& x, const at::Tensor& w, double eps,
                   at::Tensor& out) {
  const int64_t rows = x.size(0), dim = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * xs;
      T* orow = op + r * os;
      float ss = 0.f;
      if constexpr (kAdd) {
        T* rr = rp + r * rs;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; ++i) {
          const T sum = from_f<T>(to_f(rr[i]) + to_f(xr[i]));
          rr[i] = sum;
          ss += to_f(sum) * to_f(sum);
        }
        xr = rr;
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; ++i) {
          const float v = to_f(xr[i]);
          ss += v * v;
        }
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        // NOTE: round the normalized value to the activation dtype before the weight multiply,
        // as the reference implementation does.
        const float n = to_f(from_f<T>(to_f(xr[i]) * inv));
        orow[i] = from_f<T>(to_f(wp[i]) * n);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, dim], row-contiguous");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [dim] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat: rms_norm_impl<float, false>(nullptr, 0, x, w, eps, out); break;
    case at::kBFloat16: rms_norm_impl<c10::BFloat16, false>(nullptr, 0, x, w, eps, out); break;
    case at::kHalf: rms_norm_impl<c10::Half, false>(nullptr, 0, x, w, eps, out); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype");
  }
  return out;
}

at::Tensor add_rms_norm_(at::Tensor residual, const at::Tensor& x, const at::Tensor& w,
                         double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.dim() == 2 &&
                  residual.stride(1) == 1 && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm_: residual and x must be [rows, dim] of one dtype, row-contiguous");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == x.scalar_type(),
              "add_rms_norm_: weight must be contiguous [dim] of x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_impl<float, true>(residual.data_ptr<float>(), residual.stride(0), x, w, eps, out);
      break;
    case at::kBFloat16:
      rms_norm_impl<c10::BFloat16, true>(residual.data_ptr<c10::BFloat16>(), residual.stride(0),
                                         x, w, eps, out);
      break;
    case at::kHalf:
      rms_norm_impl<c10::Half, true>(residual.data_ptr<c10::Half>(), residual.stride(0), x, w,
                                     eps, out);
      break;
    default: TORCH_CHECK(false, "add_rms_norm_: unsupported dtype");
  }
  return out;
}

// silu(a) = a * sigmoid(a), with sigmoid from z = exp(-|a|) <= 1 so it never overflows.
inline vf silu_v(vf a) {
  const vf z = exp_v(a < 0 ? a : -a);
  return a * ((a >= 0 ? vf{} + 1.f : z) / (1.f + z));
}

template <typename T>
void silu_mul_impl(const at::Tensor& gu, at::Tensor& out) {
  const int64_t rows = gu.size(0), inter = out.size(1);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / inter), [&](int64_t begin, int64_t end) {
    float s[ES_W];
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * gs;
      const T* u = g + inter;
      T* o = op + r * inter;
      // NOTE: GCC does not vectorize std::exp here (glibc declares its vector variants only
      // under -ffast-math), so the exponential is taken a vector at a time with exp_v; fp32 and
      // bf16 rows convert as whole vectors too. Results are rounded like F.silu(gate) * up in
      // the activation dtype.
      int64_t i0 = 0;
      if constexpr (std::is_same<T, float>::value || std::is_same<T, c10::BFloat16>::value) {
        for (; i0 + kW <= inter; i0 += kW) {
          const vf sv = silu_v(loadv(g + i0)), uv = loadv(u + i0);
          if constexpr (std::is_same<T, float>::value) {
            const vf ov = sv * uv;
            std::memcpy(o + i0, &ov, sizeof(ov));
          } else {
            const vh oh = vf_to_bf16(round_to_bf16(sv) * uv);
            std::memcpy(o + i0, &oh, sizeof(oh));
          }
        }
      }
      for (; i0 < inter; i0 += kW) {
        const int64_t n = std::min<int64_t>(kW, inter - i0);
        const vf sv = silu_v(loadv_n(g + i0, n));
        std::memcpy(s, &sv, sizeof(sv));
        for (int64_t i = 0; i < n; ++i)
          o[i0 + i] = from_f<T>(to_f(from_f<T>(s[i])) * to_f(u[i0 + i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [rows, 2 * inter], row-contiguous");
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  switch (gate_up.scalar_type()) {
    case at::kFloat: silu_mul_impl<float>(gate_up, out); break;
    case at::kBFloat16: silu_mul_impl<c10::BFloat16>(gate_up, out); break;
    case at::kHalf: silu_mul_impl<c10::Half>(gate_up, out); break;
    default: TORCH_CHECK(false, "silu_mul: unsupported dtype");
  }
  return out;
}

// One head rotated in place by the half tables c, s: [a | b] -> [a c - b s | b c + a s].
template <typename T>
inline void rotate_half_head(T* a, const float* c, const float* s, int64_t half) {
  T* b = a + half;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_f(a[i]), x2 = to_f(b[i]);
    a[i] = from_f<T>(x1 * c[i] - x2 * s[i]);
    b[i] = from_f<T>(x2 * c[i] + x1 * s[i]);
  }
}

template <typename T>
void rope_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  T* xp = x.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0), hs = x.stride(1);
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_half_head(xp + t * ts + h * hs, c, s, half);
      }
    }
  });
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rope_: x must be [tokens, heads, head_dim] with contiguous head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == x.size(0) && cos.size(1) * 2 == x.size(2) &&
                  sin.sizes() == cos.sizes(),
              "rope_: cos/sin must be contiguous float32 [tokens, head_dim / 2]");
  switch (x.scalar_type()) {
    case at::kFloat: rope_impl<float>(x, cos, sin); break;
    case at::kBFloat16: rope_impl<c10::BFloat16>(x, cos, sin); break;
    case at::kHalf: rope_impl<c10::Half>(x, cos, sin); break;
    default: TORCH_CHECK(false, "rope_: unsupported dtype");
  }
}

// The attention block's glue in one pass per token: rotate the q and k heads of a fused qkv row
// in place (as rope_), then store the rotated k and the v heads into their cache slot
// (converted to the cache's dtype, as write_kv).
template <typename T, typename C>
void rope_write_kv_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& key_cache, at::Tensor& value_cache,
                        const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  const int64_t tokens = qkv.size(0), D = key_cache.size(3), half = D / 2;
  T* xp = qkv.data_ptr<T>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  C* kc = key_cache.data_ptr<C>();
  C* vc = value_cache.data_ptr<C>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t ts = qkv.stride(0), slot_stride = num_kv_heads * D;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      T* row = xp + t * ts;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        rotate_half_head(row + h * D, c, s, half);
      }
      const T* k = row + num_heads * D;
      const T* v = k + num_kv_heads * D;
      C* kd = kc + slot[t] * slot_stride;
      C* vd = vc + slot[t] * slot_stride;
#pragma omp simd
      for (int64_t i = 0; i < slot_stride; ++i) {
        kd[i] = from_f<C>(to_f(k[i]));
        vd[i] = from_f<C>(to_f(v[i]));
      }
    }
  });
}

template <typename T>
void rope_write_kv_for_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots,
                             int64_t nh, int64_t nkv) {
  switch (kc.scalar_type()) {
    case at::kFloat: rope_write_kv_impl<T, float>(qkv, cos, sin, kc, vc, slots, nh, nkv); break;
    case at::kBFloat16:
      rope_write_kv_impl<T, c10::BFloat16>(qkv, cos, sin, kc, vc, slots, nh, nkv);
      break;
    case at::kHalf: rope_write_kv_impl<T, c10::Half>(qkv, cos, sin, kc, vc, slots, nh, nkv); break;
    default: TORCH_CHECK(false, "rope_write_kv_: unsupported cache dtype");
  }
}

void rope_write_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots,
                    int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "rope_write_kv_: caches must be contiguous [blocks, block_size, kv_heads, dim]");
  const int64_t D = key_cache.size(3);
  TORCH_CHECK(key_cache.size(2) == num_kv_heads && D % 2 == 0, "rope_write_kv_: head shape");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 &&
                  qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rope_write_kv_: qkv must be [tokens, (heads + 2 kv_heads) * dim], row-contiguous");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.size(0) == qkv.size(0) && cos.size(1) * 2 == D && sin.sizes() == cos.sizes(),
              "rope_write_kv_: cos/sin must be contiguous float32 [tokens, dim / 2]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == qkv.size(0),
              "rope_write_kv_: one int64 slot per token");
  switch (qkv.scalar_type()) {
    case at::kFloat:
      rope_write_kv_for_cache<float>(qkv, cos, sin, key_cache, value_cache, slots, num_heads,
                                     num_kv_heads);
      break;
    case at::kBFloat16:
      rope_write_kv_for_cache<c10::BFloat16>(qkv, cos, sin, key_cache, value_cache, slots,
                                             num_heads, num_kv_heads);
      break;
    case at::kHalf:
      rope_write_kv_for_cache<c10::Half>(qkv, cos, sin, key_cache, value_cache, slots, num_heads,
                                         num_kv_heads);
      break;
    default: TORCH_CHECK(false, "rope_write_kv_: unsupported dtype");
  }
}

// Whether any lane of a comparison's mask is set.
inline bool any_lane(vi mask) {
  uint64_t words[sizeof(vi) / 8];
  std::memcpy(words, &mask, sizeof(vi));
  uint64_t any = 0;
  for (uint64_t w : words) any |= w;
  return any != 0;
}

// The first index of a row's maximum (of its first NaN where it has one), kW values at a time:
// a vocabulary row (49152 on the default model) took ~44 us in scalar passes, ~6x this.
int64_t argmax_row(const float* row, int64_t cols) {
  const int64_t nv = cols - cols % kW;
  // The maximum and whether a NaN is present; a maximum comes out the same in any order (of
  // equal values -0 and +0 either may stay: the index pass compares with ==, which takes both).
  vf best_v = vf{} - INFINITY;
  vi nan_v = vi{};
  for (int64_t i = 0; i < nv; i += kW) {
    const vf v = loadv(row + i);
    best_v = v > best_v ? v : best_v;
    nan_v |= v != v;
  }
  float best = -INFINITY;
  bool nan = any_lane(nan_v);
  for (int64_t l = 0; l < kW; ++l) best = best_v[l] > best ? best_v[l] : best;
  for (int64_t i = nv; i < cols; ++i) {
    best = row[i] > best ? row[i] : best;
    nan = nan || row[i] != row[i];
  }
  const vf best_all = vf{} + best;
  for (int64_t i = 0; i < nv; i += kW) {
    const vf v = loadv(row + i);
    const vi hit = nan ? v != v : v == best_all;
    if (!any_lane(hit)) continue;
    for (int64_t l = 0; l < kW; ++l)
      if (hit[l]) return i + l;
  }
  for (int64_t i = nv; i < cols; ++i)
    if (nan ? row[i] != row[i] : row[i] == best) return i;
  return 0;  // no columns
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat,
              "argmax_rows: x must be float32 [rows, cols], row-contiguous");
  const int64_t rows = x.size(0), cols = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, cols);
  });
  return out;
}

// --- linear_small --------------------------------------------------------------------------
// At decode batch sizes a linear layer reads every weight once for a handful of rows, so it is
// bound by how fast the weights stream in; the library GEMM paths leave much of that bandwidth
// unused for 16-bit weights. Here each weight row is loaded once and multiplied into all R
// activation rows (R a compile-time constant, so the accumulators stay in registers); several
// output columns are in flight at once so the FMA chains overlap and the prefetchers see
// several streams.
//
// bf16 weights with bf16 activations use AVX512-BF16's dot product (VDPBF16PS: 32 bf16 pairs
// per instruction, fp32 accumulation) in the build for CPUs that have it; other cases widen
// the weights to fp32 in registers, a vector (8 or 16 floats) at a time.
constexpr int64_t kMaxRows = 8;

// sum of x[i] * w[i] for i in [from, k), in fp32: the columns and the k remainder the vector
// loops leave over.
template <typename X, typename W>
inline float dot_tail(const X* x, const W* w, int64_t from, int64_t k) {
  float sum = 0.f;
  for (int64_t i = from; i < k; ++i) sum += to_f(x[i]) * to_f(w[i]);
  return sum;
}

// Calls f(std::integral_constant<int, rows>{}): the kernels take the row count as a template
// argument so their accumulators stay in registers.
template <int R = 1, typename F>
void with_row_count(int64_t rows, const F& f) {
  if constexpr (R <= kMaxRows) {
    if (rows == R)
      f(std::integral_constant<int, R>{});
    else
      with_row_count<R + 1>(rows, f);
  }
}

// One core alone cannot keep enough cache-line fills in flight to stream at the memory's
// rate; asking for later weight rows while this tile computes does (a prefetch past the end of
// the weight is harmless: it never faults). A tile's C rows are one contiguous run of memory,
// and each step of the k loop asks for the next C cache lines of the run kPrefetchTiles tiles
// ahead, in address order: the hardware prefetchers follow one ascending stream where they
// lost C short ones (one per row, a row's 18 lines at k = 576). On Zen 4 at one row that
// streamed the 49152 x 576 bf16 vocabulary projection at 33 GB/s instead of 24 (a plain read:
// 40), and one tile ahead at 32.
constexpr int64_t kPrefetchTiles = 2;

// Cache line `line` of the tile kPrefetchTiles ahead of the one at w0 (C rows of k).
template <typename T>
inline void prefetch_ahead(const T* w0, int64_t tile_elems, int64_t line) {
  __builtin_prefetch(reinterpret_cast<const char*>(w0 + kPrefetchTiles * tile_elems) +
                     line * 64);
}

// Output columns per inner iteration: as many as the vector registers allow next to R
// accumulators (R x C accumulators + C weight vectors + 1 activation vector): 32 registers
// with AVX-512, 16 with AVX2.
template <int R>
constexpr int kCols = ES_W == 16 ? (R <= 2 ? 8 : (R <= 5 ? 4 : 2))
                                 : (R <= 2 ? 4 : (R == 3 ? 3 : (R <= 6 ? 2 : 1)));

// Output columns n..n+C-1 for R rows of x, over k: a cache line of each weight row per step,
// one prefetch per line (a prefetch per vector spent load slots on lines already requested).
// kPairs (bf16 weights read as pairs, simd.h's load_bf16_split): xs is x in the split order
// for its vector part (the first k - k % 32 values); x itself serves the remainder.
template <typename W, int R, int C, bool kPairs = false>
inline void gemv_cols(const float* x, int64_t k, const W* w, int64_t n, float* out,
                      int64_t out_stride, const float* xs = nullptr) {
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(W));
  constexpr int kL = static_cast<int>(kLine >= kW ? kLine / kW : 1);
  constexpr int64_t kStep = kL * kW;
  static_assert(!kPairs || (std::is_same<W, c10::BFloat16>::value && kL % 2 == 0),
                "pairs: bf16 weights, whole pairs of vectors per cache line");
  const int64_t kv = k - k % kStep;
  vf acc[R][C];
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < C; ++j) acc[m][j] = vf{};
  const W* w0 = w + n * k;
  for (int64_t i = 0, line = 0; i < kv; i += kStep, line += C) {
    for (int j = 0; j < C; ++j) prefetch_ahead(w0, C * k, line + j);
    if constexpr (kPairs) {
      for (int u = 0; u < kL; u += 2) {
        vf xe[R], xo[R];
        for (int m = 0; m < R; ++m) {
          xe[m] = loadv(xs + m * k + i + u * kW);
          xo[m] = loadv(xs + m * k + i + (u + 1) * kW);
        }
        for (int j = 0; j < C; ++j) {
          vf we, wo;
          load_bf16_split(w0 + j * k + i + u * kW, we, wo);
          for (int m = 0; m < R; ++m) acc[m][j] += xe[m] * we + xo[m] * wo;
        }
      }
    } else {
      for (int u = 0; u < kL; ++u) {
        vf a[C];
        for (int j = 0; j < C; ++j) a[j] = loadv(w0 + j * k + i + u * kW);
        for (int m = 0; m < R; ++m) {
          const vf xv = loadv(x + m * k + i + u * kW);
          for (int j = 0; j < C; ++j) acc[m][j] += xv * a[j];
        }
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int j = 0; j < C; ++j)
      out[m * out_stride + n + j] = hsum(acc[m][j]) + dot_tail(x + m * k, w0 + j * k, kv, k);
}

template <typename W, int R>
void gemv_block(const float* x, int64_t k, const W* w, int64_t n_begin, int64_t n_end,
                float* out, int64_t out_stride) {
  // fp32 x against bf16 weights reads them as pairs: x goes into the split order once per
  // thread's range of columns (R x k floats against 64 or more weight rows of k), and the
  // weights then widen with a shift and a mask, no shuffles. Over the SmolLM2 layers' bf16
  // weights that streamed 6% faster on AVX2 (3% AVX-512) at one row, no faster at 2, 4 or 8
  // (paired builds, one run); it runs at every row count so that a row sums in the same order
  // alone as beside others.
  constexpr bool kPairs = kSplitBf16 && std::is_same<W, c10::BFloat16>::value;
  const float* xs = nullptr;
  if constexpr (kPairs) {
    thread_local std::vector<float> split;
    split.resize(static_cast<size_t>(R * k));
    for (int m = 0; m < R; ++m)
      for (int64_t i = 0; i + 2 * kW <= k; i += 2 * kW) {
        vf even, odd;
        split_even_odd(x + m * k + i, even, odd);
        std::memcpy(split.data() + m * k + i, &even, sizeof(vf));
        std::memcpy(split.data() + m * k + i + kW, &odd, sizeof(vf));
      }
    xs = split.data();
  }
  // Where R rows leave registers for one column only (AVX2, 7-8 rows), the rows go in two
  // passes over each group of columns instead: the second pass reads those weight rows from L1.
  constexpr bool kSplit = kCols<R> == 1 && R > 1;
  constexpr int R1 = kSplit ? (R + 1) / 2 : R;
  constexpr int R2 = R - R1;
  constexpr int C = kCols<R1>;
  const float* xs2 = kPairs ? xs + R1 * k : nullptr;  // the second pass's rows, split
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    gemv_cols<W, R1, C, kPairs>(x, k, w, n, out, out_stride, xs);
    if constexpr (R2 > 0) gemv_cols<W, R2, C, kPairs>(x + R1 * k, k, w, n, out + R1 * out_stride,
                                                       out_stride, xs2);
  }
  // NOTE: the columns left over take the same vector path one at a time, so every output sums
  // in one order whatever C (which depends on R) is: batch-invariant results rely on it.
  for (; n < n_end; ++n) {
    gemv_cols<W, R1, 1, kPairs>(x, k, w, n, out, out_stride, xs);
    if constexpr (R2 > 0) gemv_cols<W, R2, 1, kPairs>(x + R1 * k, k, w, n, out + R1 * out_stride,
                                                       out_stride, xs2);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// x and w both bf16: 32 products per instruction. The k remainder (k % 32) runs in fp32 on
// the widened values, which are exact.
template <int R, int C = kCols<R>>
void gemv_block_bf16dp(const c10::BFloat16* x, int64_t k, const c10::BFloat16* w,
                       int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  const int64_t k32 = k - k % 32;
  int64_t n = n_begin;
  for (; n + C <= n_end; n += C) {
    __m512 acc[R][C];
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j) acc[m][j] = _mm512_setzero_ps();
    const c10::BFloat16* w0 = w + n * k;
    for (int64_t i = 0, line = 0; i < k32; i += 32, line += C) {
      __m512bh a[C];
      for (int j = 0; j < C; ++j) {
        prefetch_ahead(w0, C * k, line + j);
        a[j] = (__m512bh)_mm512_loadu_si512(w0 + j * k + i);
      }
      for (int m = 0; m < R; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + i);
        for (int j = 0; j < C; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a[j], xv);
      }
    }
    for (int m = 0; m < R; ++m)
      for (int j = 0; j < C; ++j)
        out[m * out_stride + n + j] =
            _mm512_reduce_add_ps(acc[m][j]) + dot_tail(x + m * k, w0 + j * k, k32, k);
  }
  // The columns left over one at a time on the same path (see gemv_block).
  if constexpr (C > 1) {
    if (n < n_end) gemv_block_bf16dp<R, 1>(x, k, w, n, n_end, out, out_stride);
  }
}
#endif

// Each thread takes one contiguous run of columns, as even as runs of 32 columns allow (in
// 64-column chunks 576 columns went 5 chunks to 4, and the projection waited on the larger
// share); a layer small enough to stream in a few microseconds stays on one thread, where
// waking the other would cost more than it saves. Every column sums in one order whichever
// thread computes it.
template <typename F>
void for_column_chunks(int64_t n, int64_t k, const F& body) {
  constexpr int64_t kAlign = 32;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + kAlign - 1) / kAlign);
  if (n * k < (int64_t{1} << 16) || threads <= 1) {
    body(0, n);
    return;
  }
  const int64_t share = ((n + threads - 1) / threads + kAlign - 1) / kAlign * kAlign;
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t * share, e = std::min(n, b + share);
      if (b < e) body(b, e);
    }
  });
}

// More than kMaxRows rows (a decode batch of 9 or more sequences, where the alternative widens
// the whole 16-bit weight to fp32 for a GEMM on every call; any pass in batch-invariant mode):
// the rows go kMaxRows at a time over a group of columns whose weights (~256 KiB) stay in L2,
// so the weights still stream from memory once.
constexpr int64_t kGroupBytes = int64_t{256} << 10;

// gemv(x rows [r0, r0 + R), columns [b, e)) for every row chunk, column group by group.
template <typename Gemv>
void rows_over_columns(int64_t rows, int64_t n, int64_t k, int64_t row_bytes, const Gemv& gemv) {
  for_column_chunks(n, k, [&](int64_t b, int64_t e) {
    if (rows <= kMaxRows) {
      with_row_count(rows, [&](auto r) { gemv(r, 0, b, e); });
      return;
    }
    const int64_t group = std::max<int64_t>(8, kGroupBytes / row_bytes / 8 * 8);
    for (int64_t c0 = b; c0 < e; c0 += group) {
      const int64_t c1 = std::min(e, c0 + group);
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
        with_row_count(std::min(kMaxRows, rows - r0), [&](auto r) { gemv(r, r0, c0, c1); });
    }
  });
}

template <typename W>
void linear_small_impl(const at::Tensor& x32, const at::Tensor& w, at::Tensor& out32) {
  const int64_t k = x32.size(1), n = w.size(0);
  const float* xp = x32.data_ptr<float>();
  const W* wp = w.data_ptr<W>();
  float* op = out32.data_ptr<float>();
  rows_over_columns(x32.size(0), n, k, k * int64_t{sizeof(W)},
                    [&](auto r, int64_t r0, int64_t b, int64_t e) {
    gemv_block<W, decltype(r)::value>(xp + r0 * k, k, wp, b, e, op + r0 * n, n);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
void linear_small_bf16dp(const at::Tensor& x, const at::Tensor& w, at::Tensor& out32) {
  const int64_t k = x.size(1), n = w.size(0);
  const auto* xp = x.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<c10::BFloat16>();
  float* op = out32.data_ptr<float>();
  rows_over_columns(x.size(0), n, k, k * 2, [&](auto r, int64_t r0, int64_t b, int64_t e) {
    gemv_block_bf16dp<decltype(r)::value>(xp + r0 * k, k, wp, b, e, op + r0 * n, n);
  });
}
#endif

at::Tensor linear_small(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "linear_small: x [rows, k] and w [n, k] expected");
  TORCH_CHECK(x.size(0) >= 1, "linear_small: at least one row");
  TORCH_CHECK(w.is_contiguous(), "linear_small: weight must be contiguous");
  at::Tensor out32 = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    linear_small_bf16dp(x.contiguous(), w, out32);
    return out32.to(at::kBFloat16);
  }
#endif
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  switch (w.scalar_type()) {
    case at::kFloat: linear_small_impl<float>(x32, w, out32); break;
    case at::kBFloat16: linear_small_impl<c10::BFloat16>(x32, w, out32); break;
    case at::kHalf: linear_small_impl<c10::Half>(x32, w, out32); break;
    default: TORCH_CHECK(false, "linear_small: unsupported weight dtype");
  }
  return x.scalar_type() == at::kFloat ? out32 : out32.to(x.scalar_type());
}

}  // namespace

ES_LIBRARY_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("rope_write_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) key_cache, "
        "Tensor(c!) value_cache, Tensor slots, int num_heads, int num_kv_heads) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("linear_small(Tensor x, Tensor weight) -> Tensor");
}

ES_LIBRARY_IMPL(m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_", &rope_);
  m.impl("rope_write_kv_", &rope_write_kv_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("linear_small", &linear_small);
}

// The same entry points with external linkage, for the decoder stack (decoder_stack.cpp) to
// call without the dispatcher. The namespace is the build's op namespace, so the libraries of
// different ISAs loaded into one process never resolve to each other's symbols.
namespace ES_NS {
at::Tensor direct_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return rms_norm(x, w, eps);
}
at::Tensor direct_add_rms_norm_(at::Tensor residual, const at::Tensor& x, const at::Tensor& w,
                                double eps) {
  return add_rms_norm_(std::move(residual), x, w, eps);
}
at::Tensor direct_silu_mul(const at::Tensor& gate_up) { return silu_mul(gate_up); }
void direct_rope_write_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& slots,
                           int64_t num_heads, int64_t num_kv_heads) {
  rope_write_kv_(std::move(qkv), cos, sin, std::move(key_cache), std::move(value_cache), slots,
                 num_heads, num_kv_heads);
}
at::Tensor direct_linear_small(const at::Tensor& x, const at::Tensor& w) {
  return linear_small(x, w);
}
}  // namespace ES_NS
