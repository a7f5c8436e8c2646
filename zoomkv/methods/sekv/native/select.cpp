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
//   5. sinks and the newest rows forced in (+inf), padding out (-inf); the best m by vote (radix select);
//   6. when m > k, the candidates' finer host codes rescore them (a second table, a softmax over the m
//      candidates), or with rescore_from="host" the host tier's own keys, decoded as read; the forced rows
//      stay forced, and the best k remain;
//   7. the k row ids in sequence order.
// zk_sekv_codes encodes new rows (centred, rotated, two code widths) like codes.py's encode.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "half.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float code_step(int bits) { return bits == 2 ? 0.9957f : bits == 4 ? 0.3352f : 0.0308f; }

// exp(x) for x <= 0 (a softmax's shifted logits), to ~1e-7 relative, in a form the compiler vectorises;
// -inf (padding) gives 0.
inline float exp_nonpositive(float x) {
  const float c = std::max(x, -87.0f);
  const float k = std::floor(c * 1.44269504f + 0.5f);
  const float r = c - k * 0.693145751953125f - k * 1.428606765330187e-06f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t bits = (int32_t(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.0f ? 0.0f : p * scale;
}

// A softmax over l[0..n) in place (the mass of each entry).
void softmax(float* l, int64_t n) {
  float mx = -kInf;
  for (int64_t r = 0; r < n; ++r) mx = std::max(mx, l[r]);
  float sum = 0.0f;
  for (int64_t r = 0; r < n; ++r) {
    l[r] = exp_nonpositive(l[r] - mx);
    sum += l[r];
  }
  const float inv = 1.0f / sum;
  for (int64_t r = 0; r < n; ++r) l[r] *= inv;
}

// The dot products of a group's rotated queries with codes of one width, as codes.py's score_codes.
// One bit: a table of 256 partial sums per code byte (built coordinate by coordinate), a lookup per byte.
// More bits: the levels are (index - 2^(bits-1) + 1/2) * step, linear in the index, so a row's dot product is
// step * q . index + a per-query constant: the codes are unpacked once per row and dotted with every query.
class Scorer {
 public:
  // A trained or fitted hash of mixed widths: layout = (n4, n2, n1) coordinates at 4, 2 and 1 bits, packed in that
  // order, each group whole bytes: a table of 256 partial sums per byte, whatever its width (scored as one bit is).
  Scorer(const float* queries, int64_t group, const int64_t* layout)
      : q_(queries), group_(group), d_(layout[0] + layout[1] + layout[2]), bits_(1),
        nbytes_((4 * layout[0] + 2 * layout[1] + layout[2]) / 8) {
    const int widths[3] = {4, 2, 1};
    for (int w = 0, coord = 0; w < 3; ++w)
      for (int64_t j = 0; j < layout[w] * widths[w] / 8; ++j, coord += 8 / widths[w]) {
        byte_width_.push_back(widths[w]);
        byte_coord_.push_back(coord);
      }
    tables_.resize(group * nbytes_ * 256);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < nbytes_; ++j) {
        float* t = tables_.data() + (g * nbytes_ + j) * 256;
        for (int value = 0; value < 256; ++value) t[value] = partial(g, j, 0, value, 8 / byte_width_[j]);
      }
  }

  Scorer(const float* queries, int64_t group, int64_t d, int bits)
      : q_(queries), group_(group), d_(d), bits_(bits), nbytes_(d * bits / 8) {
    if (bits == 1) {
      for (int64_t j = 0; j < nbytes_; ++j) {
        byte_width_.push_back(1);
        byte_coord_.push_back(int(8 * j));
      }
      const float v = std::sqrt(2.0f / float(M_PI));
      tables_.resize(group * nbytes_ * 256);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < nbytes_; ++j) {
          float* t = tables_.data() + (g * nbytes_ + j) * 256;
          t[0] = 0.0f;
          for (int i = 0, size = 1; i < 8; ++i, size *= 2) {  // coordinate i: bit i of the byte
            const float qi = q_[g * d + j * 8 + i] * v;
            for (int w = 0; w < size; ++w) {
              t[w + size] = t[w] + qi;
              t[w] -= qi;
            }
          }
        }
    } else {
      step_ = code_step(bits);
      const float base = (0.5f - float(1 << (bits - 1))) * step_;
      offset_.resize(group);
      for (int64_t g = 0; g < group; ++g) {
        float sum = 0.0f;
        for (int64_t c = 0; c < d; ++c) sum += q_[g * d + c];
        offset_[g] = base * sum;
      }
      unpacked_.resize(d);
    }
  }

  void reserve(int64_t rows) { rms_.resize(rows); }

  int64_t nbytes() const { return nbytes_; }

  // out[g * count + i] = (group query g) . (the row codes[rows[i]] stands for), times rms[rows[i]] * scale;
  // rows == nullptr: rows 0 .. count - 1.
  void score_rows(const uint8_t* codes, const uint16_t* rms, const int64_t* rows, int64_t count, float scale,
                  float* out) {
    if (bits_ == 1 && nbytes_ == 8 && rows == nullptr) {
      // head_dim 64, every row: a query at a time, one 8-byte load and eight lookups per row
      int64_t first = 0;
#if defined(__AVX512F__)
      first = score_rows_avx512(codes, count, out);
#endif
      for (int64_t g = 0; g < group_; ++g) {
        const float* t = tables_.data() + g * 2048;
        float* o = out + g * count;
        for (int64_t r = first; r < count; ++r) {
          uint64_t c;
          std::memcpy(&c, codes + r * 8, 8);
          o[r] = ((t[c & 255] + t[256 + ((c >> 8) & 255)]) + (t[512 + ((c >> 16) & 255)] + t[768 + ((c >> 24) & 255)])) +
                 ((t[1024 + ((c >> 32) & 255)] + t[1280 + ((c >> 40) & 255)]) +
                  (t[1536 + ((c >> 48) & 255)] + t[1792 + (c >> 56)]));
        }
      }
    } else if (bits_ == 1 && nbytes_ == 4 && rows == nullptr) {
      // a 32-bit hash: a query at a time, one 4-byte load and four lookups per row
      int64_t first = 0;
#if defined(__AVX512F__)
      first = score_rows32_avx512(codes, count, out);
#endif
      for (int64_t g = 0; g < group_; ++g) {
        const float* t = tables_.data() + g * 1024;
        float* o = out + g * count;
        for (int64_t r = first; r < count; ++r) {
          uint32_t c;
          std::memcpy(&c, codes + r * 4, 4);
          o[r] = (t[c & 255] + t[256 + ((c >> 8) & 255)]) + (t[512 + ((c >> 16) & 255)] + t[768 + (c >> 24)]);
        }
      }
    } else {
      for (int64_t i = 0; i < count; ++i) score(codes + (rows ? rows[i] : i) * nbytes_, out + i, count);
    }
    for (int64_t i = 0; i < count; ++i) rms_[i] = half_to_float(rms[rows ? rows[i] : i]) * scale;
    for (int64_t g = 0; g < group_; ++g) {
      float* o = out + g * count;
      for (int64_t i = 0; i < count; ++i) o[i] *= rms_[i];
    }
  }

  // out[g * stride] = (group query g) . (the row `code` stands for), before the row's RMS.
  void score(const uint8_t* code, float* out, int64_t stride) {
    if (bits_ == 1) {
      for (int64_t g = 0; g < group_; ++g) {
        const float* t = tables_.data() + g * nbytes_ * 256;
        float a0 = 0.0f, a1 = 0.0f;
        int64_t j = 0;
        for (; j + 2 <= nbytes_; j += 2) {
          a0 += t[j * 256 + code[j]];
          a1 += t[(j + 1) * 256 + code[j + 1]];
        }
        for (; j < nbytes_; ++j) a0 += t[j * 256 + code[j]];
        out[g * stride] = a0 + a1;
      }
      return;
    }
    float* u = unpacked_.data();
    if (bits_ == 4) {
      for (int64_t j = 0; j < nbytes_; ++j) {
        u[2 * j] = float(code[j] & 15);
        u[2 * j + 1] = float(code[j] >> 4);
      }
    } else if (bits_ == 2) {
      for (int64_t j = 0; j < nbytes_; ++j)
        for (int i = 0; i < 4; ++i) u[4 * j + i] = float((code[j] >> (2 * i)) & 3);
    } else {
      for (int64_t j = 0; j < nbytes_; ++j) u[j] = float(code[j]);
    }
    for (int64_t g = 0; g < group_; ++g) {
      const float* q = q_ + g * d_;
      float dot = 0.0f;
      for (int64_t c = 0; c < d_; ++c) dot += q[c] * u[c];
      out[g * stride] = step_ * dot + offset_[g];
    }
  }

  // Query g's dot product with the levels `value` stands for in `count` coordinates of byte j from its `first` (a
  // byte of width w holds 8 / w coordinates, coordinate i at bits i*w; `value` starts at coordinate `first`).
  float partial(int64_t g, int64_t j, int first, int value, int count) const {
    const int w = byte_width_[j];
    const float* q = q_ + g * d_ + byte_coord_[j] + first;
    const float one = std::sqrt(2.0f / float(M_PI)), step = code_step(w), half = float(1 << (w - 1));
    float sum = 0.0f;
    for (int i = 0; i < count; ++i) {
      const int code = (value >> (i * w)) & ((1 << w) - 1);
      sum += w == 1 ? (code ? q[i] * one : -q[i] * one) : q[i] * ((float(code) - half + 0.5f) * step);
    }
    return sum;
  }

#if defined(__AVX512F__)
  // Query g's 16-entry tables, one per nibble of the code (4, 2 or 1 coordinates by its byte's width), each in a
  // register: t[p][value] is the query's dot product with the levels nibble p = value stands for.
  void nibble_tables(int64_t g, int nibbles, __m512* t) const {
    alignas(64) float nt[16];
    for (int p = 0; p < nibbles; ++p) {
      const int per = 4 / byte_width_[p / 2];  // the nibble's coordinates
      for (int value = 0; value < 16; ++value) nt[value] = partial(g, p / 2, (p % 2) * per, value, per);
      t[p] = _mm512_load_ps(nt);
    }
  }

  // 1 bit, 32 bits a row (a trained hash), sixteen rows at a time: one 64-byte load holds sixteen rows, a lane
  // each; each of a row's 8 nibbles indexes a 16-entry table held in a register (vpermps).
  int64_t score_rows32_avx512(const uint8_t* codes, int64_t count, float* out) {
    const int64_t whole = count / 16 * 16;
    if (whole == 0) return 0;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < group_; ++g) {
      __m512 t[8];
      nibble_tables(g, 8, t);
      float* o = out + g * count;
      for (int64_t r = 0; r < whole; r += 16) {
        const __m512i word = _mm512_loadu_si512(codes + r * 4);
        __m512 acc0 = _mm512_permutexvar_ps(_mm512_and_si512(word, low4), t[0]);
        __m512 acc1 = _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(word, 4), low4), t[1]);
        for (int p = 2; p < 8; p += 2) {
          acc0 = _mm512_add_ps(acc0, _mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(word, 4 * p), low4), t[p]));
          acc1 = _mm512_add_ps(acc1, _mm512_permutexvar_ps(
                                         _mm512_and_si512(_mm512_srli_epi32(word, 4 * p + 4), low4), t[p + 1]));
        }
        _mm512_storeu_ps(o + r, _mm512_add_ps(acc0, acc1));
      }
    }
    return whole;
  }

  // 1 bit, head_dim 64, sixteen rows at a time: each of a row's 16 nibbles (4 coordinates) indexes a 16-entry
  // table that sits in one register (vpermps), so a lookup is a register permute, not a load. Returns the
  // rows done (a multiple of 16); the rest go through the byte tables.
  int64_t score_rows_avx512(const uint8_t* codes, int64_t count, float* out) {
    const int64_t whole = count / 16 * 16;
    if (whole == 0) return 0;
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < group_; ++g) {
      __m512 t[16];
      nibble_tables(g, 16, t);
      float* o = out + g * count;
      for (int64_t r = 0; r < whole; r += 16) {
        const __m512i a = _mm512_loadu_si512(codes + r * 8);
        const __m512i b = _mm512_loadu_si512(codes + r * 8 + 64);
        const __m512i words[2] = {_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b)};
        __m512 acc[4];
        for (int w = 0; w < 2; ++w)
          for (int p = 0; p < 8; ++p) {
            const __m512i idx = _mm512_and_si512(_mm512_srli_epi32(words[w], 4 * p), low4);
            const __m512 part = _mm512_permutexvar_ps(idx, t[w * 8 + p]);
            const int a4 = (w * 8 + p) & 3;
            acc[a4] = (w == 0 && p < 4) ? part : _mm512_add_ps(acc[a4], part);
          }
        _mm512_storeu_ps(o + r, _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
      }
    }
    return whole;
  }
