// AVX-512 (F, BW, VL, VNNI) forms of avx2_linear.cpp's two kernels, built as a module of their own, loaded
// only on a CPU with those instructions: specdecode::q4_linear_avx512 (4-bit weights in GGUF's Q4 block
// order) and specdecode::i8_linear_avx512 (int8 weights, one scale per output row). Same arguments, same
// activations (int16 per block of 32 at 2^-15 of the block's largest value, round to nearest), same exact
// int32 sums; only the order of the fp32 sums differs, and the output is written in the input's dtype
// (no separate conversion op).
//
// What changes: VNNI's vpdpwssd sums 32 int16 products a call into 16 int32 lanes; a 4-bit weight is
// widened with one vpmovzxbw over 32 bytes (two blocks: low nibbles are inputs 0-15, high nibbles 16-31),
// so the activations are stored pair by pair in that order ("pair layout" below) and the lanes of one
// product stay those of one block (lanes 0-7 the first, 8-15 the second) until their scales are applied.
//
// Why: on a 2-core Zen4 EPYC (AVX-512 + VNNI, 2 threads; ad hoc, one process) SmolLM2-135M's 4-bit layers
// at one row took 2.9 ms a decode step against 3.9 for aten's _weight_int4pack_mm_for_cpu and 4.0 for
// q4_avx2 with the weights hot in cache; streamed from memory (all 120 layers) ours and int4pack both took
// 5-6 ms, the kernel's arithmetic (about 10 vector instructions per 64 weights, Zen4 runs 512-bit ones in
// two halves) still the bound: summing the same bytes took 2.7 ms. The int8 lm_head (49152 x 576) took
// 1.6-2.1 ms against 3.7 for _weight_int8pack_mm and 2.5-3.1 for i8_avx2. At 2+ rows aten's kernels
// won in that measurement; the kernel plan measures every candidate per shape and row count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// bytes ahead in the weight stream: the int8 lm_head (49152 x 576, 2 threads) took 1.6-1.9 ms a call with
// 1-4 KiB against 2.7 without (ad hoc, one process each)
constexpr int64_t PREFETCH = 2048;

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {  // bf16 -> fp32: the 16 bits become the high half
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// the first n < 16 values (the rest zero)
inline __m512 load16_first(const float* x, __mmask16 k) { return _mm512_maskz_loadu_ps(k, x); }
inline __m512 load16_first(const at::BFloat16* x, __mmask16 k) {
  const __m256i h = _mm256_maskz_loadu_epi16(k, x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

inline void store(float* y, float v) { *y = v; }
inline void store(at::BFloat16* y, float v) { *y = at::BFloat16(v); }  // round to nearest even

// sum over g of (zeros[g] - 8 scales[g]) * b[g], 16 at a time: the mins' share of a row (w = q * scale + zero
// - 8 scale; the min is formed here, in fp32, from the layer's own scales and zeros, so the weights stream
// in the model's dtype: bf16 scales and zeros are 0.125 bytes a weight where fp32 scales and mins were 0.25)
template <typename S>
inline float dot_mins(const S* scales, const S* zeros, const float* b, int64_t n) {
  const __m512 eight = _mm512_set1_ps(8.f);
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= n; g += 16)
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, load16(scales + g), load16(zeros + g)), _mm512_loadu_ps(b + g), acc);
  if (g < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - g)) - 1);
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(eight, load16_first(scales + g, k), load16_first(zeros + g, k)),
                          _mm512_maskz_loadu_ps(k, b + g), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// One call's activations, quantized per block of 32. Pair layout (the 4-bit kernel): per pair of blocks
// 64 int16, inputs 0-15 of both blocks then inputs 16-31 of both, an odd last block paired with zeros;
// natural layout (the int8 kernel): the inputs in order. Reused by the calling thread.
struct Acts {
  int64_t width = 0;  // int16 values per row
  std::vector<int16_t> q;  // [M, width]
  std::vector<float> scale;  // [M, blocks]: the block's step (max |x| / 32767)
  std::vector<float> pair_scale;  // pair layout: [M, pairs * 16], each pair's two steps, 8 lanes each
  std::vector<float> sum;  // [M, blocks]: the block's sum of x (carries q4's mins)
};

