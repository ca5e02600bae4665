// Linear layers with reduced weights on AVX2 + FMA, activations in int16 per block of 32 (below):
// specdecode::q4_linear for 4-bit weights in GGUF's Q4 block order, specdecode::i8_linear for int8
// weights with one scale per output row.
//
// Weights: qs [N, K/2] uint8, per block of 32 inputs 16 bytes whose low nibbles are inputs 0-15 and
// high nibbles inputs 16-31 (GGUF's Q4_0/Q4_1 order); w = (q - 8) * scales[n, g] + zeros[n, g] ([N, K/32], both
// float32 or both bfloat16: the layer's own dtype).
// Activations: each row's block of 32 is quantized to int16 with its own scale (max |x| / 32767) and
// the products summed exactly in int32 (_mm256_madd_epi16); the block's sum of x (fp32) carries the
// mins. The int16 step is 2^-15 of the block's largest value, below bf16's own rounding (2^-9 of each
// value) for every value within a factor of 64 of that largest.
//
// Why: aten's _weight_int4pack_mm_for_cpu on an AVX2-only EPYC (2 threads) ran 13-14 G weights/s at one
// row; this runs 27 (SmolLM2-135M's layers: 8.8 ms per decode step against 5.8). Loaded by
// specdecode.runtime.native; the kernel plan (core.kernels) measures it against the others per row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

// One call's activations, quantized per block of 32. The buffers are reused by the calling thread and
// keep their largest size: a 4096-row prefill through a 1536-wide layer leaves ~14 MB per thread.
struct Acts {
  std::vector<int16_t> q;  // [M, K]
  std::vector<float> scale, sum;  // [M, G]
};

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {  // bf16 -> fp32: the 16 bits become the high half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

// sum over g of (zeros[g] - 8 scales[g]) * b[g], 8 at a time: the mins' share of a row (w = q * scale + zero -
// 8 scale, the min formed here in fp32 from the layer's own scales and zeros, which stream in the model's
// dtype: bf16 scales and zeros are 0.125 bytes a weight where fp32 scales and mins were 0.25)
template <typename S>
inline float dot_mins(const S* scales, const S* zeros, const float* b, int64_t n) {
  const __m256 eight = _mm256_set1_ps(8.f);
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= n; g += 8)
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(eight, load8(scales + g), load8(zeros + g)), _mm256_loadu_ps(b + g), acc);
  float rest = 0.f;
  for (; g < n; ++g) rest += std::fma(-8.f, to_f(scales[g]), to_f(zeros[g])) * b[g];
  return hsum(acc) + rest;
}

template <typename T>
const Acts& quantize(const T* x, int64_t M, int64_t K) {
  thread_local Acts a;
  const int64_t G = K / 32;
  a.q.resize(M * K);
  a.scale.resize(M * G);
  a.sum.resize(M * G);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t i = 0; i < M * G; ++i) {
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = load8(x + i * 32 + j * 8);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));  // a nan may be dropped here: counted below
      sm = _mm256_add_ps(sm, v[j]);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[j], v[j], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = _mm_cvtss_f32(m4);
    // below ~1e-34, 32767 / top overflows: such a block is first scaled by 2^64 (exact), so it is
    // quantized like any other instead of turning to garbage
    float t = top;
    if (top > 0.f && !std::isfinite(32767.f / top)) {
      for (int j = 0; j < 4; ++j) v[j] = _mm256_mul_ps(v[j], _mm256_set1_ps(0x1p64f));
      t = top * 0x1p64f;
    }
    const __m256 inv = _mm256_set1_ps(t > 0.f ? 32767.f / t : 0.f);
    // round to nearest (the default MXCSR mode), pack to int16; packs works per 128-bit lane: reorder
    const __m256i q01 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[0], inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v[1], inv)));
    const __m256i q23 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2], inv)),
                                           _mm256_cvtps_epi32(_mm256_mul_ps(v[3], inv)));
    int16_t* out = a.q.data() + i * 32;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(q01, 0xD8));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), _mm256_permute4x64_epi64(q23, 0xD8));
    a.sum[i] = hsum(sm);
    // a non-finite value (inf, nan) makes the block's products nan, as in any kernel; finite values
    // whose sum overflows do not (that sum only carries q4's mins, where an overflow is the true result)
    const bool non_finite = std::isinf(top) || _mm256_movemask_ps(nan) != 0;
    a.scale[i] = non_finite ? std::numeric_limits<float>::quiet_NaN() : top / 32767.f;
  }
  return a;
}

// Group g of MB activation rows from m: inputs 0-15 and 16-31 as int16, and the group's scale
template <int MB>
inline void load_acts(const Acts& a, int64_t m, int64_t K, int64_t g, __m256i (&x0)[MB], __m256i (&x1)[MB],
                      __m256 (&xs)[MB]) {
  const int64_t G = K / 32;
  for (int i = 0; i < MB; ++i) {
    const int16_t* xr = a.q.data() + (m + i) * K + g * 32;
    x0[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
    x1[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16));
    xs[i] = _mm256_broadcast_ss(a.scale.data() + (m + i) * G + g);
  }
}