#endif

 private:
  const float* q_;
  int64_t group_, d_;
  int bits_;
  int64_t nbytes_;
  float step_ = 0.0f;
  std::vector<float> tables_, offset_, unpacked_, rms_;
  std::vector<int> byte_width_, byte_coord_;  // table mode: each code byte's width and its first coordinate
};

// A host tier's rows as the recall reads them: float32, or int8 / int4 codes (two to a byte, the low nibble
// first) with an fp16 scale and minimum per group of channels (zoomkv/memory/quant.py).
struct HostRows {
  const void* data;
  int64_t cap;
  int64_t bits;  // 0: float32; else 8, 4 or 2-bit codes, packed 8 / bits to a byte (code j of a byte at bits j*bits)
  const uint16_t* scale;
  const uint16_t* lo;
  int64_t group;      // per token: channels a scale covers; per channel: tokens a block covers
  int64_t channel;    // 0: scales per token and group of channels; 1: per channel and block of tokens (KIVI)
  int64_t scale_cap;  // per channel: the blocks' capacity
  int64_t coded;      // per channel: rows coded so far; the later ones are float32 in `residual`
  const float* residual;
  int64_t residual_cap;

  // Ask for row `row` of (sequence, head) `bh` (its codes and scales) before reading it: rows a step reads are
  // scattered over the tier, so issuing every row's loads first overlaps their latencies.
  void prefetch(int64_t bh, int64_t row, int64_t d) const {
    if (bits == 0 || (channel && row >= coded)) {
      const float* at = bits == 0 ? static_cast<const float*>(data) + (bh * cap + row) * d
                                  : residual + (bh * residual_cap + row - coded) * d;
      for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(at + i);
      return;
    }
    const int64_t at = bh * cap + row;
    __builtin_prefetch(static_cast<const uint8_t*>(data) + at * (d * bits / 8));
    if (!channel) {
      __builtin_prefetch(scale + at * (d / group));
      __builtin_prefetch(lo + at * (d / group));
    }
  }

