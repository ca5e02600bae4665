// The row-invariant integer family (AVX-512 VNNI): specdecode::q4_rows (4-bit weights, GGUF Q4_0/Q4_1 blocks)
// and specdecode::i8_rows (int8 weights, one scale per output row), for any number of activation rows.
//
// A row's output does not depend on how many rows share the call: activations are quantized row by row
// (per block of 32: int8, step max|x| / 127, or int16, step max|x| / 32767; round to nearest), every
// block's dot product is an exact int32 sum, and the float epilogue (per block: sum x the weight's and the
// activation's steps, plus the block's min x the sum of x) runs over the blocks in one fixed order per
// output. So a token decoded alone, verified among k others, or batched with B rows gets the same bits.
//
// Layout (packed once at load, core/quant.py): output rows in tiles of 16; per (tile, block) 16 rows x 32
// weights, ordered so that lane j of a 512-bit register holds 4 consecutive weights of row j. One vpdpbusd
// then multiplies 4 weights of 16 rows by 4 activation bytes broadcast to every lane (64 multiply-adds),
// and 8 of them sum a block for 16 outputs in 16 int32 lanes: the float work is one convert and two FMAs
// per 512 multiply-adds, and a weight block, unpacked once, serves every row of the call from registers.
//   q4: per (tile, block) 320 bytes: 4 x 64 bytes of nibbles (chunk c, lane j, byte b: the low nibble is
//       weight 8c + b of row j, the high nibble weight 8c + 4 + b), then 16 bf16 scales and 16 bf16 zeros
//       (w = (q - 8) * scale + zero), so one sequential stream per tile.
//   i8: per (tile, block) 512 bytes: 8 x 64 bytes (chunk c, lane j, byte b: weight 4c + b of row j, plus 128
//       as an unsigned byte: vpdpbusd multiplies unsigned by signed bytes); the sum of x's 128 * q is taken
//       back in integers.
// int16 activations run the same weights: x = 256 * hi + lo (hi signed, lo unsigned bytes), two vpdpbusd.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 16;  // output rows a tile
constexpr int64_t Q4_BLOCK_BYTES = 320;  // per (tile, block): 256 bytes of nibbles, 32 bf16 (scales, zeros)
constexpr int64_t I8_BLOCK_BYTES = 512;
constexpr int64_t PREFETCH = 1024;  // bytes ahead in a tile's weight stream
constexpr int MAX_ROWS = 8;  // activation rows a pass over a tile's weights (the rest: another pass, from L1)

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 bf16x16(const uint8_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
inline void store16(at::BFloat16* y, __m512 v) {  // round to nearest even, as at::BFloat16 does (nan stays nan)
  alignas(64) float f[16];
  _mm512_store_ps(f, v);
  for (int i = 0; i < 16; ++i) y[i] = at::BFloat16(f[i]);
}

// One call's activations, quantized row by row. int8: q holds K signed bytes a row. int16: lo holds the
// low bytes (unsigned) and q the high bytes (signed) of each value. Per (row, block): the step, the sum of
// x (q4's mins) and the integer sum of q's bytes (i8's +128 offset is taken back with it).
struct Acts {
  std::vector<int8_t> q;
  std::vector<uint8_t> lo;
  std::vector<float> step, sum;
  std::vector<int32_t> qsum;
};

template <typename T>
const Acts& quantize(const T* x, int64_t M, int64_t K, int bits) {
  thread_local Acts a;
  const int64_t G = K / 32;
  const float top_q = bits == 8 ? 127.f : 32767.f;
  a.q.resize(M * K);
  if (bits == 16) a.lo.resize(M * K);
  a.step.resize(M * G);
  a.sum.resize(M * G);
  a.qsum.resize(M * G);
  for (int64_t i = 0; i < M * G; ++i) {
    __m512 v0 = load16(x + i * 32), v1 = load16(x + i * 32 + 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    a.sum[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
    float t = top;  // below ~1e-34, top_q / top overflows: such a block is first scaled by 2^64 (exact)
    if (top > 0.f && !std::isfinite(top_q / top)) {
      v0 = _mm512_mul_ps(v0, _mm512_set1_ps(0x1p64f));
      v1 = _mm512_mul_ps(v1, _mm512_set1_ps(0x1p64f));
      t = top * 0x1p64f;
    }
    const __m512 inv = _mm512_set1_ps(t > 0.f && std::isfinite(t) ? top_q / t : 0.f);
    __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    int8_t* q = a.q.data() + i * 32;
    if (bits == 8) {  // within +-127 (a product rounded up to 128 is clamped), so -q fits too
      const __m512i lim = _mm512_set1_epi32(127), neg = _mm512_set1_epi32(-127);
      i0 = _mm512_max_epi32(_mm512_min_epi32(i0, lim), neg);
      i1 = _mm512_max_epi32(_mm512_min_epi32(i1, lim), neg);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(i1));
      a.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    } else {
      // saturated to int16, then split: hi = v >> 8 (arithmetic), lo = v & 255
      const __m512i s0 = _mm512_cvtepi16_epi32(_mm512_cvtsepi32_epi16(i0));
      const __m512i s1 = _mm512_cvtepi16_epi32(_mm512_cvtsepi32_epi16(i1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_srai_epi32(s0, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(s1, 8)));
      uint8_t* lo = a.lo.data() + i * 32;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(s0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16), _mm512_cvtepi32_epi8(s1));
      a.qsum[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_srai_epi32(s0, 8), _mm512_srai_epi32(s1, 8)));
    }
    // a non-finite value makes the block's products nan, as in any kernel
    a.step[i] = (std::isinf(top) || nan) ? std::numeric_limits<float>::quiet_NaN() : top / top_q;
  }
  return a;
}

inline __m512i bcast4(const void* p) {  // 4 bytes to every lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// the exact int32 sums of one block for 16 outputs: w[c] (c = 0..7) holds weights 4c..4c+3 of the 16 rows as
// unsigned bytes (SIGNED_W: those bytes less 128 are the weights, and ws[c] the weights as signed bytes)
template <int BITS, bool SIGNED_W>
inline __m512i block_dot(const __m512i* w, const __m512i* ws, const Acts& a, int64_t off, int64_t blk) {
  const int8_t* q = a.q.data() + off;
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // two chains; integer sums are exact
  for (int c = 0; c < 8; c += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[c], bcast4(q + 4 * c));
    s1 = _mm512_dpbusd_epi32(s1, w[c + 1], bcast4(q + 4 * c + 4));
  }
  __m512i s = _mm512_add_epi32(s0, s1);
  if (SIGNED_W) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.qsum[blk]));
  if (BITS == 16) {  // + the low bytes: unsigned activations times signed weights
    const uint8_t* lo = a.lo.data() + off;
    __m512i l0 = _mm512_setzero_si512(), l1 = _mm512_setzero_si512();
    for (int c = 0; c < 8; c += 2) {
      l0 = _mm512_dpbusd_epi32(l0, bcast4(lo + 4 * c), SIGNED_W ? ws[c] : w[c]);
      l1 = _mm512_dpbusd_epi32(l1, bcast4(lo + 4 * c + 4), SIGNED_W ? ws[c + 1] : w[c + 1]);
    }
    s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), _mm512_add_epi32(l0, l1));
  }
  return s;
}

