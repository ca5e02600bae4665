// specdecode::small_attention_avx512: small_attention's contract (small_attention.cpp: q [B, KV, G, D], the
// KV group's query heads folded into G = group * tokens rows, head-major; k, v [B, KV, S, D] cache views;
// mask [1 or B, tokens, S] bool or None; tokens) for bf16 with AVX-512 BF16, D a multiple of 32.
//
// Why: the AVX2 kernel converts every key and value to fp32 per call and scores one query at a time; at 8
// queries a verify spent ~2.5 ms a step in it (30 layers, 256 keys: benchmarks/results/attention-avx512/).
// Here scores come from vdpbf16ps straight off the bf16 cache (16 keys a block, one fixed reduction tree per
// key), and the weighted sum of values converts each value row once for a tile of queries.
//
// A query's result depends only on the keys it sees, as in the AVX2 kernel: a key's score is the same
// arithmetic in any block and for any key count; the softmax's sum runs over the seen keys packed in key
// order (so a seen key's lane is its rank among them, not its slot), and the weighted sum skips masked and
// padding keys (in key order); queries share loads, never arithmetic. So a token decoded alone and the same
// token in a verify of k get the same bits, wherever the verify put it (a tree's later sibling sits one slot
// further than the token does decoded alone: lanes by slot gave it other bits, issue 52).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "attention_args.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace specdecode_attention;

constexpr int64_t KB = 16;  // keys a block of scores
// query rows a task (scores, softmax, values; verifies spread over threads), each value row converted once
// for all of them: 6 x 64 outputs of sums, the value row and the weight fit the 32 registers
constexpr int64_t TASK_ROWS = 6;

// e^x for x <= 0 (scores less their maximum): the AVX2 kernel's polynomial (attention_args.h) in 16 lanes
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
  const __m512 fx =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(LN2_HI), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(LN2_LO), x);
  __m512 y = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_POLY[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// lane u: the sum of a[u]'s 16 lanes, by one fixed tree (halves, quarters, then within 128-bit lanes)
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
  const __m512 e = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  // lane 4m + t holds a[m], a[8 + m], a[4 + m], a[12 + m] for t = 0..3: back to key order
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, e);
}

inline __m512 bf16x16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

struct Scratch {
  std::vector<float> scores;
  std::vector<float> packed;  // one row's seen weights, packed in key order (the softmax's sum)
  std::vector<at::BFloat16> tail;  // the last block's keys, padded with zeros to KB rows
};

// the weighted sum of values for N rows (weights p [N, S16], row sums totals), NC x 16 outputs at d0, in key
// order over the keys some row sees: each value row is converted once for every row. A key another row sees
// adds an exact zero to a row that does not (its weight is 0 and cached values are finite), so a row's sums do
// not depend on the rows beside it.
template <int N, int NC>
inline void values_at(const float* p, int64_t S16, const at::BFloat16* v, int64_t D, int64_t d0, const float* totals,
                      at::BFloat16* out) {
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[N][NC];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = zero;
  for (int64_t s0 = 0; s0 < S16; s0 += KB) {
    __mmask16 seen = 0;
    for (int i = 0; i < N; ++i) seen |= _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i * S16 + s0), zero, _CMP_NEQ_UQ);
    for (uint32_t bits = seen; bits != 0; bits &= bits - 1) {
      const int64_t s = s0 + __builtin_ctz(bits);
      __m512 vs[NC];
      for (int c = 0; c < NC; ++c) vs[c] = bf16x16(v + s * D + d0 + 16 * c);
      for (int i = 0; i < N; ++i) {
        const __m512 w = _mm512_set1_ps(p[i * S16 + s]);
        for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_fmadd_ps(w, vs[c], acc[i][c]);
      }
    }
  }
  for (int i = 0; i < N; ++i) {
    const __m512 inv = _mm512_set1_ps(totals[i] > 0.f ? 1.f / totals[i] : 0.f);
    for (int c = 0; c < NC; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * D + d0 + 16 * c), (__m256i)h);
    }
  }
}

template <int N>
inline void values_rows(const float* p, int64_t S16, const at::BFloat16* v, int64_t D, const float* totals,
                        at::BFloat16* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) values_at<N, 4>(p, S16, v, D, d0, totals, out);
  if (d0 < D) values_at<N, 2>(p, S16, v, D, d0, totals, out);  // D is a multiple of 32
}

inline void values(const float* p, int64_t S16, const at::BFloat16* v, int64_t D, int64_t n, const float* totals,
                   at::BFloat16* out) {
  static_assert(TASK_ROWS == 6, "one case per row count");
  switch (n) {
    case 1: return values_rows<1>(p, S16, v, D, totals, out);
    case 2: return values_rows<2>(p, S16, v, D, totals, out);
    case 3: return values_rows<3>(p, S16, v, D, totals, out);
    case 4: return values_rows<4>(p, S16, v, D, totals, out);
    case 5: return values_rows<5>(p, S16, v, D, totals, out);
    default: return values_rows<6>(p, S16, v, D, totals, out);
  }
}