  // Row `row` of (sequence, head) `bh` as float32 into out[0..d).
  void read(int64_t bh, int64_t row, int64_t d, float* out) const {
    if (bits == 0) {
      std::memcpy(out, static_cast<const float*>(data) + (bh * cap + row) * d, d * 4);
      return;
    }
    if (channel && row >= coded) {
      std::memcpy(out, residual + (bh * residual_cap + row - coded) * d, d * 4);
      return;
    }
    const int64_t at = bh * cap + row;
    const int per = 8 / bits;
    const unsigned mask = (1u << bits) - 1u;
    const uint8_t* c = static_cast<const uint8_t*>(data) + at * (d / per);
    if (channel) {
      const int64_t block = bh * scale_cap + row / group;
      const uint16_t* sc = scale + block * d;
      const uint16_t* mn = lo + block * d;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
      // eight channels at a time: their codes shifted out of one word, their fp16 scales and minima converted
      // in one instruction each (one scalar conversion per number read: kivi4g64's selection took 26.5 ms a
      // step of 4 sequences at 4K against k8v4's 17.9, whose scales are one per group of a row)
      if (d % 8 == 0) {
        const __m256i shifts = _mm256_setr_epi32(0, int(bits), int(2 * bits), int(3 * bits), int(4 * bits),
                                                 int(5 * bits), int(6 * bits), int(7 * bits));
        const __m256i low_bits = _mm256_set1_epi32(int(mask));
        for (int64_t i = 0; i < d; i += 8) {
          __m256i codes;
          if (bits == 8) {
            int64_t word;
            std::memcpy(&word, c + i, 8);
            codes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(word));
          } else {  // eight codes of `bits` bits fill `bits` bytes
            uint32_t word = 0;
            std::memcpy(&word, c + i / per, size_t(bits));
            codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), low_bits);
          }
          const __m256 step = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + i)));
          const __m256 least = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + i)));
          _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), step, least));
        }
        return;
      }