// rows [m, m + MB) of x against one tile of 16 outputs (weight stream p), y[:, n0 : n0 + 16]
template <int BITS, int MB, typename Y>
inline void q4_tile(const uint8_t* p, int64_t G, const Acts& a, int64_t K, int64_t m, Y* y, int64_t N, int64_t n0) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, p += Q4_BLOCK_BYTES) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 192, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 256, _MM_HINT_T0);
    __m512i w[8];
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(p + 64 * c);
      w[2 * c] = _mm512_and_si512(v, low4);
      w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    const __m512 scale = bf16x16(p + 256), mins = _mm512_fnmadd_ps(eight, scale, bf16x16(p + 288));
    for (int i = 0; i < MB; ++i) {
      const int64_t blk = (m + i) * G + g;
      const __m512i s = block_dot<BITS, false>(w, w, a, (m + i) * K + g * 32, blk);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(scale, _mm512_set1_ps(a.step[blk])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a.sum[blk]), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) store16(y + (m + i) * N + n0, acc[i]);
}

template <int BITS, int MB, typename S, typename Y>
inline void i8_tile(const uint8_t* p, const S* scales, int64_t G, const Acts& a, int64_t K, int64_t m, Y* y, int64_t N,
                    int64_t n0) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, p += I8_BLOCK_BYTES) {
    for (int c = 0; c < 8; ++c) _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 64 * c, _MM_HINT_T0);
    __m512i w[8], ws[8];
    for (int c = 0; c < 8; ++c) {
      w[c] = _mm512_loadu_si512(p + 64 * c);
      if (BITS == 16) ws[c] = _mm512_xor_si512(w[c], flip);
    }
    for (int i = 0; i < MB; ++i) {
      const int64_t blk = (m + i) * G + g;
      const __m512i s = block_dot<BITS, true>(w, ws, a, (m + i) * K + g * 32, blk);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a.step[blk]), acc[i]);
    }
  }
  const __m512 sc = load16(scales + n0);
  for (int i = 0; i < MB; ++i) store16(y + (m + i) * N + n0, _mm512_mul_ps(acc[i], sc));
}

