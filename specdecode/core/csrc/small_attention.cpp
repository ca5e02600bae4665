// specdecode::small_attention: attention of few queries per KV head (decode and verify steps), part of the
// avx2 module (AVX2 + FMA). q [B, KV, G, D] holds each KV group's query heads folded into G = group * tokens
// rows (head-major, as core.attention.small_query_attention lays them out); k, v [B, KV, S, D] are views of
// the cache (the last dimension contiguous); mask [1 or B, tokens, S] bool (True = attend) or None (every
// key). Row j of a group is token j % tokens. Scores, softmax and the weighted sum of values are fp32
// throughout; the output is written in q's dtype. A row that sees no key gets zeros (callers never ask:
// padding queries see key 0).
//
// Why: aten's SDPA (_scaled_dot_product_flash_attention_for_cpu) took 98 us per layer call at one query and
// 200 keys in a bf16 decode step here (2-core Zen4 EPYC, torch profile), for about 0.2 MFLOP of work: its
// cost is set-up, not arithmetic. See core/attention.py for what this kernel measured against it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "attention_args.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace specdecode_attention;

inline void to_float(const float* x, float* out, int64_t n) { std::copy(x, x + n, out); }
inline void to_float(const at::BFloat16* x, float* out, int64_t n) {  // bf16 -> fp32: the 16 bits become the high half
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(x[i]);
}