// rows [j0, j1) of one (batch row, KV head): scores, softmax and weighted sum of values
void attend(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, const bool* mask, int64_t mt,
            int64_t ms, int64_t tokens, int64_t j0, int64_t j1, int64_t S, int64_t D, float scale, at::BFloat16* out) {
  thread_local Scratch w;
  const int64_t S16 = (S + KB - 1) / KB * KB, n = j1 - j0;
  w.scores.resize(n * S16);
  constexpr float NEG = -std::numeric_limits<float>::infinity();
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t s0 = 0; s0 < S16; s0 += KB) {
    const at::BFloat16* kb = k + s0 * D;
    if (s0 + KB > S) {  // rows past S may not exist: a zero-padded copy
      w.tail.assign(KB * D, at::BFloat16(0.f));
      std::memcpy(w.tail.data(), kb, (S - s0) * D * sizeof(at::BFloat16));
      kb = w.tail.data();
    }
    for (int64_t j = j0; j < j1; ++j) {
      __m512 acc[KB];
      for (int u = 0; u < KB; ++u) acc[u] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 32) {
        const __m512bh qd = (__m512bh)_mm512_loadu_si512(q + j * D + d);
        for (int u = 0; u < KB; ++u)
          acc[u] = _mm512_dpbf16_ps(acc[u], qd, (__m512bh)_mm512_loadu_si512(kb + u * D + d));
      }
      _mm512_storeu_ps(w.scores.data() + (j - j0) * S16 + s0, _mm512_mul_ps(hsum16(acc), vscale));
    }
  }
  float totals[TASK_ROWS];
  const __m512 neg = _mm512_set1_ps(NEG), zero = _mm512_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    float* sc = w.scores.data() + (j - j0) * S16;
    for (int64_t s = S; s < S16; ++s) sc[s] = NEG;  // the padding keys
    if (mask != nullptr)
      for (int64_t s = 0; s < S; ++s)
        if (!mask[(j % tokens) * mt + s * ms]) sc[s] = NEG;
    __m512 top = neg;
    for (int64_t s = 0; s < S16; s += KB) top = _mm512_max_ps(top, _mm512_loadu_ps(sc + s));
    const float t = _mm512_reduce_max_ps(top);
    if (t == NEG) {  // sees no key: zeros (callers never ask)
      std::fill(sc, sc + S16, 0.f);
      totals[j - j0] = 0.f;
      continue;
    }
    const __m512 vt = _mm512_set1_ps(t);
    w.packed.resize(S16 + KB);
    float* packed = w.packed.data();
    int64_t seen = 0;
    for (int64_t s = 0; s < S16; s += KB) {
      const __m512 x = _mm512_loadu_ps(sc + s);
      const __mmask16 hidden = _mm512_cmp_ps_mask(x, neg, _CMP_EQ_OQ);
      const __m512 e = _mm512_mask_blend_ps(hidden, exp16(_mm512_sub_ps(x, vt)), zero);
      _mm512_storeu_ps(sc + s, e);
      _mm512_mask_compressstoreu_ps(packed + seen, static_cast<__mmask16>(~hidden), e);
      seen += __builtin_popcount(static_cast<uint32_t>(static_cast<__mmask16>(~hidden)));
    }
    std::fill(packed + seen, packed + (seen + KB - 1) / KB * KB, 0.f);
    __m512 sum = zero;
    for (int64_t s = 0; s < seen; s += KB) sum = _mm512_add_ps(sum, _mm512_loadu_ps(packed + s));
    totals[j - j0] = _mm512_reduce_add_ps(sum);
  }
  values(w.scores.data(), S16, v, D, n, totals, out + j0 * D);
}

at::Tensor small_attention_avx512(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                  const c10::optional<at::Tensor>& mask_in, int64_t tokens) {
  const auto bf16 = at::kBFloat16;
  const Args a = check_args("small_attention_avx512", q_in, k, v, mask_in, tokens,
                            q_in.scalar_type() == bf16 && k.scalar_type() == bf16 && v.scalar_type() == bf16,
                            "bfloat16 (small_attention takes float32)", 32);
  TORCH_CHECK(a.S >= 1, "small_attention_avx512: at least one key");
  const int64_t B = a.B, KV = a.KV, G = a.G, D = a.D, S = a.S, mb = a.mb, mt = a.mt, ms = a.ms;
  const at::Tensor& q = a.q;
  const bool* mask = a.mask;
  const float scale = a.scale;
  at::Tensor out = at::empty({B, KV, G, D}, q.options());
  const int64_t tiles = (G + TASK_ROWS - 1) / TASK_ROWS;
  // threads only where the work pays for waking them: about 2^17 multiply-adds a task
  const int64_t work = 2 * std::min<int64_t>(G, TASK_ROWS) * S * D;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, work));
  const auto* qp = q.data_ptr<at::BFloat16>();
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vp = v.data_ptr<at::BFloat16>();
  auto* op_ = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, B * KV * tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / tiles, j0 = (t % tiles) * TASK_ROWS, j1 = std::min(G, j0 + TASK_ROWS);
      const int64_t b = i / KV, h = i % KV;
      attend(qp + i * G * D, kp + b * k.stride(0) + h * k.stride(1), vp + b * v.stride(0) + h * v.stride(1),
             mask == nullptr ? nullptr : mask + b * mb, mt, ms, tokens, j0, j1, S, D, scale, op_ + i * G * D);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("small_attention_avx512(Tensor q, Tensor k, Tensor v, Tensor? mask, int tokens) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) { m.impl("small_attention_avx512", &small_attention_avx512); }
