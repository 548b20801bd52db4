// y[T, out] = x[T, in] @ dequantize(W)[out, in]^T for quantized W, float32 activations and output:
// the CPU matmul of jaxinfer.quant (built and registered by cpu_kernel.py, which says why).
//
// Each block of 32 codes is decoded in registers to float32 (w = q * d + m: one FMA, the same
// value dequantize() computes, or that value rounded once instead of twice for Q4_1 / int4) and
// multiply-accumulated in float32 against the activations, so the result is dequantize-then-matmul
// within float32 rounding. Layout (qarray.py): codes [out, in / 2] nibbles (byte j of each 32
// columns: column j low, j + 16 high), with 5- and 6-bit codes' upper bits in `high` [out, in / 8 *
// (bits - 4)], or [out, in] int8; scales and offsets [out, in / group], float16 or float32.
//
// Work: output rows in chunks that the caller and XLA's intra-op pool take from one counter; within
// a chunk, tiles of kRowTile rows x kTokenTile tokens, each block of codes decoded once per tile into
// registers and multiplied by the tile's tokens. From 4 tokens on this is bound by the FMAs (the
// decode hides behind them): measured on this 2-core AVX512 CPU, a 3072x576 Q4_1 matrix at 64 tokens
// ran at the same FMA rate as at 4, and a variant that decoded each row tile once into a float32
// buffer for all tokens was 1.6-1.9x slower at 5-64 tokens, so it was dropped.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)  // x86: the intrinsics of whatever -march=native enables
#include <immintrin.h>
#endif

#include "native_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRowTile = 4;
constexpr int kTokenTile = 4;
// Codes are prefetched this far ahead of the block read, into L2 (rows are contiguous, so past a
// row's end it reaches the next tile's rows): one thread streaming SmolLM2's 30 MB Q8_0 lm_head at
// one token went from 3.5 to 2.1 ms (into L1, 512 bytes: 3.2, 1024: 2.6, 2048: 2.1, 4096: 2.0). In the
// engine's batch-1 decode step (every weight from memory, both threads), 4 KB into L2 against 2 KB
// into L1 was 1.06-1.13x faster over three in-process A/Bs (3 KB 1.03x, 6-8 KB 1.07-1.11x, 16 KB
// 1.07x; 2 KB into L2 0.93x, 4 KB into L1 1.03x). One token only: in the several-token tiles (bound
// by their FMAs) prefetching cost 18%.
constexpr int kPrefetchBytes = 4096;

// Format ids, as cpu_kernel.FORMAT_IDS.
// kInt8Groups: int8 codes with a scale (and an offset, where given) per group of 16 or a multiple of 32
// columns (GGUF tensors of different formats fused into one leaf). kQ5_0: 5-bit codes, q - 16;
// kQ5Offsets: Q5_1 / Q5_K, q * d + m; kQ6_K: 6-bit, q - 32, groups of 16. The codes' fifth and sixth
// bits are in `high` as bit planes: per 32 columns one 32-bit word per bit, bit c for column c.
enum Format : int64_t {
  kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kInt4 = 3, kInt8 = 4, kInt8Groups = 5, kQ5_0 = 6, kQ5Offsets = 7, kQ6_K = 8
};

// A vector of 16 float32 lanes: one zmm, two ymm, or a plain array (portable path).
#if defined(__AVX512F__)
struct V { __m512 v; };
inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V vset1(float s) { return {_mm512_set1_ps(s)}; }
inline V vfma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vmul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float vsum(V a) { return _mm512_reduce_add_ps(a.v); }
// 32 nibble codes (16 bytes) -> columns 0..15 (low nibbles) and 16..31 (high nibbles).
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  lo.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, m)));
  hi.v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), m)));
}
inline void bytes(const int8_t* p, V& lo, V& hi) {
  lo.v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  hi.v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}
