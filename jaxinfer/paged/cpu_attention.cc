// Attention of a step's few query tokens over the paged KV cache, read in place: the CPU path of
// jaxinfer.paged.cpu_attention (which says why), an XLA FFI custom call.
//
// Query token t (sequence seq[t], position pos[t]; pos < 0: padding, zeros out) attends to the
// positions p' <= pos[t] (and > pos[t] - window) of its sequence: those below cached[t] from the
// cache (layer `layer`, through the page table), the others from this step's new K/V rows
// first_row[t] + (p' - cached[t]) (the cache is written after the layer loop: Ops.defer_kv_write).
// Work items are spans of a token's context (about 4 per thread over the step, so one long context
// spreads over the threads): every query head's scores against the span's key rows (a position's kv
// heads lie side by side, so an item streams whole rows, prefetched ahead), an unnormalized softmax,
// the value rows weighed by it; then each token's spans are merged by their maxima and sums (as
// flash-decoding does). Float32 throughout.

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

// Rows are prefetched this many positions ahead, into L2: pages are scattered, which the hardware
// prefetchers do not follow (SmolLM2's 30 layers at context 1024, one sequence, rows from memory:
// 9.9 -> 6.2 ms with prefetching into L1 alone; into L2, 1.07-1.29x faster again than into L1,
// where the misses in flight are fewer).
constexpr int64_t kAhead = 8;
// Positions per work item at the least: fewer make the merge of the items' partial sums cost more
// than the balance across threads gains.
constexpr int64_t kMinSpan = 64;

// The first n floats from r (whole 64-byte lines), into L2.
inline void prefetch_row(const float* r, int64_t n) {
#if defined(__SSE2__)
  for (int64_t c = 0; c < n; c += 16) _mm_prefetch(reinterpret_cast<const char*>(r + c), _MM_HINT_T1);
#endif
}

// Where positions lo .. lo + n - 1 of token t's sequence start (kv head 0; head h is h * head_dim
// further): the cache's rows through the page table (one lookup per page) below cached[t], this
// step's new rows from there. Both hold a position's kv heads side by side.
void rows_of(const Problem& P, int64_t t, int64_t lo, int64_t n, const float* cache, const float* fresh,
             const float** out) {
  const int64_t row = P.kv_heads * P.head_dim, cached = P.cached[t];
  const int32_t* pages = P.page_table + int64_t(P.seq[t]) * P.pages_per_seq;
  int64_t j = 0, at = lo;
  while (j < n && at < cached) {
    const int64_t slot = at % P.page_size, run = std::min({n - j, P.page_size - slot, cached - at});
    const float* r = cache + P.layer_stride + (int64_t(pages[at / P.page_size]) * P.page_size + slot) * row;
    for (int64_t i = 0; i < run; ++i) out[j + i] = r + i * row;
    j += run;
    at += run;
  }
  for (; j < n; ++j, ++at) out[j] = fresh + (P.first_row[t] + at - cached) * row;
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
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// GN query heads' weighted sums of one 16-float column block (at `col` of each row), in registers,
// into out (heads `stride` apart); pf > 0: prefetch that many floats of the rows ahead (the first
// pass over them).
template <int GN>
void values_block(const float* s, int64_t n, const float* const* rows, int64_t col, int64_t pf, float* out,
                  int64_t stride) {
  __m512 acc[GN];
  for (int g = 0; g < GN; ++g) acc[g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (pf && j + kAhead < n) prefetch_row(rows[j + kAhead], pf);
    const __m512 v = _mm512_loadu_ps(rows[j] + col);
    for (int g = 0; g < GN; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g * n + j]), v, acc[g]);
  }
  for (int g = 0; g < GN; ++g) _mm512_storeu_ps(out + g * stride, acc[g]);
}

void values_heads(int64_t gn, const float* s, int64_t n, const float* const* rows, int64_t col, int64_t pf, float* out,
                  int64_t stride) {
  switch (gn) {
    case 1: return values_block<1>(s, n, rows, col, pf, out, stride);
    case 2: return values_block<2>(s, n, rows, col, pf, out, stride);
    case 3: return values_block<3>(s, n, rows, col, pf, out, stride);
    case 4: return values_block<4>(s, n, rows, col, pf, out, stride);
    case 5: return values_block<5>(s, n, rows, col, pf, out, stride);
    case 6: return values_block<6>(s, n, rows, col, pf, out, stride);
    case 7: return values_block<7>(s, n, rows, col, pf, out, stride);
    default: return values_block<8>(s, n, rows, col, pf, out, stride);
  }
}

// Scores of one query head against rows[0 .. m - 1] + off (m <= 16), DB blocks of 16 columns: q
// held in registers, each row's 16-lane partial products summed by lane_sums.
template <int DB>
inline __m512 block_scores(const float* q, const float* const* rows, int64_t off, int m) {
  __m512 qv[DB], part[16];
  for (int c = 0; c < DB; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int j = 0; j < 16; ++j) {
    part[j] = _mm512_setzero_ps();
    for (int c = 0; j < m && c < DB; ++c)
      part[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + off + 16 * c), part[j]);
  }
  return lane_sums(part);
}
#endif

// s[g * n + j] = scale * q_g . (rows[j] + off) for G query heads against n key rows; pf > 0:
// prefetch that many floats of the rows ahead.
void scores_of(const float* q, const float* const* rows, int64_t off, int64_t pf, int64_t n, int64_t G, int64_t D,
               float scale, float* s) {
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
      const int m = int(std::min<int64_t>(16, n - j0));
      for (int64_t j = j0 + 16; pf && j < std::min(n, j0 + 32); ++j) prefetch_row(rows[j], pf);
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sums = D == 64 ? block_scores<4>(q + g * D, rows + j0, off, m)
                                    : block_scores<8>(q + g * D, rows + j0, off, m);
        _mm512_mask_storeu_ps(s + g * n + j0, __mmask16((1u << m) - 1), _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    if (pf && j + kAhead < n) prefetch_row(rows[j + kAhead], pf);
    for (int64_t g = 0; g < G; ++g) s[g * n + j] = dot(q + g * D, rows[j] + off, D) * scale;
  }
}

