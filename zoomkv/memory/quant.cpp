// Rows quantized as zoomkv/memory/quant.py codes them, bit for bit, written straight into the row buffers'
// storage: per token (quantize(): the prefill's host rows and every appended row) and per channel over blocks
// of tokens (quantize_channels(): KIVI's keys). Each group gets its minimum rounded to fp16, a scale
// (max - min) / (2^bits - 1) clamped to 1e-8 and rounded to fp16, and codes round((x - min) / scale) (half to
// even) clamped to [0, 2^bits - 1], packed 8 / bits a byte from the low bits up.
//
// Built without -ffast-math (zoomkv/native/__init__.py, Kernel(fast_math=False)): a code must equal torch's.
// (One freedom: where a group's least value is a zero of either sign, which zero its minimum holds follows the
// order of the comparisons, as torch's own does; 0 * scale + -0 = +0, so the decoded rows are the same bits.)
// Heads are coded in parallel on torch's OpenMP threads when there is enough of them to pay for the fork (a
// prefill's rows); a decode step's one row a layer stays on the calling thread.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "half.h"

namespace {

constexpr int64_t kParallelValues = 1 << 16;

// The fp16 minimum and scale of a group from its float min and max; false where torch's result is not a plain
// number (the scale rounds to 0 in fp16, or overflows).
inline bool group_scale(float mn, float mx, float levels, uint16_t* lo_h, float* lo_f, uint16_t* s_h, float* s_f) {
  *lo_h = float_to_half(mn);
  *lo_f = half_to_float(*lo_h);
  *s_h = float_to_half(std::max((mx - *lo_f) / levels, 1e-8f));
  *s_f = half_to_float(*s_h);
  return *s_f > 0.0f && std::isfinite(*s_f) && std::isfinite(*lo_f);
}

inline uint8_t code(float v, float lo, float s, float levels) {
  const float q = std::nearbyint((v - lo) / s);
  return uint8_t(std::min(std::max(q, 0.0f), levels));
}

inline bool finite(float v) { return std::fabs(v) <= std::numeric_limits<float>::max(); }  // false for NaN too

// codes [n] (each < 2^bits) packed 8 / bits a byte from the low bits up into out [n * bits / 8]
inline void pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  if (bits == 8) {
    std::copy(codes, codes + n, out);
  } else if (bits == 4) {
#pragma omp simd
    for (int64_t j = 0; j < n / 2; ++j) out[j] = uint8_t(codes[2 * j] | (codes[2 * j + 1] << 4));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n / 4; ++j)
      out[j] = uint8_t(codes[4 * j] | (codes[4 * j + 1] << 2) | (codes[4 * j + 2] << 4) | (codes[4 * j + 3] << 6));
  }
}

// One head's rows, per token: 0, or 1 where a value or a scale is not finite. The loops are written for the
// vectorizer (`omp simd`: min and max are exact in any order; the non-finite check is a flag, not a branch).
int token_head(int64_t rows, int64_t d, int64_t group, int bits, const float* x, uint8_t* codes,
               uint16_t* scale, uint16_t* lo) {
  const int64_t nbytes = d * bits / 8, groups = d / group;
  const float levels = float((1 << bits) - 1);
  std::vector<uint8_t> q(d);
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * d;
    for (int64_t gi = 0; gi < groups; ++gi) {
      const float* v = row + gi * group;
      float mn = v[0], mx = v[0];
      int bad = 0;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(| : bad)
      for (int64_t c = 0; c < group; ++c) {
        mn = std::min(mn, v[c]);
        mx = std::max(mx, v[c]);
        bad |= !finite(v[c]);
      }
      uint16_t lo_h, s_h;
      float lo_f, s_f;
      if (bad || !group_scale(mn, mx, levels, &lo_h, &lo_f, &s_h, &s_f)) return 1;
      scale[r * groups + gi] = s_h;
      lo[r * groups + gi] = lo_h;
      uint8_t* qg = q.data() + gi * group;
#pragma omp simd
      for (int64_t c = 0; c < group; ++c) qg[c] = code(v[c], lo_f, s_f, levels);
    }
    pack(q.data(), d, bits, codes + r * nbytes);
  }
  return 0;
}

