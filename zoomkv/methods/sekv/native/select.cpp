// sekv's decode-step router on the CPU, in one call per layer: the work zoomkv/methods/sekv/method.py does
// in torch (_pick), without materialising a [g, n * bytes] gather, a softmax tensor or a sort of all n rows.
//
// Plain C ABI (no torch headers, so it builds in seconds): zoomkv/methods/sekv/native/__init__.py compiles
// it once per machine and calls it through ctypes with the tensors' data pointers. Every layout below is a
// contiguous tensor the Python side checked before calling.
//
// Per (sequence, KV head):
//   1. the G query heads of the group, rotated like the codes and weighted by the trained gains;
//   2. per query head, a table of 256 partial dot products per code byte (built coordinate by coordinate:
//      512 adds a byte), so a row's estimated logit is rms * sum of one lookup per byte;
//   3. anchors (the surprising rows) rescored with their finer codes, padding rows at -inf;
//   4. a softmax per query head over all rows, summed over the group: the vote;
//   5. sinks and the newest rows forced in (+inf), padding out (-inf); the best m by vote (nth_element);
//   6. when m > k, the candidates' finer host codes rescore them (a second table, a softmax over the m
//      candidates), the forced rows stay forced, and the best k remain;
//   7. the k row ids in sequence order.
// zk_sekv_codes encodes new rows (centred, rotated, two code widths) like codes.py's encode.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float half_to_float(uint16_t h) {
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