// out + g * stride = sum_j s[g * n + j] (rows[j] + off) for G query heads (out zeroed by the
// caller); pf as scores_of.
void values_of(const float* s, const float* const* rows, int64_t off, int64_t pf, int64_t n, int64_t G, int64_t D,
               float* out, int64_t stride) {
  for (int64_t j = 0; pf && j < std::min(n, kAhead); ++j) prefetch_row(rows[j], pf);
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // one column block at a time for up to 8 heads, the sums in registers
    for (int64_t c = 0; c < D; c += 16)
      for (int64_t g = 0; g < G; g += 8)
        values_heads(std::min<int64_t>(8, G - g), s + g * n, n, rows, off + c, c == 0 && g == 0 ? pf : 0,
                     out + g * stride + c, stride);
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    if (pf && j + kAhead < n) prefetch_row(rows[j + kAhead], pf);
    for (int64_t g = 0; g < G; ++g) axpy(s[g * n + j], rows[j] + off, out + g * stride, D);
  }
}

// One work item: token t's query heads over positions [a, a + n) of its context, every kv head (a
// position's rows for all of them lie side by side, so the item streams whole rows). Per query head
// into acc[head * (D + 2)]: sum_j exp(s_j - m) v_j, then m (the scores' max) and l = sum_j exp(s_j - m).
void attend_span(const Problem& P, int64_t t, int64_t a, int64_t n, float* acc, std::vector<float>& scores,
                 std::vector<const float*>& rows) {
  const int64_t D = P.head_dim, G = P.heads / P.kv_heads, H = P.heads, row = P.kv_heads * D;
  scores.resize(H * n);
  rows.resize(n);
  float* s = scores.data();
  rows_of(P, t, a, n, P.k_cache, P.new_k, rows.data());
  for (int64_t h = 0; h < P.kv_heads; ++h)
    scores_of(P.q + (t * H + h * G) * D, rows.data(), h * D, h == 0 ? row : 0, n, G, D, P.scale, s + h * G * n);
  for (int64_t g = 0; g < H; ++g) {
    float* sg = s + g * n;
    if (P.soft_cap > 0)
      for (int64_t j = 0; j < n; ++j) sg[j] = P.soft_cap * std::tanh(sg[j] / P.soft_cap);
    const float best = *std::max_element(sg, sg + n);
    for (int64_t j = 0; j < n; ++j) sg[j] -= best;
    exp_inplace(sg, n);
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total += sg[j];
    float* stats = acc + g * (D + 2) + D;
    stats[0] = best;
    stats[1] = total;
    std::fill(acc + g * (D + 2), acc + g * (D + 2) + D, 0.0f);
  }
  rows_of(P, t, a, n, P.v_cache, P.new_v, rows.data());
  for (int64_t h = 0; h < P.kv_heads; ++h)
    values_of(s + h * G * n, rows.data(), h * D, h == 0 ? row : 0, n, G, D, acc + h * G * (D + 2), D + 2);
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
  const int64_t T = qd[0], H = P.heads, D = P.head_dim;
  std::fill(P.out, P.out + T * H * D, 0.0f);  // padding tokens stay zero
  // Work items: spans of each token's context, about 4 per worker over the step (whole pages, at
  // least kMinSpan positions), so one long context spreads over the threads too.
  std::vector<int64_t> lo(T), len(T), first(T + 1, 0);
  int64_t total = 0;
  for (int64_t t = 0; t < T; ++t) {
    lo[t] = std::max<int64_t>(0, P.pos[t] - P.window + 1);
    len[t] = P.pos[t] < 0 ? 0 : P.pos[t] + 1 - lo[t];
    total += len[t];
  }
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t span = (total + 4 * workers - 1) / (4 * workers);
  span = std::max(kMinSpan, (span + P.page_size - 1) / P.page_size * P.page_size);
  for (int64_t t = 0; t < T; ++t) first[t + 1] = first[t] + (len[t] + span - 1) / span;
  std::vector<float> partial(first[T] * H * (D + 2));
  jaxinfer::parallel_for(pool, 0, first[T], [&](int64_t i) {
    thread_local std::vector<float> scores;
    thread_local std::vector<const float*> rows;
    const int64_t t = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1, k = i - first[t];
    attend_span(P, t, lo[t] + k * span, std::min(span, len[t] - k * span), partial.data() + i * H * (D + 2), scores,
                rows);
  });
  // Merge each token's spans: out = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k, M = max_k m_k.
  for (int64_t t = 0; t < T; ++t) {
    if (len[t] == 0) continue;  // padding
    for (int64_t g = 0; g < H; ++g) {
      auto part = [&](int64_t k) { return partial.data() + ((first[t] + k) * H + g) * (D + 2); };
      const int64_t spans = first[t + 1] - first[t];
      float best = part(0)[D], total_l = 0.0f;
      for (int64_t k = 1; k < spans; ++k) best = std::max(best, part(k)[D]);
      float* o = P.out + (t * H + g) * D;
      for (int64_t k = 0; k < spans; ++k) {
        const float w = std::exp(part(k)[D] - best);  // 1 for the span holding the maximum
        total_l += w * part(k)[D + 1];
        axpy(w, part(k), o, D);
      }
      const float inv = 1.0f / total_l;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
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
