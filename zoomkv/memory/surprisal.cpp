// Token surprisal from bf16 logits in one pass a row: -log softmax(logits)[target] = max + log Σ exp(x - max)
// - x[target], summed in float32. torch's path (float(), log_softmax, gather) writes two float32 copies of every
// chunk of logits (25 MB each for 128 positions of a 49K vocabulary) and reads them back; this reads the bf16
// logits twice (the max, then the sum) and writes one float a row.
//
// Built with -ffast-math (zoomkv/native/__init__.py) so the loops vectorise; exp is a polynomial of our own
// (below) because the vector math library's exp is only declared under full -ffast-math, which this build keeps
// off for infinities. Relative error of a term ~1e-7, far under the bf16 logits' own rounding.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (the Taylor series' terms,
// enough at |r| <= 0.35 for float32), 2^n built in the exponent bits. Below -87 (2^-126) the result is 0.
inline float exp_nonpositive(float x) {
  const bool tiny = x < -87.0f;
  x = tiny ? -87.0f : x;
  const float n = std::nearbyint(x * 1.4426950408889634f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln2 split in two for an exact product
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return tiny ? 0.0f : p * scale;
}

}  // namespace

extern "C" {

// logits [rows, vocab] bf16 (row-major, rows = batch * positions), targets [rows] int64 in [0, vocab) →
// out [rows] float32 nats. Returns 1 (out not written) when a target is outside the vocabulary.
int zk_surprisal_bf16(int64_t rows, int64_t vocab, const uint16_t* logits, const int64_t* targets, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    if (targets[r] < 0 || targets[r] >= vocab) return 1;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = logits + r * vocab;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t v = 0; v < vocab; ++v) {
      const float x = bf16_to_float(row[v]);
      mx = x > mx ? x : mx;  // a NaN is skipped here and reaches the sum, which it turns to NaN
    }
    float sum = 0.0f;
    if (std::isfinite(mx)) {
#pragma omp simd reduction(+ : sum)
      for (int64_t v = 0; v < vocab; ++v) sum += exp_nonpositive(bf16_to_float(row[v]) - mx);
      out[r] = mx + std::log(sum) - bf16_to_float(row[targets[r]]);
    } else {
      out[r] = NAN;  // an infinite or NaN logit: no number to trust, as torch's log_softmax gives none
    }
  }
  return 0;
}

}  // extern "C"