uint16_t float_to_half(float f) {  // round to nearest even, as torch's .to(float16)
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

// The value of each code, codes.py's levels(bits): one bit, +-sqrt(2/pi); more, the Gaussian-optimal step.
void code_levels(int bits, float* out) {
  if (bits == 1) {
    const float v = std::sqrt(2.0f / float(M_PI));
    out[0] = -v;
    out[1] = v;
    return;
  }
  const float step = bits == 2 ? 0.9957f : bits == 4 ? 0.3352f : 0.0308f;
  const int count = 1 << bits, half = count / 2;
  for (int i = 0; i < count; ++i) out[i] = (float(i - half) + 0.5f) * step;
}

float code_step(int bits) { return bits == 2 ? 0.9957f : bits == 4 ? 0.3352f : 0.0308f; }

// tables[byte * 256 + value]: the query's dot product with the coordinates byte `byte` packs as `value`.
void build_tables(const float* q, int64_t d, int bits, const float* lv, float* tables) {
  const int per_byte = 8 / bits, count = 1 << bits;
  const int64_t nbytes = d * bits / 8;
  for (int64_t j = 0; j < nbytes; ++j) {
    float* t = tables + j * 256;
    t[0] = 0.0f;
    int size = 1;
    for (int i = 0; i < per_byte; ++i) {  // add coordinate i: values v + c << (bits * i)
      const float qi = q[j * per_byte + i];
      for (int c = count - 1; c >= 0; --c) {
        const float add = qi * lv[c];
        for (int v = 0; v < size; ++v) t[v + c * size] = t[v] + add;
      }
      size *= count;
    }
  }
}

float score_row(const float* tables, const uint8_t* code, int64_t nbytes) {
  float s = 0.0f;
  for (int64_t j = 0; j < nbytes; ++j) s += tables[j * 256 + code[j]];
  return s;
}

struct Scratch {
  std::vector<float> qr, tables, logits, vote, vote2;
  std::vector<int64_t> order, cand;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// Indices of the `m` largest entries of vote[0..n) into out (any order); ties broken by the lower index.
void top_m(const float* vote, int64_t n, int64_t m, std::vector<int64_t>& order) {
  order.resize(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  if (m < n) {
    std::nth_element(order.begin(), order.begin() + m, order.end(), [vote](int64_t a, int64_t b) {
      return vote[a] > vote[b] || (vote[a] == vote[b] && a < b);
    });
  }
  order.resize(m);
}

}  // namespace

extern "C" {

int zk_sekv_select(int64_t batch, int64_t heads, int64_t group, int64_t d, int64_t n,
                   const float* query,      // [batch, heads * group, d]
                   const float* rotation,   // [d, d]: rotated = query @ rotation
                   const float* gains,      // [heads, d] or null
                   float scaling,
                   const uint8_t* codes, int64_t codes_cap, int bits,  // [batch, heads, codes_cap, d * bits / 8]
                   const uint16_t* rms, int64_t rms_cap,               // [batch, heads, rms_cap] fp16
                   int64_t anchors, const int64_t* anchor_pos,         // [batch, anchors], -1: none
                   const uint8_t* anchor_codes, const uint16_t* anchor_rms, int anchor_bits,
                   const uint8_t* valid, int64_t valid_cap,            // [batch, valid_cap] or null
                   int64_t sinks, const int64_t* sink_pos,             // [batch, sinks]
                   int64_t recent, int64_t m, int64_t k,
                   const uint8_t* fine_codes, int64_t fine_cap,        // [batch, heads, fine_cap, d * fine_bits / 8]
                   const uint16_t* fine_rms, int64_t fine_rms_cap, int fine_bits,
                   int64_t* out) {                                     // [batch, heads, k]
  if (k > m || m > n || k < 1) return 1;
  Scratch& s = scratch();
  const int64_t nbytes = d * bits / 8;
  const int64_t anchor_nbytes = anchor_bits ? d * anchor_bits / 8 : 0;
  const int64_t fine_nbytes = fine_bits ? d * fine_bits / 8 : 0;
  float lv[256], anchor_lv[256], fine_lv[256];
  code_levels(bits, lv);
  if (anchor_bits) code_levels(anchor_bits, anchor_lv);
  if (fine_bits) code_levels(fine_bits, fine_lv);
  const int64_t widest = std::max({nbytes, anchor_nbytes, fine_nbytes});
  s.qr.resize(group * d);
  s.tables.resize(group * widest * 256);
  s.logits.resize(group * n);
  s.vote.resize(n);
  s.vote2.resize(m);

  for (int64_t b = 0; b < batch; ++b) {
    const uint8_t* valid_b = valid ? valid + b * valid_cap : nullptr;
    for (int64_t h = 0; h < heads; ++h) {
      // 1. the group's queries, rotated and weighted
      for (int64_t g = 0; g < group; ++g) {
        const float* q = query + ((b * heads + h) * group + g) * d;
        float* qr = s.qr.data() + g * d;
        for (int64_t c = 0; c < d; ++c) qr[c] = 0.0f;
        for (int64_t j = 0; j < d; ++j) {
          const float qj = q[j];
          const float* row = rotation + j * d;
          for (int64_t c = 0; c < d; ++c) qr[c] += qj * row[c];
        }
        if (gains)
          for (int64_t c = 0; c < d; ++c) qr[c] *= gains[h * d + c];
      }
      // 2. every row's estimated logit from its code
      const uint8_t* codes_h = codes + (b * heads + h) * codes_cap * nbytes;
      const uint16_t* rms_h = rms + (b * heads + h) * rms_cap;
      for (int64_t g = 0; g < group; ++g) build_tables(s.qr.data() + g * d, d, bits, lv, s.tables.data() + g * nbytes * 256);
      for (int64_t r = 0; r < n; ++r) {
        const uint8_t* code = codes_h + r * nbytes;
        const float scale = half_to_float(rms_h[r]) * scaling;
        for (int64_t g = 0; g < group; ++g)
          s.logits[g * n + r] = score_row(s.tables.data() + g * nbytes * 256, code, nbytes) * scale;
      }
      // 3. anchors through their finer codes; padding out
      if (anchors) {
        const int64_t* pos = anchor_pos + b * anchors;
        const uint8_t* acodes = anchor_codes + (b * heads + h) * anchors * anchor_nbytes;
        const uint16_t* arms = anchor_rms + (b * heads + h) * anchors;
        for (int64_t g = 0; g < group; ++g)
          build_tables(s.qr.data() + g * d, d, anchor_bits, anchor_lv, s.tables.data() + g * anchor_nbytes * 256);
        for (int64_t a = 0; a < anchors; ++a) {
          const int64_t p = pos[a];
          if (p < 0 || p >= n) continue;
          const float scale = half_to_float(arms[a]) * scaling;
          for (int64_t g = 0; g < group; ++g)
            s.logits[g * n + p] = score_row(s.tables.data() + g * anchor_nbytes * 256, acodes + a * anchor_nbytes,
                                            anchor_nbytes) * scale;
        }
      }
      if (valid_b)
        for (int64_t r = 0; r < n; ++r)
          if (!valid_b[r])
            for (int64_t g = 0; g < group; ++g) s.logits[g * n + r] = -kInf;
      // 4. the group's vote: each query head's softmax, summed
      std::fill(s.vote.begin(), s.vote.end(), 0.0f);
      for (int64_t g = 0; g < group; ++g) {
        float* l = s.logits.data() + g * n;
        float mx = -kInf;
        for (int64_t r = 0; r < n; ++r) mx = std::max(mx, l[r]);
        float sum = 0.0f;
        for (int64_t r = 0; r < n; ++r) {
          l[r] = std::exp(l[r] - mx);
          sum += l[r];
        }
        const float inv = 1.0f / sum;
        for (int64_t r = 0; r < n; ++r) s.vote[r] += l[r] * inv;
      }
      // 5. forced rows, then the best m
      const int64_t* sp = sink_pos + b * sinks;
      for (int64_t i = 0; i < sinks; ++i)
        if (sp[i] >= 0 && sp[i] < n) s.vote[sp[i]] = kInf;
      for (int64_t r = std::max<int64_t>(0, n - recent); r < n; ++r) s.vote[r] = kInf;
      if (valid_b)
        for (int64_t r = 0; r < n; ++r)
          if (!valid_b[r]) s.vote[r] = -kInf;
      top_m(s.vote.data(), n, m, s.order);
      int64_t* dst = out + (b * heads + h) * k;
      if (m > k) {
        // 6. the candidates rescored with their finer codes
        const uint8_t* fine_h = fine_codes + (b * heads + h) * fine_cap * fine_nbytes;
        const uint16_t* frms_h = fine_rms + (b * heads + h) * fine_rms_cap;
        for (int64_t g = 0; g < group; ++g)
          build_tables(s.qr.data() + g * d, d, fine_bits, fine_lv, s.tables.data() + g * fine_nbytes * 256);
        std::fill(s.vote2.begin(), s.vote2.begin() + m, 0.0f);
        float* l = s.logits.data();  // reused: [m] per query head
        for (int64_t g = 0; g < group; ++g) {
          const float* t = s.tables.data() + g * fine_nbytes * 256;
          float mx = -kInf;
          for (int64_t j = 0; j < m; ++j) {
            const int64_t r = s.order[j];
            l[j] = score_row(t, fine_h + r * fine_nbytes, fine_nbytes) * half_to_float(frms_h[r]) * scaling;
            mx = std::max(mx, l[j]);
          }
          float sum = 0.0f;
          for (int64_t j = 0; j < m; ++j) {
            l[j] = std::exp(l[j] - mx);
            sum += l[j];
          }
          const float inv = 1.0f / sum;
          for (int64_t j = 0; j < m; ++j) s.vote2[j] += l[j] * inv;
        }
        for (int64_t j = 0; j < m; ++j) {
          const float first = s.vote[s.order[j]];
          if (std::isinf(first)) s.vote2[j] = first;
        }
        s.cand.assign(s.order.begin(), s.order.end());
        top_m(s.vote2.data(), m, k, s.order);
        for (int64_t j = 0; j < k; ++j) dst[j] = s.cand[s.order[j]];
      } else {
        for (int64_t j = 0; j < k; ++j) dst[j] = s.order[j];
      }
      // 7. sequence order
      std::sort(dst, dst + k);
    }
  }
  return 0;
}

// New rows' codes, as codes.py's encode of (keys - mean) @ rotation, at two widths (bits2 = 0: one).
int zk_sekv_codes(int64_t batch, int64_t heads, int64_t rows, int64_t d,
                  const float* keys,      // [batch, heads, rows, d]
                  const float* mean,      // [batch, heads, d]
                  const float* rotation,  // [d, d]
                  int bits1, uint8_t* codes1, uint16_t* rms1,  // [batch, heads, rows, d * bits1 / 8], [.., 1]
                  int bits2, uint8_t* codes2, uint16_t* rms2) {
  std::vector<float> x(d);
  for (int64_t bh = 0; bh < batch * heads; ++bh) {
    const float* mu = mean + bh * d;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = bh * rows + r;
      const float* key = keys + at * d;
      for (int64_t c = 0; c < d; ++c) x[c] = 0.0f;
      for (int64_t j = 0; j < d; ++j) {
        const float kj = key[j] - mu[j];
        const float* row = rotation + j * d;
        for (int64_t c = 0; c < d; ++c) x[c] += kj * row[c];
      }
      float ss = 0.0f;
      for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
      const float rms = std::sqrt(ss / float(d));
      const float denom = std::max(rms, 1e-12f);
      for (int w = 0; w < 2; ++w) {
        const int bits = w == 0 ? bits1 : bits2;
        if (!bits) continue;
        uint8_t* out = (w == 0 ? codes1 : codes2) + at * (d * bits / 8);
        (w == 0 ? rms1 : rms2)[at] = float_to_half(rms);
        const int per_byte = 8 / bits, half = 1 << (bits - 1);
        const float step = bits == 1 ? 1.0f : code_step(bits);
        for (int64_t j = 0; j < d / per_byte; ++j) {
          unsigned byte = 0;
          for (int i = 0; i < per_byte; ++i) {
            const float z = x[j * per_byte + i] / denom;
            int idx;
            if (bits == 1) {
              idx = z > 0.0f;
            } else {
              idx = int(std::floor(z / step));
              idx = std::min(std::max(idx, -half), half - 1) + half;
            }
            byte |= unsigned(idx) << (bits * i);
          }
          out[j] = uint8_t(byte);
        }
      }
    }
  }
  return 0;
}

}  // extern "C"
