// What both few-query attention kernels (small_attention.cpp, attention_avx512.cpp) share: their arguments,
// checked with messages that say what is wrong, and the constants of their e^x polynomial.
#pragma once
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>

namespace specdecode_attention {

// Cephes' expf polynomial (about 1 ulp in fp32): e^x = 2^n * p(r), r = x - n ln 2 (ln 2 in two parts)
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f, EXP_MIN = -87.3f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

struct Args {
  int64_t B, KV, G, D, S;
  at::Tensor q, mask_tensor;  // q contiguous; the mask kept alive
  const bool* mask = nullptr;  // mask [1 or B, tokens, S] (True = attend), or none
  int64_t mb = 0, mt = 0, ms = 0;  // its strides over rows (0: one mask for all), tokens, keys
  float scale;
};

// q [B, KV, G, D]; k, v [B, KV, S, D] cache views (contiguous [S, D] per head); D a multiple of d_multiple;
// G a multiple of tokens; mask bool [1 or B, tokens, S] or None. dtype_ok says whether q, k, v's dtypes are
// taken, dtypes names them.
inline Args check_args(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask_in, int64_t tokens, bool dtype_ok, const char* dtypes,
                       int64_t d_multiple) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": q, k, v must be 4-d [B, KV, rows, D]");
  Args a{q.size(0), q.size(1), q.size(2), q.size(3), k.size(2), {}, {}, nullptr, 0, 0, 0, 0.f};
  TORCH_CHECK(k.size(0) == a.B && k.size(1) == a.KV && k.size(3) == a.D && v.sizes() == k.sizes(), op,
              ": k and v must be [B, KV, S, D] matching q ", q.sizes(), ", got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(dtype_ok, op, ": q, k, v must all be ", dtypes);
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == a.D && v.stride(2) == a.D &&
                  a.D % d_multiple == 0,
              op, ": k and v must be cache views with contiguous [S, D] per head, D a multiple of ", d_multiple);
  TORCH_CHECK(tokens >= 1 && a.G % tokens == 0, op, ": rows (", a.G, ") must be a multiple of tokens (", tokens, ")");
  a.q = q.contiguous();
  if (mask_in.has_value() && mask_in->defined()) {
    const at::Tensor& m = *mask_in;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 3 && (m.size(0) == 1 || m.size(0) == a.B) &&
                    m.size(1) == tokens && m.size(2) == a.S,
                op, ": mask must be bool [1 or ", a.B, ", ", tokens, ", ", a.S, "], got ", m.sizes());
    a.mask_tensor = m;
    a.mask = m.data_ptr<bool>();
    a.mb = m.size(0) == 1 ? 0 : m.stride(0);
    a.mt = m.stride(1);
    a.ms = m.stride(2);
  }
  a.scale = 1.f / std::sqrt(static_cast<float>(a.D));
  return a;
}

}  // namespace specdecode_attention