inline void from_float(const float* x, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale;
}
inline void from_float(const float* x, float scale, at::BFloat16* out, int64_t n) {  // round to nearest even
  for (int64_t i = 0; i < n; ++i) out[i] = at::BFloat16(x[i] * scale);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane u: the sum of a[u]'s 8 lanes
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// e^x, 8 at a time (Cephes' expf polynomial, about 1 ulp in fp32), for x <= 0 (scores less their maximum)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(LN2_HI), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(LN2_LO), x);
  __m256 y = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_POLY[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

struct Scratch {
  std::vector<float> q, k, v, scores, packed;
};

// the keys' or values' rows as fp32 [S8, D], S8 = S rounded up to a multiple of 8, the rows past S zero: fp32
// read in place where S is a multiple of 8 (the caller checks the row stride is D), else copied like bf16
template <typename T>
inline const float* as_float(const T* x, int64_t S, int64_t S8, int64_t D, std::vector<float>& buf) {
  if constexpr (std::is_same_v<T, float>)
    if (S == S8) return x;
  buf.assign(S8 * D, 0.f);
  to_float(x, buf.data(), S * D);
  return buf.data();
}

// one (row of the batch, KV head): G queries against S keys; D is a multiple of 8 (checked by the caller).
// A query's result depends only on the keys it sees, not on S or the other queries: every score is one
// block-of-8 reduction (the last block padded with masked keys), the softmax's sum runs over the seen keys
// packed in key order (a seen key's lane is its rank among them, not its slot), and the weighted sum skips
// masked keys in key order. So a token decoded alone (S = its position + 1) and the same token in a verify of
// k (S = the last position + 1, a causal or tree mask, the token at a later sibling's slot) get the same bits.
template <typename T>
void attend(const T* q, const T* k_in, const T* v_in, const bool* mask, int64_t mask_stride_t, int64_t mask_stride_s,
            int64_t tokens, int64_t G, int64_t S, int64_t D, float scale, T* out) {
  thread_local Scratch w;
  const int64_t S8 = (S + 7) / 8 * 8;
  w.q.resize(G * D);
  w.scores.resize(G * S8);
  to_float(q, w.q.data(), G * D);
  for (float& x : w.q) x *= scale;
  const float* k = as_float(k_in, S, S8, D, w.k);
  const float* v = as_float(v_in, S, S8, D, w.v);
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  // scores 8 keys at a time: a block of keys (8 rows of k) stays in L1 across the G queries, and one
  // reduction gives the 8 scores (one horizontal sum per key took twice as long)
  for (int64_t s0 = 0; s0 < S8; s0 += 8)
    for (int64_t j = 0; j < G; ++j) {
      const float* qj = w.q.data() + j * D;
      __m256 acc[8];
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qj + d);
        for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + (s0 + u) * D + d), acc[u]);
      }
      _mm256_storeu_ps(w.scores.data() + j * S8 + s0, hsum8(acc));
    }
  for (int64_t j = 0; j < G; ++j)
    for (int64_t s = S; s < S8; ++s) w.scores[j * S8 + s] = NEG;  // the padding keys
  if (mask != nullptr)
    for (int64_t j = 0; j < G; ++j)
      for (int64_t s = 0; s < S; ++s)
        if (!mask[(j % tokens) * mask_stride_t + s * mask_stride_s]) w.scores[j * S8 + s] = NEG;
  const __m256 neg = _mm256_set1_ps(NEG), zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < G; ++j) {
    float* sc = w.scores.data() + j * S8;
    const float top = *std::max_element(sc, sc + S8);
    float total = 0.f;
    if (top == NEG) {
      std::fill(sc, sc + S8, 0.f);
    } else {
      const __m256 t = _mm256_set1_ps(top);
      w.packed.resize(S8 + 8);
      float* packed = w.packed.data();
      int64_t seen = 0;
      for (int64_t s = 0; s < S8; s += 8) {
        const __m256 x = _mm256_loadu_ps(sc + s);
        const __m256 hidden = _mm256_cmp_ps(x, neg, _CMP_EQ_OQ);
        const __m256 e = _mm256_blendv_ps(exp8(_mm256_sub_ps(x, t)), zero, hidden);
        _mm256_storeu_ps(sc + s, e);
        const int keep = ~_mm256_movemask_ps(hidden) & 0xFF;
        if (keep == 0xFF) {  // every key of the block seen (all of them but a verify's tree and the last block)
          _mm256_storeu_ps(packed + seen, e);
          seen += 8;
        } else {
          for (int u = 0; u < 8; ++u)
            if (keep >> u & 1) packed[seen++] = sc[s + u];
        }
      }
      std::fill(packed + seen, packed + (seen + 7) / 8 * 8, 0.f);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t s = 0; s < seen; s += 8) sum = _mm256_add_ps(sum, _mm256_loadu_ps(packed + s));
      total = hsum(sum);
    }
    // the weighted sum of values, up to 64 outputs a pass held in registers
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nc = std::min<int64_t>(64, D - d0) / 8;
      __m256 acc[8];
      for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t s = 0; s < S; ++s) {
        if (sc[s] == 0.f) continue;  // masked (another row's slots, padding)
        const __m256 p = _mm256_set1_ps(sc[s]);
        const float* vs = v + s * D + d0;
        for (int64_t c = 0; c < nc; ++c) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vs + 8 * c), acc[c]);
      }
      float row[64];
      for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(row + 8 * c, acc[c]);
      from_float(row, total > 0.f ? 1.f / total : 0.f, out + j * D + d0, 8 * nc);
    }
  }
}

at::Tensor small_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                           const c10::optional<at::Tensor>& mask_in, int64_t tokens) {
  const auto st = q_in.scalar_type();
  const Args a = check_args("small_attention", q_in, k, v, mask_in, tokens,
                            st == k.scalar_type() && st == v.scalar_type() && (st == at::kFloat || st == at::kBFloat16),
                            "float32 or all bfloat16", 8);
  const int64_t B = a.B, KV = a.KV, G = a.G, D = a.D, S = a.S, mb = a.mb, mt = a.mt, ms = a.ms;
  const at::Tensor& q = a.q;
  const bool* mask = a.mask;
  const float scale = a.scale;
  at::Tensor out = at::empty({B, KV, G, D}, q.options());
  // threads only where the work pays for waking them: about 2^17 multiply-adds a task
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, 2 * G * S * D));
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, B * KV, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / KV, h = i % KV;
        attend(q.data_ptr<T>() + i * G * D, k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1),
               v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1), mask == nullptr ? nullptr : mask + b * mb,
               mt, ms, tokens, G, S, D, scale, out.data_ptr<T>() + i * G * D);
      }
    });
  };
  if (q.scalar_type() == at::kFloat)
    run(float{});
  else
    run(at::BFloat16{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("small_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, int tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) { m.impl("small_attention", &small_attention); }
