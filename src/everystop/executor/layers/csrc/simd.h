// Vectors of ES_W floats (one register of the ISA the library is built for: 8 on AVX2,
// 16 on AVX-512) and the vector math the CPU kernels share. The same sources are compiled once
// per ISA (layers/cpu_kernels.py), each build with its own ES_W and its own op namespace
// (ES_NS), so an AVX2 build never works on 16-float vectors split over two registers.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#ifndef ES_W
#define ES_W 8
#endif
#ifndef ES_NS
#define ES_NS everystop_generic
#endif

static_assert(ES_W == 8 || ES_W == 16, "ES_W must be 8 or 16");
constexpr int64_t kW = ES_W;

typedef float vf __attribute__((vector_size(ES_W * 4)));
typedef int32_t vi __attribute__((vector_size(ES_W * 4)));
typedef uint32_t vu __attribute__((vector_size(ES_W * 4)));
typedef uint16_t vh __attribute__((vector_size(ES_W * 2)));

inline vf bits_to_vf(vu bits) {
  vf out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// bf16 is the top half of an fp32: widening is a shift. Written with intrinsics because GCC
// lowers the generic u16 -> u32 vector conversion to two half-width zero-extends, a byte
// shift and an insert (6 instructions instead of 2) in the attention and GEMV inner loops.
inline vf bf16_to_vf(const void* src) {
#if ES_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
#elif ES_W == 8 && defined(__AVX2__)
  return (vf)_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16);
#else
  vh h;
  std::memcpy(&h, src, sizeof(h));
  return bits_to_vf(__builtin_convertvector(h, vu) << 16);
#endif
}

// Rounds each fp32 to its nearest bf16 (ties to even) and returns the bf16 bits; NaN stays NaN.
inline vh vf_to_bf16(vf x) {
  vu bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu nan = (bits >> 16) | 0x40u;  // keep the sign and payload, force a quiet NaN
  return __builtin_convertvector(x != x ? nan : rounded, vh);
}

inline vf round_to_bf16(vf x) { return bits_to_vf(__builtin_convertvector(vf_to_bf16(x), vu) << 16); }

inline vf half_to_vf(const c10::Half* src) {
#if ES_W == 16 && defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
#elif ES_W == 8 && defined(__F16C__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
  float tmp[ES_W];
  for (int64_t i = 0; i < kW; ++i) tmp[i] = static_cast<float>(src[i]);
  vf out;
  std::memcpy(&out, tmp, sizeof(out));
  return out;
#endif
}

// bf16 read as pairs: 2*kW values load as kW 32-bit words; the even-indexed values are the
// words' low halves (a shift makes them fp32) and the odd-indexed ones their high halves (a
// mask). That widens with two cheap bitwise ops instead of a zero-extending shuffle per kW
// values, which shares its port with the FMAs. The other operand must be in the same split
// order (split_even_odd: per 2*kW values, the even ones, then the odd ones). Only on x86
// builds with AVX2 or better: the generic build's vectors are emulated, and there the split
// order measured slower than widening.
#if defined(__AVX2__)
constexpr bool kSplitBf16 = true;
#else
constexpr bool kSplitBf16 = false;
#endif

inline void load_bf16_split(const c10::BFloat16* src, vf& even, vf& odd) {
  vu words;
  std::memcpy(&words, src, sizeof(words));
  even = bits_to_vf(words << 16);
  odd = bits_to_vf(words & 0xffff0000u);
}

// 2*kW floats <-> the split order above.
inline void split_even_odd(const float* src, vf& even, vf& odd) {
  for (int64_t i = 0; i < kW; ++i) {
    even[i] = src[2 * i];
    odd[i] = src[2 * i + 1];
  }
}
inline void merge_even_odd(vf even, vf odd, float* dst) {
  for (int64_t i = 0; i < kW; ++i) {
    dst[2 * i] = even[i];
    dst[2 * i + 1] = odd[i];
  }
}