// 32 nibbles plus their fifth (kBits 5) or fifth and sixth (6) bits: each bit plane of `h` (a 32-bit
// word, bit c for column c) is a lane mask for adding 16 (32) to the nibbles' floats.
template <int kBits>
inline void nibbles_high(const uint8_t* p, const uint8_t* h, V& lo, V& hi) {
  nibbles(p, lo, hi);
  for (int plane = 0; plane < kBits - 4; ++plane) {
    uint32_t word;
    std::memcpy(&word, h + 4 * plane, 4);
    const __m512 add = _mm512_set1_ps(float(16 << plane));
    lo.v = _mm512_mask_add_ps(lo.v, __mmask16(word & 0xFFFF), lo.v, add);
    hi.v = _mm512_mask_add_ps(hi.v, __mmask16(word >> 16), hi.v, add);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
struct V { __m256 a, b; };
inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
inline V vset1(float s) { return {_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline V vfma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline V vmul(V x, V y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline float vsum(V x) {
  const __m256 s = _mm256_add_ps(x.a, x.b);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
inline __m256 u8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
inline __m256 i8x8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(15);
  const __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  lo = {u8x8(l), u8x8(_mm_srli_si128(l, 8))};
  hi = {u8x8(h), u8x8(_mm_srli_si128(h, 8))};
}
inline void bytes(const int8_t* p, V& lo, V& hi) {
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  lo = {i8x8(l), i8x8(_mm_srli_si128(l, 8))};
  hi = {i8x8(h), i8x8(_mm_srli_si128(h, 8))};
}
template <int kBits>
inline void nibbles_high(const uint8_t* p, const uint8_t* h, V& lo, V& hi) {
  nibbles(p, lo, hi);
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int plane = 0; plane < kBits - 4; ++plane) {
    uint32_t word;
    std::memcpy(&word, h + 4 * plane, 4);
    const __m256 add = _mm256_set1_ps(float(16 << plane));
    auto part = [&](int first) {  // 16 << plane in lanes first .. first + 7 whose bit is set, else 0
      const __m256i bits = _mm256_and_si256(_mm256_set1_epi32(int(word >> first)), lane);
      return _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, lane)), add);
    };
    lo = {_mm256_add_ps(lo.a, part(0)), _mm256_add_ps(lo.b, part(8))};
    hi = {_mm256_add_ps(hi.a, part(16)), _mm256_add_ps(hi.b, part(24))};
  }
}
#else
struct V { float v[16]; };
inline V vzero() { return V{}; }
inline V vload(const float* p) { V r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void vstore(float* p, V a) { std::memcpy(p, a.v, sizeof a.v); }
inline V vset1(float s) { V r; for (float& e : r.v) e = s; return r; }
inline V vfma(V a, V b, V c) { for (int i = 0; i < 16; ++i) c.v[i] = a.v[i] * b.v[i] + c.v[i]; return c; }
inline V vmul(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
inline float vsum(V a) { float s = 0; for (float e : a.v) s += e; return s; }
inline void nibbles(const uint8_t* p, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) { lo.v[i] = float(p[i] & 15); hi.v[i] = float(p[i] >> 4); }
}
inline void bytes(const int8_t* p, V& lo, V& hi) {
  for (int i = 0; i < 16; ++i) { lo.v[i] = float(p[i]); hi.v[i] = float(p[i + 16]); }
}
template <int kBits>
inline void nibbles_high(const uint8_t* p, const uint8_t* h, V& lo, V& hi) {
  nibbles(p, lo, hi);
  for (int plane = 0; plane < kBits - 4; ++plane)
    for (int c = 0; c < 32; ++c)
      if ((h[4 * plane + c / 8] >> (c % 8)) & 1) (c < 16 ? lo.v[c] : hi.v[c - 16]) += float(16 << plane);
}
#endif

float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant * 2^-24, exact in float32
    float f = float(mant) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// n float16 or float32 values from p[first] on, as float32.
void to_float(const void* p, bool f32, int64_t first, int64_t n, float* out) {
  if (f32) {
    std::memcpy(out, static_cast<const float*>(p) + first, n * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(p) + first;
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = half_to_float(h[i]);
}

struct Weights {
  int64_t fmt, out, in, group;
  const uint8_t* values;
  const uint8_t* high;  // 5- and 6-bit formats' upper bits
  const void* scales;
  const void* offsets;
  bool f32_scales, f32_offsets, has_offsets;

  int bits() const {
    return fmt == kQ5_0 || fmt == kQ5Offsets ? 5 : fmt == kQ6_K ? 6 : fmt == kQ4_0 || fmt == kQ4_1 || fmt == kInt4 ? 4 : 8;
  }
  float zero() const { return fmt == kQ4_0 ? 8.0f : fmt == kQ5_0 ? 16.0f : fmt == kQ6_K ? 32.0f : 0.0f; }
  // d and m of rows row0 .. row0 + rows - 1, per block of 32 columns (group 16: per half-block):
  // w = q * d + m.
  void tile_params(int64_t row0, int64_t rows, float* d, float* m) const {
    const int64_t groups = in / group, per = std::max<int64_t>(1, group / 32), n = rows * groups;
    to_float(scales, f32_scales, row0 * groups, n, d);
    if (has_offsets) {
      to_float(offsets, f32_offsets, row0 * groups, n, m);
    } else {
      for (int64_t i = 0; i < n; ++i) m[i] = -zero() * d[i];  // (q - zero) * d, rounded once
    }
    for (int64_t i = n - 1; per > 1 && i >= 0; --i)  // one per group -> one per block, in place from the end
      for (int64_t k = per - 1; k >= 0; --k) {
        d[i * per + k] = d[i];
        m[i * per + k] = m[i];
      }
  }
};

// Per-thread scratch: the row tile's decode parameters, per block of 32 columns.
struct Scratch {
  std::vector<float> d, m, xsum;
};

// Column block b of row `row`: its codes q as float32 (lo: columns b*32 .. +15, hi: +16 .. +31).
template <int kBits>
inline void codes(const Weights& w, int64_t row, int64_t b, V& lo, V& hi) {
  if (kBits == 8) {
    bytes(reinterpret_cast<const int8_t*>(w.values) + row * w.in + b * 32, lo, hi);
  } else if (kBits == 4) {
    nibbles(w.values + row * (w.in / 2) + b * 16, lo, hi);
  } else {
    constexpr int64_t kHighBytes = (kBits - 4) * 4;  // per 32 columns
    nibbles_high<kBits>(w.values + row * (w.in / 2) + b * 16, w.high + (row * (w.in / 32) + b) * kHighBytes, lo, hi);
  }
}

// Parameters per block of 32 columns: 2 for groups of 16 (lo and hi halves), else 1.
template <bool kHalf>
constexpr int64_t kPer = kHalf ? 2 : 1;

// Column block b of row `row` decoded to float32 (columns b*32 .. +15 in lo, +16 .. +31 in hi), d
// and m that row's per-block parameters.
template <int kBits, bool kHalf>
inline void decode(const Weights& w, int64_t row, int64_t b, const float* d, const float* m, V& lo, V& hi) {
  codes<kBits>(w, row, b, lo, hi);
  const int64_t i = b * kPer<kHalf>, j = i + kPer<kHalf> - 1;
  lo = vfma(lo, vset1(d[i]), vset1(m[i]));
  hi = vfma(hi, vset1(d[j]), vset1(m[j]));
}

// y[t, row0 + r] for R rows and TT tokens: each block of codes decoded once, its product with every
// token accumulated in registers (R * TT accumulators). d, m: the rows' parameters, `blocks` apart.
template <int kBits, bool kHalf, int R, int TT>
void tile(const Weights& w, int64_t row0, const float* d, const float* m, const float* x, float* y) {
  const int64_t blocks = w.in / 32, stride = blocks * kPer<kHalf>;
  V acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      V lo, hi;
      decode<kBits, kHalf>(w, row0 + r, b, d + r * stride, m + r * stride, lo, hi);
      for (int t = 0; t < TT; ++t)
        acc[r][t] = vfma(hi, vload(x + t * w.in + b * 32 + 16), vfma(lo, vload(x + t * w.in + b * 32), acc[r][t]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) y[t * w.out + row0 + r] = vsum(acc[r][t]);
}

// One token, R rows, factored: y = sum_b d_b (q_b . x_b) + sum_b m_b xsum_b (xsum_b: the token's
// sum over block b, or half-block for groups of 16), three multiply-adds per block where decoding
// first takes four; the same result within float32 rounding (one thread, 3072x576 Q4_1: 118 -> 108
// us; Q8_0: 107 -> 106).
template <int kBits, bool kHalf, int R>
void token_tile(const Weights& w, int64_t row0, const float* d, const float* m, const float* x, const float* xsum,
                float* y) {
  const int64_t blocks = w.in / 32, stride = blocks * kPer<kHalf>;
  V acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vzero();
  for (int64_t b = 0; b < blocks; ++b) {
    const V xl = vload(x + b * 32), xh = vload(x + b * 32 + 16);
    for (int r = 0; r < R; ++r) {
#if defined(__SSE2__)
      _mm_prefetch(reinterpret_cast<const char*>(w.values + (row0 + r) * (kBits < 8 ? w.in / 2 : w.in) +
                                                 b * (kBits < 8 ? 16 : 32)) + kPrefetchBytes, _MM_HINT_T1);
#endif
      V lo, hi;
      codes<kBits>(w, row0 + r, b, lo, hi);
      if (kHalf) {
        const float* dr = d + r * stride + b * 2;
        acc[r] = vfma(vmul(hi, xh), vset1(dr[1]), vfma(vmul(lo, xl), vset1(dr[0]), acc[r]));
      } else {
        acc[r] = vfma(vfma(hi, xh, vmul(lo, xl)), vset1(d[r * blocks + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float offset = 0.0f;
    for (int64_t i = 0; i < stride; ++i) offset += m[r * stride + i] * xsum[i];
    y[row0 + r] = vsum(acc[r]) + offset;
  }
}

using TokenFn = void (*)(const Weights&, int64_t, const float*, const float*, const float*, const float*, float*);
template <int kBits, bool kHalf>
constexpr TokenFn kTokenTiles[kRowTile] = {token_tile<kBits, kHalf, 1>, token_tile<kBits, kHalf, 2>,
                                           token_tile<kBits, kHalf, 3>, token_tile<kBits, kHalf, 4>};

using TileFn = void (*)(const Weights&, int64_t, const float*, const float*, const float*, float*);
template <int kBits, bool kHalf, int R>
constexpr TileFn kByTokens[kTokenTile] = {tile<kBits, kHalf, R, 1>, tile<kBits, kHalf, R, 2>, tile<kBits, kHalf, R, 3>,
                                          tile<kBits, kHalf, R, 4>};
template <int kBits, bool kHalf>
constexpr const TileFn* kTiles[kRowTile] = {kByTokens<kBits, kHalf, 1>, kByTokens<kBits, kHalf, 2>,
                                            kByTokens<kBits, kHalf, 3>, kByTokens<kBits, kHalf, 4>};

template <int kBits, bool kHalf>
void rows_of(const Weights& w, const float* x, int64_t tokens, float* y, int64_t begin, int64_t end) {
  thread_local Scratch s;
  const int64_t blocks = w.in / 32, stride = blocks * kPer<kHalf>;
  s.d.resize(kRowTile * stride);
  s.m.resize(kRowTile * stride);
  const float *d = s.d.data(), *m = s.m.data();
  if (tokens == 1) {
    s.xsum.resize(stride);
    for (int64_t b = 0; b < blocks; ++b) {
      const V xl = vload(x + b * 32), xh = vload(x + b * 32 + 16);
      if (kHalf) {
        s.xsum[2 * b] = vsum(xl);
        s.xsum[2 * b + 1] = vsum(xh);
      } else {
        s.xsum[b] = vsum(vfma(xh, vset1(1.0f), xl));
      }
    }
  }
  for (int64_t row0 = begin; row0 < end; row0 += kRowTile) {
    const int rows = int(std::min<int64_t>(kRowTile, end - row0));
    w.tile_params(row0, rows, s.d.data(), s.m.data());
    if (tokens == 1) {
      kTokenTiles<kBits, kHalf>[rows - 1](w, row0, d, m, x, s.xsum.data(), y);
      continue;
    }
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
      const int tt = int(std::min<int64_t>(kTokenTile, tokens - t0));
      kTiles<kBits, kHalf>[rows - 1][tt - 1](w, row0, d, m, x + t0 * w.in, y + t0 * w.out);
    }
  }
}

bool is_float(ffi::DataType t) { return t == ffi::DataType::F16 || t == ffi::DataType::F32; }

ffi::Error QMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values, ffi::AnyBuffer high,
                       ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::ResultBuffer<ffi::F32> y, int64_t fmt,
                       int64_t group, int64_t threads) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) return ffi::Error::InvalidArgument("x [T, in] -> y [T, out]");
  Weights w{fmt, yd[1], xd[1], group, static_cast<const uint8_t*>(values.untyped_data()),
            static_cast<const uint8_t*>(high.untyped_data()), scales.untyped_data(),
            offsets.untyped_data(), scales.element_type() == ffi::DataType::F32,
            offsets.element_type() == ffi::DataType::F32,
            fmt == kQ4_1 || fmt == kInt4 || fmt == kQ5Offsets || (fmt == kInt8Groups && offsets.element_count() != 0)};
  if (fmt < kQ4_0 || fmt > kQ6_K) return ffi::Error::InvalidArgument("unknown format id");
  const bool half = group == 16 && (fmt == kInt8Groups || fmt == kQ6_K);
  if (w.in % 32 || (group % 32 && !half) || group <= 0 || w.in % group || (fmt == kQ6_K && !half))
    return ffi::Error::InvalidArgument("in and the group size must be multiples of 32 (16: int8 groups, Q6_K), the "
                                       "group dividing in");
  const int bits = w.bits();
  const int64_t groups = w.in / group;
  const bool has_offsets = w.has_offsets;
  if (values.size_bytes() != size_t(w.out * (bits < 8 ? w.in / 2 : w.in)) ||
      high.size_bytes() != size_t(bits == 5 || bits == 6 ? w.out * w.in / 8 * (bits - 4) : 0) ||
      scales.element_count() != size_t(w.out * groups) || !is_float(scales.element_type()) ||
      (has_offsets && (offsets.element_count() != size_t(w.out * groups) || !is_float(offsets.element_type()))))
    return ffi::Error::InvalidArgument("codes, scales or offsets do not match [out, in] and the group size");
  const int64_t tokens = xd[0];
  if (tokens == 0 || w.out == 0) return ffi::Error::Success();

  const int64_t workers = threads > 0 ? threads : std::max<int64_t>(1, pool.num_threads());
  // About 4 chunks per worker (balance when one is late), whole row tiles, at least 16 rows.
  int64_t chunk = (w.out + 4 * workers - 1) / (4 * workers);
  chunk = std::max<int64_t>(16, (chunk + kRowTile - 1) / kRowTile * kRowTile);
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  jaxinfer::parallel_for(pool, workers, (w.out + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t begin = c * chunk, end = std::min(w.out, begin + chunk);
    switch (bits) {
      case 4: rows_of<4, false>(w, xp, tokens, yp, begin, end); break;
      case 5: rows_of<5, false>(w, xp, tokens, yp, begin, end); break;
      case 6: rows_of<6, true>(w, xp, tokens, yp, begin, end); break;
      default:
        if (half) {
          rows_of<8, true>(w, xp, tokens, yp, begin, end);
        } else {
          rows_of<8, false>(w, xp, tokens, yp, begin, end);
        }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// threads: 0 = the caller plus XLA's intra-op pool (its size); n > 0 = n workers, the caller and
// n - 1 pool tasks (1: the caller alone).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferQMatmul, QMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("threads"));