// One head's blocks of `block` rows, each channel over its block: 0, or 1 as above.
int channel_head(int64_t blocks, int64_t block, int64_t d, int bits, const float* x, uint8_t* codes,
                 uint16_t* scale, uint16_t* lo) {
  const int64_t nbytes = d * bits / 8;
  const float levels = float((1 << bits) - 1);
  std::vector<float> mn(d), mx(d), lo_f(d), s_f(d);
  std::vector<uint8_t> q(d);
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const float* rows = x + bi * block * d;
    std::copy(rows, rows + d, mn.begin());
    std::copy(rows, rows + d, mx.begin());
    int bad = 0;
    for (int64_t r = 0; r < block; ++r) {
      const float* v = rows + r * d;
#pragma omp simd reduction(| : bad)
      for (int64_t c = 0; c < d; ++c) {
        mn[c] = std::min(v[c], mn[c]);
        mx[c] = std::max(v[c], mx[c]);
        bad |= !finite(v[c]);
      }
    }
    if (bad) return 1;
    for (int64_t c = 0; c < d; ++c) {
      uint16_t lo_h, s_h;
      if (!group_scale(mn[c], mx[c], levels, &lo_h, &lo_f[c], &s_h, &s_f[c])) return 1;
      scale[bi * d + c] = s_h;
      lo[bi * d + c] = lo_h;
    }
    for (int64_t r = 0; r < block; ++r) {
      const float* v = rows + r * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) q[c] = code(v[c], lo_f[c], s_f[c], levels);
      pack(q.data(), d, bits, codes + (bi * block + r) * nbytes);
    }
  }
  return 0;
}

// head(h) for every head, in parallel on torch's OpenMP threads when `values` (the floats coded) pay for the
// fork; the largest status any head returned (0: all coded). A head after a failed one is skipped.
template <class Head>
int over_heads(int64_t heads, int64_t values, Head head) {
  int status = 0;
#pragma omp parallel for reduction(max : status) if (values >= kParallelValues)
  for (int64_t h = 0; h < heads; ++h) {
    if (status > 0) continue;  // a private copy starts at max's identity, INT_MIN, not 0
    status = std::max(status, head(h));
  }
  return status;
}

}  // namespace

extern "C" {

// x [heads, rows, d] float32 (heads = batch * KV heads); codes [heads, codes_cap, d * bits / 8] and scale / lo
// [heads, scale_cap | lo_cap, d / group] fp16 are written at rows start..start + rows. Returns 1 (nothing to
// trust in what it wrote) where torch's result is not a plain number: a non-finite value or a scale that
// rounds to 0 in fp16. The caller then codes the rows with torch. 2: arguments it does not take.
int zk_quant_rows(int64_t heads, int64_t rows, int64_t d, int64_t group, int bits, const float* x,
                  uint8_t* codes, int64_t codes_cap, uint16_t* scale, int64_t scale_cap, uint16_t* lo,
                  int64_t lo_cap, int64_t start) {
  if (group < 1 || d % group || (bits != 2 && bits != 4 && bits != 8)) return 2;
  const int per = 8 / bits;
  if (group % per) return 2;
  const int64_t nbytes = d / per, groups = d / group;
  return over_heads(heads, heads * rows * d, [&](int64_t h) {
    return token_head(rows, d, group, bits, x + h * rows * d, codes + (h * codes_cap + start) * nbytes,
                      scale + (h * scale_cap + start) * groups, lo + (h * lo_cap + start) * groups);
  });
}

// x [heads, blocks * block, d] float32; codes [heads, codes_cap, d * bits / 8] written at rows
// start_row.., scale / lo [heads, scale_cap | lo_cap, d] fp16 (one row a block) at block start_block... Returns
// as zk_quant_rows.
int zk_quant_channels(int64_t heads, int64_t blocks, int64_t block, int64_t d, int bits, const float* x,
                      uint8_t* codes, int64_t codes_cap, int64_t start_row, uint16_t* scale, int64_t scale_cap,
                      uint16_t* lo, int64_t lo_cap, int64_t start_block) {
  if (block < 1 || d < 1 || (bits != 2 && bits != 4 && bits != 8)) return 2;
  const int per = 8 / bits;
  if (d % per) return 2;
  const int64_t nbytes = d / per, n = blocks * block;
  return over_heads(heads, heads * n * d, [&](int64_t h) {
    return channel_head(blocks, block, d, bits, x + h * n * d, codes + (h * codes_cap + start_row) * nbytes,
                        scale + (h * scale_cap + start_block) * d, lo + (h * lo_cap + start_block) * d);
  });
}

}  // extern "C"