#endif
      for (int64_t i = 0; i < d; ++i) {
        const unsigned code = (c[i / per] >> (bits * (i % per))) & mask;
        out[i] = float(code) * half_to_float(sc[i]) + half_to_float(mn[i]);
      }
      return;
    }
    const int64_t groups = d / group;
    const uint16_t* sc = scale + at * groups;
    const uint16_t* mn = lo + at * groups;
    for (int64_t g = 0; g < groups; ++g) {  // each group's scale and minimum converted once, not per channel
      const float step = half_to_float(sc[g]), low = half_to_float(mn[g]);
      const int64_t first = g * group, last = first + group;
      if (bits == 8) {
        for (int64_t i = first; i < last; ++i) out[i] = float(c[i]) * step + low;
      } else {
        for (int64_t i = first; i < last; ++i) out[i] = float((c[i / per] >> (bits * (i % per))) & mask) * step + low;
      }
    }
  }
};


struct Scratch {
  std::vector<float> qr, qh, logits, vote, vote2, part, rows, sums;
  std::vector<int64_t> order, cand;
  std::vector<uint64_t> keys;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// A float's order as an unsigned integer (larger float, larger key; -inf lowest, +inf highest).
inline uint32_t order_key(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Indices of the `m` largest entries of vote[0..n) into order, in ascending index order; ties go to the lower
// index. A radix select: a histogram of each vote's top 11 order bits finds the bucket the m-th largest falls
// in; only that bucket's rows are compared (nth_element on the vote's order bits, then the inverted index),
// so a step reads the votes three times instead of shuffling n 64-bit keys.
void top_m(const float* vote, int64_t n, int64_t m, std::vector<uint64_t>& keys, std::vector<int64_t>& order) {
  order.resize(m);
  if (m >= n) {
    for (int64_t i = 0; i < m; ++i) order[i] = i;
    return;
  }
  constexpr int kShift = 21;  // 2^11 buckets
  uint32_t hist[1 << (32 - kShift)] = {};
  for (int64_t i = 0; i < n; ++i) ++hist[order_key(vote[i]) >> kShift];
  int64_t bucket = (1 << (32 - kShift)) - 1, above = 0;
  while (above + int64_t(hist[bucket]) < m) above += hist[bucket--];
  const int64_t rest = m - above;  // how many of the boundary bucket's rows are kept (>= 1)
  keys.clear();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = order_key(vote[i]);
    if ((key >> kShift) == uint32_t(bucket)) keys.push_back((uint64_t(key) << 32) | uint64_t(0xffffffffu - uint32_t(i)));
  }
  std::nth_element(keys.begin(), keys.begin() + (rest - 1), keys.end(), std::greater<uint64_t>());
  const uint64_t last = keys[rest - 1];  // the smallest composite key kept
  int64_t j = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = order_key(vote[i]);
    const uint32_t b = key >> kShift;
    if (b > uint32_t(bucket) ||
        (b == uint32_t(bucket) && ((uint64_t(key) << 32) | uint64_t(0xffffffffu - uint32_t(i))) >= last))
      order[j++] = i;
  }
}

// Stage two from the host tier's own keys (rescore_from="host"): the m candidates cand[0..m) decoded from the
// host rows and scored against the group's queries q [group, d] (unrotated: the host keys are the model's),
// each query's softmax over the candidates summed per row as the vote; sinks and the newest rows (forced in
// by position, as SeKV._forced finds them) stay in, padding stays out; the best k into dst (any order).
// What SeKV._rescore_host computes.
void rescore_host_rows(const HostRows& keys, int64_t bh, const float* q, int64_t group, int64_t d, float scaling,
                       const int64_t* cand, int64_t m, int64_t k, int64_t n, int64_t recent, const int64_t* sinks,
                       int64_t n_sinks, const uint8_t* valid_b, Scratch& s, int64_t* dst) {
  s.rows.resize(m * d);
  s.vote2.assign(m, 0.0f);
  s.part.resize(m);
  for (int64_t j = 0; j < m; ++j) keys.prefetch(bh, cand[j], d);
  for (int64_t j = 0; j < m; ++j) keys.read(bh, cand[j], d, s.rows.data() + j * d);
  float* l = s.part.data();
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    for (int64_t j = 0; j < m; ++j) {
      const float* r = s.rows.data() + j * d;
      float acc = 0.0f;
      for (int64_t i = 0; i < d; ++i) acc += qg[i] * r[i];
      l[j] = acc * scaling;
    }
    softmax(l, m);
    for (int64_t j = 0; j < m; ++j) s.vote2[j] += l[j];
  }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t row = cand[j];
    bool forced = recent > 0 && row >= n - recent;
    for (int64_t i = 0; i < n_sinks && !forced; ++i) forced = sinks[i] == row;
    if (forced) s.vote2[j] = kInf;
    else if (valid_b && !valid_b[row]) s.vote2[j] = -kInf;
  }
  top_m(s.vote2.data(), m, k, s.keys, s.order);
  for (int64_t j = 0; j < k; ++j) dst[j] = cand[s.order[j]];
}

// Where a row's codes go: per width, the codes and fp16 RMS buffers and their capacities in rows
// ([batch * heads, capacity, ·]); bits = 0: that width is not kept.
struct RowCodes {
  int bits1;
  uint8_t* codes1;
  int64_t codes1_cap;
  uint16_t* rms1;
  int64_t rms1_cap;
  int bits2;
  uint8_t* codes2;
  int64_t codes2_cap;
  uint16_t* rms2;
  int64_t rms2_cap;
};

