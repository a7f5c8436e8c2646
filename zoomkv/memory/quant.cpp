// New rows quantized per token, as zoomkv/memory/quant.py's quantize() codes them, bit for bit: each group of
// `group` channels gets its minimum rounded to fp16, a scale (max - min) / (2^bits - 1) clamped to 1e-8 and
// rounded to fp16, and codes round((x - min) / scale) (half to even) clamped to [0, 2^bits - 1], packed
// 8 / bits a byte from the low bits up. Written straight into the row buffers' storage at row `start`.
//
// Built without -ffast-math (zoomkv/native/__init__.py, Kernel(fast_math=False)): a code must equal torch's.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "half.h"

extern "C" {

// x [heads, rows, d] float32 (heads = batch * KV heads); codes [heads, codes_cap, d * bits / 8] and scale / lo
// [heads, scale_cap | lo_cap, d / group] fp16 are written at rows start..start + rows. Returns 1 (nothing to
// trust in what it wrote) where torch's result is not a plain number: a non-finite value or a scale that
// rounds to 0 in fp16. The caller then codes the rows with torch.
int zk_quant_rows(int64_t heads, int64_t rows, int64_t d, int64_t group, int bits, const float* x,
                  uint8_t* codes, int64_t codes_cap, uint16_t* scale, int64_t scale_cap, uint16_t* lo,
                  int64_t lo_cap, int64_t start) {
  if (group < 1 || d % group || (bits != 2 && bits != 4 && bits != 8)) return 2;
  const int per = 8 / bits;
  if (group % per) return 2;
  const int64_t nbytes = d / per, groups = d / group;
  const float levels = float((1 << bits) - 1);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = x + (h * rows + r) * d;
      uint8_t* out = codes + (h * codes_cap + start + r) * nbytes;
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float* v = row + gi * group;
        float mn = v[0], mx = v[0];
        for (int64_t c = 0; c < group; ++c) {
          if (!std::isfinite(v[c])) return 1;
          mn = std::min(mn, v[c]);
          mx = std::max(mx, v[c]);
        }
        const uint16_t lo_h = float_to_half(mn);
        const float lo_f = half_to_float(lo_h);
        const uint16_t s_h = float_to_half(std::max((mx - lo_f) / levels, 1e-8f));
        const float s_f = half_to_float(s_h);
        if (!(s_f > 0.0f) || !std::isfinite(s_f)) return 1;
        scale[(h * scale_cap + start + r) * groups + gi] = s_h;
        lo[(h * lo_cap + start + r) * groups + gi] = lo_h;
        for (int64_t c = 0; c < group; c += per) {
          unsigned byte = 0;
          for (int i = 0; i < per; ++i) {
            const float q = std::nearbyint((v[c + i] - lo_f) / s_f);
            byte |= unsigned(std::min(std::max(q, 0.0f), levels)) << (bits * i);
          }
          out[(gi * group + c) / per] = uint8_t(byte);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