// MB activation rows against NB weight rows starting at row n; y [M, N] fp32
template <int MB, int NB, typename S>
inline void tile(const uint8_t* qs, const S* scales, const S* zeros, int64_t K, const Acts& a, int64_t m,
                 float* y, int64_t N, int64_t n) {
  const int64_t G = K / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i x0[MB], x1[MB];
    __m256 xs[MB];
    load_acts<MB>(a, m, K, g, x0, x1, xs);
    for (int r = 0; r < NB; ++r) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + (n + r) * (K / 2) + g * 16));
      const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, low4));
      const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), low4));
      const __m256 s = _mm256_set1_ps(to_f(scales[(n + r) * G + g]));
      for (int i = 0; i < MB; ++i) {
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(lo, x0[i]), _mm256_madd_epi16(hi, x1[i]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(s, xs[i]), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) {
      const float* xsum = a.sum.data() + (m + i) * G;
      y[(m + i) * N + n + r] = hsum(acc[i][r]) + dot_mins(scales + (n + r) * G, zeros + (n + r) * G, xsum, G);
    }
}

template <int NB, typename S>
inline void rows(const uint8_t* qs, const S* scales, const S* zeros, int64_t K, const Acts& a, int64_t M,
                 float* y, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile<2, NB>(qs, scales, zeros, K, a, m, y, N, n);
  for (; m < M; ++m) tile<1, NB>(qs, scales, zeros, K, a, m, y, N, n);
}

template <typename S>
void q4_run(const uint8_t* qp, const S* sp, const S* zp, int64_t K, const Acts& a, int64_t M, float* yp,
            int64_t N) {
  constexpr int NB = 4;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows<NB>(qp, sp, zp, K, a, M, yp, N, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows<1>(qp, sp, zp, K, a, M, yp, N, n);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& zeros) {
  TORCH_CHECK(x.dim() == 2, "q4_linear: x must be [rows, in], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "q4_linear: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(K % 32 == 0, "q4_linear: the input width must be a multiple of 32, got ", K);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2 && qs.is_contiguous(),
              "q4_linear: qs must be contiguous uint8 [out, ", K / 2, "], got ", qs.sizes());
  const int64_t N = qs.size(0);
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == scales.scalar_type() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G && t->is_contiguous(),
                "q4_linear: scales and zeros must be contiguous [", N, ", ", G,
                "], both float32 or both bfloat16, got ", t->sizes(), " ", t->scalar_type());
  const at::Tensor xc = x.contiguous();
  const Acts& a = xc.scalar_type() == at::kFloat ? quantize(xc.data_ptr<float>(), M, K)
                                                 : quantize(xc.data_ptr<at::BFloat16>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  if (scales.scalar_type() == at::kFloat)
    q4_run(qp, scales.data_ptr<float>(), zeros.data_ptr<float>(), K, a, M, yp, N);
  else
    q4_run(qp, scales.data_ptr<at::BFloat16>(), zeros.data_ptr<at::BFloat16>(), K, a, M, yp, N);
  return xc.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// int8 weights [N, K] with scales [N]: MB activation rows against NB weight rows starting at row n. Its
// own copy of tile: one template shared by both formats (weights behind a small struct) measured 1.2x
// slower on the 4-bit layers (9.8 against 7.9 ms a step, same process).
template <int MB, int NB, typename S>
inline void tile8(const int8_t* w, const S* scales, int64_t K, const Acts& a, int64_t m, float* y, int64_t N,
                  int64_t n) {
  const int64_t G = K / 32;
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256i x0[MB], x1[MB];
    __m256 xs[MB];
    load_acts<MB>(a, m, K, g, x0, x1, xs);
    for (int r = 0; r < NB; ++r) {
      const int8_t* wr = w + (n + r) * K + g * 32;
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 16)));
      for (int i = 0; i < MB; ++i) {
        const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0[i]), _mm256_madd_epi16(w1, x1[i]));
        acc[i][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), xs[i], acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) y[(m + i) * N + n + r] = hsum(acc[i][r]) * static_cast<float>(scales[n + r]);
}

template <int NB, typename S>
inline void rows8(const int8_t* w, const S* scales, int64_t K, const Acts& a, int64_t M, float* y, int64_t N,
                  int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) tile8<2, NB>(w, scales, K, a, m, y, N, n);
  for (; m < M; ++m) tile8<1, NB>(w, scales, K, a, m, y, N, n);
}

template <typename S>
void i8_run(const int8_t* w, const S* scales, int64_t K, const Acts& a, int64_t M, float* y, int64_t N) {
  constexpr int NB = 4;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows8<NB>(w, scales, K, a, M, y, N, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) rows8<1>(w, scales, K, a, M, y, N, n);
}

at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2, "i8_linear: x must be [rows, in], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "i8_linear: x must be bfloat16 or float32, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "i8_linear: the input width must be a multiple of 32, got ", K);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
              "i8_linear: w must be contiguous int8 [out, ", K, "], got ", w.sizes());
  const int64_t N = w.size(0);
  TORCH_CHECK((scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat) && scales.dim() == 1 &&
                  scales.size(0) == N && scales.is_contiguous(),
              "i8_linear: scales must be contiguous bfloat16 or float32 [", N, "], got ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  const Acts& a = xc.scalar_type() == at::kFloat ? quantize(xc.data_ptr<float>(), M, K)
                                                  : quantize(xc.data_ptr<at::BFloat16>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (scales.scalar_type() == at::kFloat)
    i8_run(w.data_ptr<int8_t>(), scales.data_ptr<float>(), K, a, M, y.data_ptr<float>(), N);
  else
    i8_run(w.data_ptr<int8_t>(), scales.data_ptr<at::BFloat16>(), K, a, M, y.data_ptr<float>(), N);
  return xc.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(specdecode, m) {
  m.def("q4_linear(Tensor x, Tensor qs, Tensor scales, Tensor zeros) -> Tensor");
  m.def("i8_linear(Tensor x, Tensor w, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("q4_linear", &q4_linear);
  m.impl("i8_linear", &i8_linear);
}