// One key's codes, as codes.py's encode of (key - mean) @ rotation, into row `row` of (sequence, head) `bh`.
void encode_row(const float* key, const float* mu, const float* rotation, int64_t d, const RowCodes& out, int64_t bh,
                int64_t row) {
  float x[512];  // head_dim <= 512 (checked by the caller)
  for (int64_t c = 0; c < d; ++c) x[c] = 0.0f;
  for (int64_t j = 0; j < d; ++j) {
    const float kj = key[j] - mu[j];
    const float* rot = rotation + j * d;
    for (int64_t c = 0; c < d; ++c) x[c] += kj * rot[c];
  }
  float ss = 0.0f;
  for (int64_t c = 0; c < d; ++c) ss += x[c] * x[c];
  const float rms = std::sqrt(ss / float(d));
  const float denom = std::max(rms, 1e-12f);
  for (int w = 0; w < 2; ++w) {
    const int bits = w == 0 ? out.bits1 : out.bits2;
    if (!bits) continue;
    const int64_t nbytes = d * bits / 8;
    uint8_t* dst = (w == 0 ? out.codes1 + (bh * out.codes1_cap + row) * nbytes
                           : out.codes2 + (bh * out.codes2_cap + row) * nbytes);
    (w == 0 ? out.rms1[bh * out.rms1_cap + row] : out.rms2[bh * out.rms2_cap + row]) = float_to_half(rms);
    const int per_byte = 8 / bits, half = 1 << (bits - 1);
    const float step = bits == 1 ? 1.0f : code_step(bits);
    for (int64_t j = 0; j < nbytes; ++j) {
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
      dst[j] = uint8_t(byte);
    }
  }
}

// Every buffer of one layer a decode step reads and writes. Only 8-byte fields, so the ctypes mirror in
// native/__init__.py (LayerArgs) lays it out identically; a layer's plan keeps one filled in between steps.
struct Layer {
  int64_t batch, heads, d, dv;
  int64_t n;           // rows held (host tier and index alike)
  int64_t query_rows;  // query rows per KV head this step: the group's heads x the new queries
  double scaling;
  const float* query;  // [batch, heads * query_rows, d]
  int64_t* idx;        // [batch, heads, k]: the rows picked, in sequence order
  float* bias;         // [batch, heads, k + 1]: the recalled rows' logit bias (with out_keys)
  // the index: 1-bit (or 2/4/8) codes of every row, rotated and centred; anchors' finer codes
  const float* rotation;  // [d, d]
  const float* gains;     // [heads, d] or null
  const float* mean;      // [batch, heads, d]
  uint8_t* codes;
  int64_t codes_cap, bits;
  uint16_t* rms;
  int64_t rms_cap;
  int64_t anchors;
  const int64_t* anchor_pos;  // [batch, anchors], -1: none
  const uint8_t* anchor_codes;
  const uint16_t* anchor_rms;
  int64_t anchor_bits;
  const uint8_t* valid;  // [batch, valid_cap] or null
  int64_t valid_cap;
  int64_t sinks;
  const int64_t* sink_pos;  // [batch, sinks]
  int64_t recent, m, k;
  uint8_t* fine_codes;  // [batch, heads, fine_cap, d * fine_bits / 8]: stage two's codes (rescore_from="codes")
  int64_t fine_cap;
  uint16_t* fine_rms;
  int64_t fine_rms_cap, fine_bits;
  int64_t rescore_host;  // stage two from the host keys (rescore_from="host")
  HostRows keys, values;
  float* key_sum;  // [batch, heads, d]: the summary row's running sums and count [batch, heads]
  float* value_sum;
  float* count;
  const float* offset;  // [heads] or null: the trained summary bias
  float* out_keys;      // [batch, heads, out_cap, d]: the recall buffers (null: no recall, idx only)
  float* out_values;
  int64_t out_cap;
  int64_t append_keys, append_values;  // the append writes float32 host rows (else the caller codes them)
  // host_anchor_bits: the anchors' rows once more, finer, [batch, heads, anchors, d]; the recall reads a row
  // that is an anchor (anchor_pos) from here instead of from keys / values
  int64_t anchor_copies;
  HostRows anchor_keys, anchor_values;
  // hash_bits > 0: the index is a trained hash: codes = signs of (key - mean) @ hash_key[h] ([heads, d, hash_bits]),
  // stage one scores them against query @ hash_query[h]; anchors and stage two keep the rotated key's codes
  int64_t hash_bits;
  const float* hash_key;
  const float* hash_query;
  // its layout: (n4, n2, n1) projections at 4, 2 and 1 bits (n1 = hash_bits: every one a sign), and whether the
  // projections are each sequence's own ([batch, heads, d, m], fitted to the context) or the heads' ([heads, d, m])
  int64_t hash_layout[3];
  int64_t hash_per_sequence;

  // the hash's projections: its layout's coordinates
  int64_t hash_coords() const { return hash_layout[0] + hash_layout[1] + hash_layout[2]; }
};

