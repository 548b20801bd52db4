// Attention of a step's few query tokens over the paged KV cache, read in place: the CPU path of
// jaxinfer.paged.cpu_attention (which says why), an XLA FFI custom call.
//
// Query token t (sequence seq[t], position pos[t]; pos < 0: padding, zeros out) attends to the
// positions p' <= pos[t] (and > pos[t] - window) of its sequence: those below cached[t] from the
// cache (layer `layer`, through the page table), the others from this step's new K/V rows
// first_row[t] + (p' - cached[t]) (the cache is written after the layer loop: Ops.defer_kv_write).
// One work item per (token, kv head): its query heads' scores against each key row (read once for
// all of them), a softmax, then the value rows weighed by it; float32 throughout.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "native_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Problem {
  const float *q, *new_k, *new_v, *k_cache, *v_cache;
  const int32_t *page_table, *seq, *pos, *cached, *first_row;
  float* out;
  int64_t heads, kv_heads, head_dim, page_size, pages_per_seq, layer_stride, window;
  float scale, soft_cap;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  s = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 wv = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 wv = _mm256_set1_ps(w);
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
  for (; i < n; ++i) y[i] += w * x[i];
}

// exp of n floats <= 0 in place: 2^k * p(r), x = k ln2 + r, |r| <= ln2 / 2, p Cephes' expf polynomial
// (within 2 ulp of the true value, as XLA's own exp, which the reference uses). Arguments below -87.3
// (probabilities under 1e-38 of the row's largest) are taken as -87.3.
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_max_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(-87.3f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int j = 1; j < 6; ++j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[j]));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    _mm512_storeu_ps(x + i, _mm512_scalef_ps(p, k));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_max_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(-87.3f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(kExpPoly[0]);
    for (int j = 1; j < 6; ++j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[j]));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^k for k in [-126, 0]: k + 127 in the exponent field
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Rows are prefetched this many positions ahead: the pages' rows are 256-512 bytes apart (kv heads
// interleaved) and the pages themselves scattered, which the hardware prefetchers do not follow.
// SmolLM2's 30 layers at context 1024, one sequence, rows from memory: 9.9 -> 6.2 ms.
constexpr int64_t kAhead = 8;

inline void prefetch_row(const float* r, int64_t D) {
#if defined(__SSE2__)
  for (int64_t c = 0; c < D; c += 16) _mm_prefetch(reinterpret_cast<const char*>(r + c), _MM_HINT_T0);
#endif
}

// Row pointers of kv head h at positions lo .. lo + n - 1 of token t's sequence: the cache's rows
// through the page table (one lookup per page) below cached[t], this step's new rows from there.
void rows_of(const Problem& P, int64_t t, int64_t h, int64_t lo, int64_t n, const float* cache, const float* fresh,
             const float** out) {
  const int64_t D = P.head_dim, row = P.kv_heads * D, cached = P.cached[t];
  const int32_t* pages = P.page_table + int64_t(P.seq[t]) * P.pages_per_seq;
  int64_t j = 0, at = lo;
  while (j < n && at < cached) {
    const int64_t slot = at % P.page_size, run = std::min({n - j, P.page_size - slot, cached - at});
    const float* r = cache + P.layer_stride + (int64_t(pages[at / P.page_size]) * P.page_size + slot) * row + h * D;
    for (int64_t i = 0; i < run; ++i) out[j + i] = r + i * row;
    j += run;
    at += run;
  }
  for (; j < n; ++j, ++at) out[j] = fresh + ((P.first_row[t] + at - cached) * P.kv_heads + h) * D;
}

#if defined(__AVX512F__)
// Lane j of the result: the sum of v[j]'s 16 lanes (a transpose-and-add tree: 45 shuffles and adds
// for 16 sums, where a reduction per vector takes 8).
inline __m512 lane_sums(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 128-bit block k of a[i]: v[2i] and v[2i+1]'s pairs of that block
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // block k of b[i]: v[4i .. 4i + 3]'s sums over block k
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// GN query heads' weighted sums of one 16-float column block of the value rows, in registers; the
// first block's pass prefetches the rows ahead (the later blocks find them in L2).
template <int GN, bool kFirst>
void values_block(const float* s, int64_t n, const float* const* vrows, int64_t c, float* out, int64_t D) {
  __m512 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (kFirst && j + kAhead < n) prefetch_row(vrows[j + kAhead], D);
    const __m512 v = _mm512_loadu_ps(vrows[j] + c);
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * n + j]), v, acc[g]);
  }
  for (int g = 0; g < GN; ++g) _mm512_storeu_ps(out + g * D + c, acc[g]);
}
template <bool kFirst>
void values_heads(int64_t gn, const float* s, int64_t n, const float* const* vrows, int64_t c, float* out, int64_t D) {
  switch (gn) {
    case 1: return values_block<1, kFirst>(s, n, vrows, c, out, D);
    case 2: return values_block<2, kFirst>(s, n, vrows, c, out, D);
    case 3: return values_block<3, kFirst>(s, n, vrows, c, out, D);
    case 4: return values_block<4, kFirst>(s, n, vrows, c, out, D);
    case 5: return values_block<5, kFirst>(s, n, vrows, c, out, D);
    case 6: return values_block<6, kFirst>(s, n, vrows, c, out, D);
    case 7: return values_block<7, kFirst>(s, n, vrows, c, out, D);
    default: return values_block<8, kFirst>(s, n, vrows, c, out, D);
  }
}