// every activation row against one tile: passes of MAX_ROWS rows, then 4, 2, 1 (each row's arithmetic is the
// same in any pass)
template <typename Tile>
inline void over_rows(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + MAX_ROWS <= M; m += MAX_ROWS) tile(std::integral_constant<int, MAX_ROWS>{}, m);
  if (m + 4 <= M) { tile(std::integral_constant<int, 4>{}, m); m += 4; }
  if (m + 2 <= M) { tile(std::integral_constant<int, 2>{}, m); m += 2; }
  if (m < M) tile(std::integral_constant<int, 1>{}, m);
}

void check_x(const at::Tensor& x, int64_t bits, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [rows, in], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % 32 == 0, op, ": the input width must be a multiple of 32, got ", x.size(1));
  TORCH_CHECK(bits == 8 || bits == 16, op, ": activation bits must be 8 or 16, got ", bits);
}

template <typename F>
void in_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat)
    f(t.data_ptr<float>());
  else
    f(t.data_ptr<at::BFloat16>());
}

const Acts& quantized(const at::Tensor& xc, int bits) {
  const Acts* a = nullptr;
  in_dtype(xc, [&](const auto* xp) { a = &quantize(xp, xc.size(0), xc.size(1), bits); });
  return *a;
}

template <typename Body>
void with_bits(int64_t bits, Body&& body) {
  if (bits == 8)
    body(std::integral_constant<int, 8>{});
  else
    body(std::integral_constant<int, 16>{});
}

at::Tensor q4_rows(const at::Tensor& x, const at::Tensor& packed, int64_t bits) {
  check_x(x, bits, "q4_rows");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) % TILE == 0 &&
                  packed.size(1) == G * Q4_BLOCK_BYTES / TILE && packed.is_contiguous(),
              "q4_rows: packed must be contiguous uint8 [out (a multiple of 16), ", G * Q4_BLOCK_BYTES / TILE,
              "] (core.quant.pack_q4_rows), got ", packed.sizes());
  const int64_t N = packed.size(0);
  const at::Tensor xc = x.contiguous();
  const Acts& a = quantized(xc, static_cast<int>(bits));
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  in_dtype(y, [&](auto* yp) {
    with_bits(bits, [&](auto b) {
      at::parallel_for(0, N / TILE, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          over_rows(M, [&](auto mb, int64_t m) {
            q4_tile<b.value, mb.value>(pp + t * G * Q4_BLOCK_BYTES, G, a, K, m, yp, N, t * TILE);
          });
      });
    });
  });
  return y;
}

at::Tensor i8_rows(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits) {
  check_x(x, bits, "i8_rows");
  const int64_t M = x.size(0), K = x.size(1), G = K / 32;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.size(0) % TILE == 0 &&
                  packed.size(1) == K && packed.is_contiguous(),
              "i8_rows: packed must be contiguous uint8 [out (a multiple of 16), ", K,
              "] (core.quant.pack_i8_rows), got ", packed.sizes());
  const int64_t N = packed.size(0);
  TORCH_CHECK((scales.scalar_type() == at::kBFloat16 || scales.scalar_type() == at::kFloat) && scales.dim() == 1 &&
                  scales.size(0) == N && scales.is_contiguous(),
              "i8_rows: scales must be contiguous bfloat16 or float32 [", N, "], got ", scales.sizes());
  const at::Tensor xc = x.contiguous();
  const Acts& a = quantized(xc, static_cast<int>(bits));
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  in_dtype(y, [&](auto* yp) {
    in_dtype(scales, [&](const auto* sp) {
      with_bits(bits, [&](auto b) {
        at::parallel_for(0, N / TILE, 1, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t)
            over_rows(M, [&](auto mb, int64_t m) {
              i8_tile<b.value, mb.value>(pp + t * G * I8_BLOCK_BYTES, sp, G, a, K, m, yp, N, t * TILE);
            });
        });
      });
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdecode, m) {
  m.def("q4_rows(Tensor x, Tensor packed, int bits) -> Tensor");
  m.def("i8_rows(Tensor x, Tensor packed, Tensor scales, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdecode, CPU, m) {
  m.impl("q4_rows", &q4_rows);
  m.impl("i8_rows", &i8_rows);
}