// One key's hash codes: its m = n4 + n2 + n1 projections (key - mean) @ proj ([d, m]), over their RMS, quantized at
// 4, 2 and 1 bits by layout (codes.py's encode_layout), packed group after group; and the projections' fp16 RMS.
void encode_hash_row(const float* key, const float* mu, const float* proj, int64_t d, const int64_t* layout,
                     uint8_t* codes, uint16_t* rms) {
  const int64_t m = layout[0] + layout[1] + layout[2];
  float x[512];  // m <= 512 (checked by the caller)
  for (int64_t c = 0; c < m; ++c) x[c] = 0.0f;
  for (int64_t j = 0; j < d; ++j) {
    const float kj = key[j] - mu[j];
    const float* row = proj + j * m;
    for (int64_t c = 0; c < m; ++c) x[c] += kj * row[c];
  }
  float ss = 0.0f;
  for (int64_t c = 0; c < m; ++c) ss += x[c] * x[c];
  const float r = std::sqrt(ss / float(m));
  *rms = float_to_half(r);
  const float inv = 1.0f / std::max(r, 1e-12f);
  const int widths[3] = {4, 2, 1};
  int64_t c = 0;
  for (int w = 0; w < 3; ++w) {
    const int bits = widths[w], per = 8 / bits, half = 1 << (bits - 1);
    for (int64_t j = 0; j < layout[w] / per; ++j, ++codes) {
      unsigned byte = 0;
      for (int i = 0; i < per; ++i, ++c) {
        const float z = x[c] * inv;
        const int code = bits == 1 ? int(x[c] > 0.0f)
                                   : int(std::min(std::max(std::floor(z / code_step(bits)), float(-half)),
                                                  float(half - 1))) + half;
        byte |= unsigned(code) << (i * bits);
      }
      *codes = uint8_t(byte);
    }
  }
}

// How many of a group's query rows are scored at once against `rows` rows: their logits and 1-bit byte tables
// (2,048 floats a query at head_dim 64) within about 8 MB a thread; a decode step's whole group in one go.
int64_t rows_at_once(int64_t group, int64_t rows) {
  constexpr int64_t kFloatsAtOnce = int64_t(1) << 21;
  return std::max<int64_t>(1, std::min<int64_t>(group, kFloatsAtOnce / (std::max<int64_t>(rows, 1) + 2048)));
}