template <typename T, bool PAIRS>
const Acts& quantize(const T* x, int64_t M, int64_t K) {
  thread_local Acts a;
  const int64_t G = K / 32, P = (G + 1) / 2;
  a.width = PAIRS ? P * 64 : K;
  a.q.assign(M * a.width, 0);
  a.scale.resize(M * G);
  a.sum.resize(M * G);
  if (PAIRS) a.pair_scale.assign(M * P * 16, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = m * G + g;
      __m512 v0 = load16(x + i * 32), v1 = load16(x + i * 32 + 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      a.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      // below ~1e-34, 32767 / top overflows: such a block is first scaled by 2^64 (exact)
      float t = top;
      if (top > 0.f && !std::isfinite(32767.f / top)) {
        v0 = _mm512_mul_ps(v0, _mm512_set1_ps(0x1p64f));
        v1 = _mm512_mul_ps(v1, _mm512_set1_ps(0x1p64f));
        t = top * 0x1p64f;
      }
      const __m512 inv = _mm512_set1_ps(t > 0.f ? 32767.f / t : 0.f);
      const __m256i q0 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)));
      const __m256i q1 = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)));
      int16_t* row = a.q.data() + m * a.width;
      int16_t* lo = PAIRS ? row + (g / 2) * 64 + (g % 2) * 16 : row + g * 32;
      int16_t* hi = PAIRS ? lo + 32 : lo + 16;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), q0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), q1);
      // a non-finite value makes the block's products nan, as in any kernel
      const float step = (std::isinf(top) || nan) ? std::numeric_limits<float>::quiet_NaN() : top / 32767.f;
      a.scale[i] = step;
      if (PAIRS) std::fill_n(a.pair_scale.data() + m * P * 16 + (g / 2) * 16 + (g % 2) * 8, 8, step);
    }
  return a;
}

// MB activation rows from m against NB 4-bit weight rows from n
template <int MB, int NB, typename S, typename Y>
inline void tile4(const uint8_t* qs, const S* scales, const S* zeros, int64_t K, const Acts& a, int64_t m,
                  Y* y, int64_t N, int64_t n) {
  const int64_t G = K / 32, P = (G + 1) / 2;
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const bool full = 2 * p + 1 < G;
    for (int r = 0; r < NB; ++r) {
      const uint8_t* wr = qs + (n + r) * (K / 2) + p * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wr) + PREFETCH, _MM_HINT_T0);
      const __m256i bytes = full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr))
                                 : _mm256_maskz_loadu_epi8(0xFFFFu, wr);  // the odd last block: 16 bytes
      const __m512i v = _mm512_cvtepu8_epi16(bytes);
      const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_srli_epi16(v, 4);
      const S* sr = scales + (n + r) * G + 2 * p;
      const __m512 sw = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(to_f(sr[0])), _mm512_set1_ps(to_f(full ? sr[1] : sr[0])));
      for (int i = 0; i < MB; ++i) {
        const int16_t* xr = a.q.data() + (m + i) * a.width + p * 64;
        __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
        d = _mm512_dpwssd_epi32(d, hi, _mm512_loadu_si512(xr + 32));
        const __m512 xs = _mm512_loadu_ps(a.pair_scale.data() + ((m + i) * P + p) * 16);
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, xs), acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r)
      store(y + (m + i) * N + n + r,
            _mm512_reduce_add_ps(acc[i][r]) +
                dot_mins(scales + (n + r) * G, zeros + (n + r) * G, a.sum.data() + (m + i) * G, G));
}

// MB activation rows from m against NB int8 weight rows from n
template <int MB, int NB, typename S, typename Y>
inline void tile8(const int8_t* w, const S* scales, int64_t K, const Acts& a, int64_t m, Y* y, int64_t N,
                  int64_t n) {
  const int64_t G = K / 32;
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 xs[MB];
    for (int i = 0; i < MB; ++i) xs[i] = _mm512_set1_ps(a.scale[(m + i) * G + g]);
    for (int r = 0; r < NB; ++r) {
      const int8_t* wr = w + (n + r) * K + g * 32;
      _mm_prefetch(reinterpret_cast<const char*>(wr) + PREFETCH, _MM_HINT_T0);
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr)));
      for (int i = 0; i < MB; ++i) {
        const __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv,
                                              _mm512_loadu_si512(a.q.data() + (m + i) * a.width + g * 32));
        acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), xs[i], acc[i][r]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NB; ++r)
      store(y + (m + i) * N + n + r, _mm512_reduce_add_ps(acc[i][r]) * static_cast<float>(scales[n + r]));
}

