// fp16 <-> fp32 as torch converts them (.float() exactly; .half() rounding to nearest even), for the compiled
// kernels that read and write fp16 scales and norms (zoomkv/native/__init__.py builds them with this folder on
// the include path).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
// x86 with F16C (any -march=native since Ivy Bridge / Zen): one instruction, exact like the portable version
// below (every fp16 value is a float32 value); KIVI's per-channel scales are converted per number read.
inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#endif

inline uint16_t float_to_half(float f) {  // round to nearest even, as torch's .to(float16)
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (ax < 0x38800000u) {  // below the smallest normal half: a subnormal (or zero), in units of 2^-24
    if (ax < 0x33000000u) return sign;  // under half the smallest subnormal
    const uint32_t shift = 126 - (ax >> 23);  // 14..24
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return sign | uint16_t(q);
  }
  uint32_t h = ((ax >> 13) - ((127 - 15) << 10));
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | uint16_t(h);
}