// Steps 1-7 above for (sequence, KV head) bh: the k rows picked into dst, in sequence order.
void select_head(const Layer& a, int64_t bh, Scratch& s, int64_t* dst) {
  const int64_t b = bh / a.heads, h = bh % a.heads, group = a.query_rows, d = a.d, n = a.n, m = a.m, k = a.k;
  const float scaling = float(a.scaling);
  const uint8_t* valid_b = a.valid ? a.valid + b * a.valid_cap : nullptr;
  s.qr.resize(group * d);
  s.vote.resize(n);
  s.vote2.resize(m);
  s.part.resize(group);
  // 1. the group's queries, rotated and weighted
  for (int64_t g = 0; g < group; ++g) {
    const float* q = a.query + (bh * group + g) * d;
    float* qr = s.qr.data() + g * d;
    for (int64_t c = 0; c < d; ++c) qr[c] = 0.0f;
    for (int64_t j = 0; j < d; ++j) {
      const float qj = q[j];
      const float* row = a.rotation + j * d;
      for (int64_t c = 0; c < d; ++c) qr[c] += qj * row[c];
    }
    if (a.gains)
      for (int64_t c = 0; c < d; ++c) qr[c] *= a.gains[h * d + c];
  }
  // 2-4. every row's estimated logit from its code, anchors through their finer codes, padding out, then the
  // group's vote (each query row's softmax, summed), a block of query rows at a time: a prefill chunk's group is
  // its heads x its positions, and its logits and byte tables at once would take gigabytes a thread at 32K
  const int64_t block = rows_at_once(group, n);
  s.logits.resize(block * n);
  if (a.hash_bits) {
    const int64_t nb = a.hash_coords();
    s.qh.assign(group * nb, 0.0f);
    const float* proj = a.hash_query + (a.hash_per_sequence ? bh : h) * d * nb;
    for (int64_t g = 0; g < group; ++g) {
      const float* q = a.query + (bh * group + g) * d;
      float* qh = s.qh.data() + g * nb;
      for (int64_t j = 0; j < d; ++j) {
        const float qj = q[j];
        const float* row = proj + j * nb;
        for (int64_t c = 0; c < nb; ++c) qh[c] += qj * row[c];
      }
    }
  }
  std::fill(s.vote.begin(), s.vote.end(), 0.0f);
  for (int64_t g0 = 0; g0 < group; g0 += block) {
    const int64_t rows = std::min(block, group - g0);
    if (a.hash_bits) {
      Scorer scorer(s.qh.data() + g0 * a.hash_coords(), rows, a.hash_layout);
      scorer.reserve(n);
      scorer.score_rows(a.codes + bh * a.codes_cap * scorer.nbytes(), a.rms + bh * a.rms_cap, nullptr, n, scaling,
                        s.logits.data());
    } else {
      Scorer scorer(s.qr.data() + g0 * d, rows, d, int(a.bits));
      scorer.reserve(n);
      scorer.score_rows(a.codes + bh * a.codes_cap * scorer.nbytes(), a.rms + bh * a.rms_cap, nullptr, n, scaling,
                        s.logits.data());
    }
    if (a.anchors) {
      Scorer scorer(s.qr.data() + g0 * d, rows, d, int(a.anchor_bits));
      const int64_t nb = scorer.nbytes();
      const int64_t* pos = a.anchor_pos + b * a.anchors;
      for (int64_t i = 0; i < a.anchors; ++i) {
        const int64_t p = pos[i];
        if (p < 0 || p >= n) continue;
        scorer.score(a.anchor_codes + (bh * a.anchors + i) * nb, s.part.data(), 1);
        const float scale = half_to_float(a.anchor_rms[bh * a.anchors + i]) * scaling;
        for (int64_t g = 0; g < rows; ++g) s.logits[g * n + p] = s.part[g] * scale;
      }
    }
    if (valid_b)
      for (int64_t r = 0; r < n; ++r)
        if (!valid_b[r])
          for (int64_t g = 0; g < rows; ++g) s.logits[g * n + r] = -kInf;
    for (int64_t g = 0; g < rows; ++g) {
      float* l = s.logits.data() + g * n;
      softmax(l, n);
      for (int64_t r = 0; r < n; ++r) s.vote[r] += l[r];
    }
  }
  // 5. forced rows, then the best m
  const int64_t* sp = a.sink_pos + b * a.sinks;
  for (int64_t i = 0; i < a.sinks; ++i)
    if (sp[i] >= 0 && sp[i] < n) s.vote[sp[i]] = kInf;
  for (int64_t r = std::max<int64_t>(0, n - a.recent); r < n; ++r) s.vote[r] = kInf;
  if (valid_b)
    for (int64_t r = 0; r < n; ++r)
      if (!valid_b[r]) s.vote[r] = -kInf;
  top_m(s.vote.data(), n, m, s.keys, s.order);
  if (m > k && a.rescore_host) {
    // 6. the candidates rescored with the host tier's own keys
    s.cand.assign(s.order.begin(), s.order.end());
    rescore_host_rows(a.keys, bh, a.query + bh * group * d, group, d, scaling, s.cand.data(), m, k, n, a.recent, sp,
                      a.sinks, valid_b, s, dst);
  } else if (m > k) {
    // 6. the candidates rescored with their finer host codes (padding is not masked here: the torch path's
    // softmax over the candidates does not mask it either; it stays out through its -inf first-stage vote)
    const int64_t fine_bytes = d * a.fine_bits / 8;
    for (int64_t j = 0; j < m; ++j) {  // random rows of the host tier: ask for all of them before reading one
      __builtin_prefetch(a.fine_codes + (bh * a.fine_cap + s.order[j]) * fine_bytes);
      __builtin_prefetch(a.fine_rms + bh * a.fine_rms_cap + s.order[j]);
    }
    const int64_t fine_block = rows_at_once(group, m);
    s.logits.resize(std::max(block * n, fine_block * m));
    float* l = s.logits.data();  // reused: [rows][m]
    std::fill(s.vote2.begin(), s.vote2.begin() + m, 0.0f);
    for (int64_t g0 = 0; g0 < group; g0 += fine_block) {
      const int64_t rows = std::min(fine_block, group - g0);
      Scorer scorer(s.qr.data() + g0 * d, rows, d, int(a.fine_bits));
      scorer.reserve(m);
      scorer.score_rows(a.fine_codes + bh * a.fine_cap * fine_bytes, a.fine_rms + bh * a.fine_rms_cap,
                        s.order.data(), m, scaling, l);
      for (int64_t g = 0; g < rows; ++g) {
        float* lg = l + g * m;
        softmax(lg, m);
        for (int64_t j = 0; j < m; ++j) s.vote2[j] += lg[j];
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      const float first = s.vote[s.order[j]];
      if (std::isinf(first)) s.vote2[j] = first;
    }
    s.cand.assign(s.order.begin(), s.order.end());
    top_m(s.vote2.data(), m, k, s.keys, s.order);
    for (int64_t j = 0; j < k; ++j) dst[j] = s.cand[s.order[j]];
  } else {
    for (int64_t j = 0; j < k; ++j) dst[j] = s.order[j];
  }
  // 7. sequence order
  std::sort(dst, dst + k);
}

// The recall for (sequence, KV head) bh: rows[0..k) of the host keys/values decoded into the recall buffers'
// rows 0..k-1, and row k set to the mean of every other row, (running sum - the selected rows) / (count -
// selected), with a logit bias of log(count - selected) + offset[h] (-inf when no row is left out); selected
// padding rows get bias -inf and count for nothing. As zoomkv.memory.tail.with_tail computes it.
void recall_head(const Layer& a, int64_t bh, const int64_t* rows, int64_t k, Scratch& s) {
  const int64_t dk = a.d, dv = a.dv;
  const uint8_t* valid_b = a.valid ? a.valid + (bh / a.heads) * a.valid_cap : nullptr;
  s.sums.assign(dk + dv, 0.0f);
  float* sk = s.sums.data();
  float* sv = sk + dk;
  float* ok = a.out_keys + bh * a.out_cap * dk;
  float* ov = a.out_values + bh * a.out_cap * dv;
  float* bb = a.bias + bh * (k + 1);
  float chosen = 0.0f;
  for (int64_t i = 0; i < k; ++i) {
    a.keys.prefetch(bh, rows[i], dk);
    a.values.prefetch(bh, rows[i], dv);
  }
  // rows and anchor positions both ascend (the anchors' -1 placeholders first): one walk matches them
  const int64_t* anchor_at = a.anchor_copies ? a.anchor_pos + (bh / a.heads) * a.anchors : nullptr;
  int64_t next = 0;
  for (int64_t i = 0; i < k; ++i) {
    float* kr = ok + i * dk;
    float* vr = ov + i * dv;
    if (anchor_at) {
      while (next < a.anchors && anchor_at[next] < rows[i]) ++next;
    }
    if (anchor_at && next < a.anchors && anchor_at[next] == rows[i]) {
      a.anchor_keys.read(bh, next, dk, kr);
      a.anchor_values.read(bh, next, dv, vr);
    } else {
      a.keys.read(bh, rows[i], dk, kr);
      a.values.read(bh, rows[i], dv, vr);
    }
    if (valid_b && !valid_b[rows[i]]) {
      bb[i] = -kInf;
      continue;
    }
    bb[i] = 0.0f;
    chosen += 1.0f;
    for (int64_t c = 0; c < dk; ++c) sk[c] += kr[c];
    for (int64_t c = 0; c < dv; ++c) sv[c] += vr[c];
  }
  const float rest = a.count[bh] - chosen;
  const float denom = std::max(rest, 1.0f);
  for (int64_t c = 0; c < dk; ++c) ok[k * dk + c] = (a.key_sum[bh * dk + c] - sk[c]) / denom;
  for (int64_t c = 0; c < dv; ++c) ov[k * dv + c] = (a.value_sum[bh * dv + c] - sv[c]) / denom;
  bb[k] = rest > 0.5f ? std::log(denom) + (a.offset ? a.offset[bh % a.heads] : 0.0f) : -kInf;
}

// A step's new rows (keys [batch, heads, rows, d], values [.., dv]) into every buffer the layer keeps: their
// codes (and finer codes) at row n of the index, the rows themselves at row n of float32 host tiers the
// append writes, and the summary row's running sums and count. Buffers have room for the rows.
void append_rows(const Layer& a, const float* keys, const float* values, int64_t rows) {
  const int64_t d = a.d, dv = a.dv;
  const RowCodes out{a.hash_bits ? 0 : int(a.bits), a.codes, a.codes_cap, a.rms, a.rms_cap,
                     int(a.fine_bits), a.fine_codes, a.fine_cap, a.fine_rms, a.fine_rms_cap};
  float* host_keys = a.append_keys ? static_cast<float*>(const_cast<void*>(a.keys.data)) : nullptr;
  float* host_values = a.append_values ? static_cast<float*>(const_cast<void*>(a.values.data)) : nullptr;
  std::vector<float> ks(d), vs(dv);
  for (int64_t bh = 0; bh < a.batch * a.heads; ++bh) {
    std::fill(ks.begin(), ks.end(), 0.0f);
    std::fill(vs.begin(), vs.end(), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const float* key = keys + (bh * rows + r) * d;
      const float* value = values + (bh * rows + r) * dv;
      encode_row(key, a.mean + bh * d, a.rotation, d, out, bh, a.n + r);
      if (a.hash_bits)
        encode_hash_row(key, a.mean + bh * d, a.hash_key + (a.hash_per_sequence ? bh : bh % a.heads) * d * a.hash_coords(),
                        d, a.hash_layout, a.codes + (bh * a.codes_cap + a.n + r) * (a.hash_bits / 8),
                        a.rms + bh * a.rms_cap + a.n + r);
      if (host_keys) std::memcpy(host_keys + (bh * a.keys.cap + a.n + r) * d, key, d * 4);
      if (host_values) std::memcpy(host_values + (bh * a.values.cap + a.n + r) * dv, value, dv * 4);
      for (int64_t c = 0; c < d; ++c) ks[c] += key[c];
      for (int64_t c = 0; c < dv; ++c) vs[c] += value[c];
    }
    if (a.key_sum) {  // the rows' sum first, then added: as torch's sum += rows.sum(2)
      for (int64_t c = 0; c < d; ++c) a.key_sum[bh * d + c] += ks[c];
      for (int64_t c = 0; c < dv; ++c) a.value_sum[bh * dv + c] += vs[c];
      a.count[bh] += float(rows);
    }
  }
}

}  // namespace