// every activation row against weight rows [n, n + NB): 4 activation rows a tile, then 2, then 1
template <int NB, typename Tile>
inline void rows(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
  for (; m + 2 <= M; m += 2) tile(std::integral_constant<int, 2>{}, m);
  for (; m < M; ++m) tile(std::integral_constant<int, 1>{}, m);
}

// output rows in tiles of 4 over the threads, the rest one by one
template <typename Run>
inline void over_rows(int64_t N, Run&& run) {
  constexpr int NB = 4;
  const int64_t blocks = N / NB;
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) run(std::integral_constant<int, NB>{}, b * NB);
  });
  for (int64_t n = blocks * NB; n < N; ++n) run(std::integral_constant<int, 1>{}, n);
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 32 == 0, op, ": the input width must be a multiple of 32, got ", x.size(1));
}

void check_scales(const at::Tensor& scales, const at::Tensor& zeros, int64_t N, int64_t G, const char* op) {
  for (const at::Tensor* t : {&scales, &zeros})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == scales.scalar_type() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G && t->is_contiguous(),
                op, ": scales and zeros must be contiguous [", N, ", ", G,
                "], both float32 or both bfloat16, got ", t->sizes(), " ", t->scalar_type());
}

// f(pointer to y's data) with y's dtype, float32 or bfloat16 (as x: checked)
template <typename F>
void in_dtype(at::Tensor& y, F&& f) {
  if (y.scalar_type() == at::kFloat)
    f(y.data_ptr<float>());
  else
    f(y.data_ptr<at::BFloat16>());
}

template <bool PAIRS>
const Acts& quantized(const at::Tensor& xc) {
  const int64_t M = xc.size(0), K = xc.size(1);
  return xc.scalar_type() == at::kFloat ? quantize<float, PAIRS>(xc.data_ptr<float>(), M, K)
                                        : quantize<at::BFloat16, PAIRS>(xc.data_ptr<at::BFloat16>(), M, K);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& zeros) {
  check_x(x, "q4_linear_avx512");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2 && qs.is_contiguous(),
              "q4_linear_avx512: qs must be contiguous uint8 [out, ", K / 2, "], got ", qs.sizes());
  const int64_t N = qs.size(0);
  check_scales(scales, zeros, N, G, "q4_linear_avx512");
  const at::Tensor xc = x.contiguous();
  const Acts& a = quantized<true>(xc);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  in_dtype(y, [&](auto* yp) {
    auto run = [&](const auto* sp, const auto* zp) {
      over_rows(N, [&](auto nb, int64_t n) {
        rows<nb.value>(M, [&](auto mb, int64_t m) { tile4<mb.value, nb.value>(qp, sp, zp, K, a, m, yp, N, n); });
      });
    };
    if (scales.scalar_type() == at::kFloat)
      run(scales.data_ptr<float>(), zeros.data_ptr<float>());
    else
      run(scales.data_ptr<at::BFloat16>(), zeros.data_ptr<at::BFloat16>());
  });
  return y;
}

at::Tensor i8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
  check_x(x, "i8_linear_avx512");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
              "i8_linear_avx512: w must be contiguous int8 [out, ", K, "], got ", w.sizes());
  const int64_t N = w.size(0);
  TORCH_CHECK((scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat) && scales.dim() == 1 &&
                  scales.size(0) == N && scales.is_contiguous(),
              "i8_linear_avx512: scales must be contiguous bfloat16 or float32 [", N, "], got ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  const Acts& a = quantized<false>(xc);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  in_dtype(y, [&](auto* yp) {
    auto run = [&](const auto* sp) {
      over_rows(N, [&](auto nb, int64_t n) {
        rows<nb.value>(M, [&](auto mb, int64_t m) { tile8<mb.value, nb.value>(wp, sp, K, a, m, yp, N, n); });
      });
    };
    if (scales.scalar_type() == at::kFloat)
      run(scales.data_ptr<float>());
    else
      run(scales.data_ptr<at::BFloat16>());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("q4_linear_avx512(Tensor x, Tensor qs, Tensor scales, Tensor zeros) -> Tensor");
  m.def("i8_linear_avx512(Tensor x, Tensor w, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("q4_linear_avx512", &q4_linear);
  m.impl("i8_linear_avx512", &i8_linear);
}