// A whole vector of T as fp32.
template <typename T>
inline vf loadv(const T* src) {
  if constexpr (std::is_same<T, float>::value) {
    vf out;
    std::memcpy(&out, src, sizeof(out));
    return out;
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return bf16_to_vf(src);
  } else {
    static_assert(std::is_same<T, c10::Half>::value, "fp32, bf16 or fp16");
    return half_to_vf(src);
  }
}

// n <= kW values as fp32, the rest zero (a row need not be a multiple of the width).
template <typename T>
inline vf loadv_n(const T* src, int64_t n) {
  if (n == kW) return loadv(src);
  float tmp[ES_W];
  for (int64_t i = 0; i < kW; ++i) tmp[i] = i < n ? static_cast<float>(src[i]) : 0.f;
  vf out;
  std::memcpy(&out, tmp, sizeof(out));
  return out;
}

inline float hsum(vf v) {
  float s = 0.f;
#if ES_W == 16
  typedef float v8 __attribute__((vector_size(32)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vf a = v;
#endif
  typedef float v4 __attribute__((vector_size(16)));
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  s = (b[0] + b[2]) + (b[1] + b[3]);
  return s;
}

inline float hmax(vf v) {
  typedef float v4 __attribute__((vector_size(16)));
#if ES_W == 16
  typedef float v8 __attribute__((vector_size(32)));
  const v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8 a = lo > hi ? lo : hi;
#else
  const vf a = v;
#endif
  const v4 l4 = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const v4 h4 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const v4 b = l4 > h4 ? l4 : h4;
  const float m0 = b[0] > b[1] ? b[0] : b[1];
  const float m1 = b[2] > b[3] ? b[2] : b[3];
  return m0 > m1 ? m0 : m1;
}

// kW vectors in, one out: lane i holds the sum of a[i]'s lanes. A shuffle tree that halves the
// vector count each level instead of kW separate horizontal sums.
inline vf reduce_lanes(const vf* a) {
#if ES_W == 16
  vf b[8], c[4], d[2];
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
#else
  // b[k]: a[2k]'s four partial sums, then a[2k+1]'s; c[k]: two partials each of a[4k..4k+3].
  vf b[4], c[2];
  for (int k = 0; k < 4; ++k)
    b[k] = __builtin_shufflevector(a[2 * k], a[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * k], a[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int k = 0; k < 2; ++k)
    c[k] = __builtin_shufflevector(b[2 * k], b[2 * k + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(b[2 * k], b[2 * k + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// exp(x) for x <= 0, a vector at a time: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and a
// degree-6 Taylor polynomial (rel. error ~1e-7). Inputs below -87 (including -inf) give 0.
inline vf exp_v(vf x) {
  const vf lo = vf{} - 87.f;
  const vi underflow = x < lo;
  x = x < lo ? lo : x;
  const vf fn = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x < 0 ? -0.5f : 0.5f), vi), vf);
  const vf r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  vf p = vf{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vi scale_bits = (__builtin_convertvector(fn, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &scale_bits, sizeof(two_n));
  const vf res = p * two_n;
  vi res_bits;
  std::memcpy(&res_bits, &res, sizeof(res));
  res_bits &= ~underflow;
  vf out;
  std::memcpy(&out, &res_bits, sizeof(out));
  return out;
}

// The library's op namespace is a build flag: TORCH_LIBRARY stringifies its argument, so the
// macro is expanded one level up.
#define ES_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define ES_LIBRARY(m) ES_LIBRARY_(ES_NS, m)
#define ES_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define ES_LIBRARY_FRAGMENT(m) ES_LIBRARY_FRAGMENT_(ES_NS, m)
#define ES_LIBRARY_IMPL_(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)
#define ES_LIBRARY_IMPL(m) ES_LIBRARY_IMPL_(ES_NS, CPU, m)