extern "C" {

// A decode step's selection of every (sequence, KV head), and with out_keys its recall, in one call: one
// (sequence, KV head) a task over torch's own OpenMP threads (the library links the libgomp torch loaded);
// the heads are independent, so the result is the same at any thread count.
int zk_sekv_step(const Layer* a) {
  if (a->k > a->m || a->m > a->n || a->k < 1 || (a->out_keys && a->out_cap < a->k + 1)) return 1;
#pragma omp parallel for schedule(dynamic, 1) if (a->batch * a->heads > 1)
  for (int64_t bh = 0; bh < a->batch * a->heads; ++bh) {
    Scratch& s = scratch();
    int64_t* dst = a->idx + bh * a->k;
    select_head(*a, bh, s, dst);
    if (a->out_keys) recall_head(*a, bh, dst, a->k, s);
  }
  return 0;
}

// The recall alone, of rows idx [batch, heads, k] (a->idx) picked elsewhere.
int zk_sekv_recall_rows(const Layer* a) {
  if (a->out_cap < a->k + 1) return 1;
#pragma omp parallel for schedule(dynamic, 1) if (a->batch * a->heads > 1)
  for (int64_t bh = 0; bh < a->batch * a->heads; ++bh) recall_head(*a, bh, a->idx + bh * a->k, a->k, scratch());
  return 0;
}

// A decode step's new rows into the layer's buffers (append_rows).
int zk_sekv_append(const Layer* a, const float* keys, const float* values, int64_t rows) {
  if (a->d > 512 || a->hash_bits > 512) return 1;
  append_rows(*a, keys, values, rows);
  return 0;
}

// New rows' codes, as codes.py's encode of (keys - mean) @ rotation, at two widths (bits2 = 0: one):
// codes1 [batch, heads, rows, d * bits1 / 8] and rms1 [batch, heads, rows, 1] fp16 (codes2 / rms2 the same).
int zk_sekv_codes(int64_t batch, int64_t heads, int64_t rows, int64_t d,
                  const float* keys,      // [batch, heads, rows, d]
                  const float* mean,      // [batch, heads, d]
                  const float* rotation,  // [d, d]
                  int bits1, uint8_t* codes1, uint16_t* rms1, int bits2, uint8_t* codes2, uint16_t* rms2) {
  if (d > 512) return 1;
  const RowCodes out{bits1, codes1, rows, rms1, rows, bits2, codes2, rows, rms2, rows};
  for (int64_t bh = 0; bh < batch * heads; ++bh)
    for (int64_t r = 0; r < rows; ++r) encode_row(keys + (bh * rows + r) * d, mean + bh * d, rotation, d, out, bh, r);
  return 0;
}

}  // extern "C"
