// 16-float vectors (one AVX-512 register, two AVX2 ones; GCC lowers them to whatever -march
// offers) and the vector math the CPU kernels share.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

// 16 bf16 values (raw bits) to fp32: bf16 is the top half of an fp32. The scalar c10
// conversions do not vectorize well.
inline v16 bf16x16_to_v16(const void* src) {
  v16h h;
  std::memcpy(&h, src, sizeof(h));
  const v16u bits = __builtin_convertvector(h, v16u) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rounds each fp32 to its nearest bf16 (ties to even) and returns the bf16 bits; NaN stays NaN.
inline v16h v16_to_bf16x16(v16 x) {
  v16u bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const v16u rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const v16u nan = (bits >> 16) | 0x40u;  // keep the sign and payload, force a quiet NaN
  return __builtin_convertvector(x != x ? nan : rounded, v16h);
}

inline v16 round_to_bf16(v16 x) {
  const v16u bits = __builtin_convertvector(v16_to_bf16x16(x), v16u) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0, 16 at a time: 2^n * p(r) with
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

// Loads n <= 16 values as fp32, zero-filling the rest (a row need not be a multiple of 16).
// Whole vectors of fp32 and bf16 convert without a scalar loop.
template <typename T>
inline v16 load16(const T* src, int64_t n) {
  v16 out;
  float tmp[16];
  if (n == 16) {
    if constexpr (std::is_same<T, float>::value) {
      std::memcpy(&out, src, sizeof(out));
      return out;
    } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
      return bf16x16_to_v16(src);
    } else {
#pragma omp simd
      for (int64_t i = 0; i < 16; ++i) tmp[i] = static_cast<float>(src[i]);
    }
  } else {
    for (int64_t i = 0; i < 16; ++i) tmp[i] = i < n ? static_cast<float>(src[i]) : 0.f;
  }
  std::memcpy(&out, tmp, sizeof(out));
  return out;
}