// Scores of one query head against key rows j0 .. j0 + m - 1 (m <= 16), DB blocks of 16 columns: q
// held in registers, each row's 16-lane partial products summed by lane_sums.
template <int DB>
inline __m512 block_scores(const float* q, const float* const* krows, int m) {
  __m512 qv[DB], part[16];
  for (int c = 0; c < DB; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < 16; ++j) {
    part[j] = _mm512_setzero_ps();
    for (int c = 0; j < m && c < DB; ++c) part[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(krows[j] + 16 * c), part[j]);
  }
  return lane_sums(part);
}
#endif

// s[g * n + j] = scale * q_g . k_j for G query heads against n key rows.
void scores_of(const float* q, const float* const* krows, int64_t n, int64_t G, int64_t D, float scale, float* s) {
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = int(std::min<int64_t>(16, n - j0));
      for (int64_t j = j0 + 16; j < std::min(n, j0 + 32); ++j) prefetch_row(krows[j], D);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sums = D == 64 ? block_scores<4>(q + g * D, krows + j0, m) : block_scores<8>(q + g * D, krows + j0, m);
        _mm512_mask_storeu_ps(s + g * n + j0, __mmask16((1u << m) - 1), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) prefetch_row(krows[j + kAhead], D);
    for (int64_t g = 0; g < G; ++g) s[g * n + j] = dot(q + g * D, krows[j], D) * scale;
  }
}

// out[g] = sum_j s[g * n + j] v_j for G query heads (out zeroed by the caller).
void values_of(const float* s, const float* const* vrows, int64_t n, int64_t G, int64_t D, float* out) {
  for (int64_t j = 0; j < std::min(n, kAhead); ++j) prefetch_row(vrows[j], D);
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // one column block at a time for up to 8 heads, the sums in registers
    for (int64_t c = 0; c < D; c += 16)
      for (int64_t g = 0; g < G; g += 8) {
        const int64_t gn = std::min<int64_t>(8, G - g);
        if (c == 0 && g == 0) {
          values_heads<true>(gn, s + g * n, n, vrows, c, out + g * D, D);
        } else {
          values_heads<false>(gn, s + g * n, n, vrows, c, out + g * D, D);
        }
      }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    if (j + kAhead < n) prefetch_row(vrows[j + kAhead], D);
    for (int64_t g = 0; g < G; ++g) axpy(s[g * n + j], vrows[j], out + g * D, D);
  }
}

// Token t, kv head h: the output rows of its group's query heads.
void attend(const Problem& P, int64_t t, int64_t h, std::vector<float>& scores, std::vector<const float*>& rows) {
  const int64_t D = P.head_dim, G = P.heads / P.kv_heads;
  float* out = P.out + (t * P.heads + h * G) * D;
  std::fill(out, out + G * D, 0.0f);
  const int64_t p = P.pos[t];
  if (p < 0) return;
  const int64_t lo = std::max<int64_t>(0, p - P.window + 1), n = p + 1 - lo;
  scores.resize(G * n);
  rows.resize(n);
  rows_of(P, t, h, lo, n, P.k_cache, P.new_k, rows.data());
  scores_of(P.q + (t * P.heads + h * G) * D, rows.data(), n, G, D, P.scale, scores.data());
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    if (P.soft_cap > 0)
      for (int64_t j = 0; j < n; ++j) s[j] = P.soft_cap * std::tanh(s[j] / P.soft_cap);
    const float best = *std::max_element(s, s + n);
    for (int64_t j = 0; j < n; ++j) s[j] -= best;
    exp_inplace(s, n);
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += s[j];
    const float inv = 1.0f / total;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;  // normalized here: the output is a weighted sum
  }
  rows_of(P, t, h, lo, n, P.v_cache, P.new_v, rows.data());
  values_of(scores.data(), rows.data(), n, G, D, out);
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> new_k,
                      ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                      ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> seq,
                      ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> cached, ffi::Buffer<ffi::S32> first_row,
                      ffi::Buffer<ffi::S32> window, ffi::ResultBuffer<ffi::F32> out, float scale, float soft_cap) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), pd = page_table.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || pd.size() != 2 || cd[4] != qd[2] || qd[1] % cd[3])
    return ffi::Error::InvalidArgument("q [T, H, D], caches [layers, pages, page_size, kv_heads, D], page_table [S, P]");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("layer out of range");
  const Problem P{q.typed_data(), new_k.typed_data(), new_v.typed_data(), k_cache.typed_data(), v_cache.typed_data(),
                  page_table.typed_data(), seq.typed_data(), pos.typed_data(), cached.typed_data(),
                  first_row.typed_data(), out->typed_data(), qd[1], cd[3], qd[2], cd[2], pd[1],
                  l * cd[1] * cd[2] * cd[3] * cd[4], window.typed_data()[0], scale, soft_cap};
  jaxinfer::parallel_for(pool, 0, qd[0] * cd[3], [&P](int64_t i) {
    thread_local std::vector<float> scores;
    thread_local std::vector<const float*> rows;
    attend(P, i / P.kv_heads, i % P.kv_heads, scores, rows);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferCpuAttention, DecodeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // new_v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_cache
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cached
                                  .Arg<ffi::Buffer<ffi::S32>>()  // first_row
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap"));

// Whether this build has the vector paths (AVX2 + FMA or AVX512): the portable scalar one ran the
// 8-sequence case slower than the reference, which cpu_attention.py then keeps.
extern "C" int JaxinferCpuAttentionVectorized() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}
