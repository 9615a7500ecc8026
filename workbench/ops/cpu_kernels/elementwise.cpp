// The ops of the small per-token ops of a decode step (kernels: elementwise_kernel.h): RMSNorm, RoPE
// with explicit cos/sin, SiLU*mul. Each is one pass over its rows in float32 (the reference ops take ~50-80 us a call in
// Python; these take a few). Inputs the kernels do not cover (other dtypes, odd shapes) are handed
// to the reference op through the dispatcher, so each op is a drop-in backend for every input.
// Semantics: workbench/ops/normalization/torch_norms.py, rope/torch_rope.py, mlp/torch_silu_mul.py.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "elementwise_kernel.h"

namespace {

template <class Sig>
c10::TypedOperatorHandle<Sig> reference(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

bool f32(const at::Tensor& t) { return t.scalar_type() == at::kFloat; }

at::Tensor cpu_rmsnorm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  const int64_t h = input.size(-1);
  if (!f32(input) || !f32(weight) || weight.numel() != h || h % 16 != 0) {
    static auto op = reference<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("workbench::torch_rmsnorm");
    return op.call(input, weight, eps);
  }
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  wb::parallel_for(0, x.numel() / h, 64, [&](int64_t r0, int64_t r1) {
    wb::rmsnorm_rows(xp, wp, op, h, static_cast<float>(eps), r0, r1);
  });
  return out;
}

at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t unsqueeze_dim) {
  // x [b, n, s, d] (unsqueeze_dim 1) or [b, s, n, d] (2); cos/sin [b, s, d] (b may be 1: broadcast).
  // x is read through its strides (q/k are usually slices of one fused QKV output: copying them
  // contiguous first cost a copy per call); only the head dim must be dense. The result is contiguous.
  const at::Tensor xc = x.stride(3) == 1 ? x : x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options());
  const int64_t B = xc.size(0), d = xc.size(3);
  const int64_t S = unsqueeze_dim == 1 ? xc.size(2) : xc.size(1), N = unsqueeze_dim == 1 ? xc.size(1) : xc.size(2);
  const int64_t sb = xc.stride(0), ss = xc.stride(unsqueeze_dim == 1 ? 2 : 1), sn = xc.stride(unsqueeze_dim == 1 ? 1 : 2);
  const int64_t cb = cc.size(0) == 1 ? 0 : S * d;
  const float* xp = xc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < S; ++t)
      for (int64_t n = 0; n < N; ++n) {
        const int64_t off = unsqueeze_dim == 1 ? ((b * N + n) * S + t) * d : ((b * S + t) * N + n) * d;
        wb::rotate(xp + b * sb + t * ss + n * sn, cp + b * cb + t * d, sp + b * cb + t * d, op + off, d);
      }
  return out;
}

std::tuple<at::Tensor, at::Tensor> cpu_rope_with_explicit_cos_sin(const at::Tensor& q, const at::Tensor& k,
                                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                                  int64_t unsqueeze_dim) {
  const bool ok = f32(q) && f32(k) && f32(cos) && f32(sin) && q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 &&
                  sin.sizes() == cos.sizes() && (unsqueeze_dim == 1 || unsqueeze_dim == 2) &&
                  cos.size(-1) == q.size(-1) && q.size(-1) == k.size(-1) && q.size(-1) % 2 == 0 &&
                  (cos.size(0) == q.size(0) || cos.size(0) == 1) && cos.size(1) == q.size(unsqueeze_dim == 1 ? 2 : 1) &&
                  q.size(0) == k.size(0) && q.size(unsqueeze_dim == 1 ? 2 : 1) == k.size(unsqueeze_dim == 1 ? 2 : 1);
  if (!ok) {
    static auto op = reference<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                  const at::Tensor&, const at::Tensor&, int64_t)>(
        "workbench::torch_rope_with_explicit_cos_sin");
    return op.call(q, k, cos, sin, unsqueeze_dim);
  }
  return {rope_one(q, cos, sin, unsqueeze_dim), rope_one(k, cos, sin, unsqueeze_dim)};
}

at::Tensor cpu_silu_and_mul(const at::Tensor& input) {
  const int64_t two = input.size(-1), inner = two / 2;
  if (!f32(input) || two % 32 != 0) {
    static auto op = reference<at::Tensor(const at::Tensor&)>("workbench::torch_silu_and_mul");
    return op.call(input);
  }
  const at::Tensor x = input.contiguous();
  auto shape = x.sizes().vec();
  shape.back() = inner;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t rows = x.numel() / two;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  wb::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { wb::silu_and_mul_rows(xp, op, inner, r0, r1); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_rmsnorm", &cpu_rmsnorm);
  m.impl("cpu_rope_with_explicit_cos_sin", &cpu_rope_with_explicit_cos_sin);
  m.impl("cpu_silu_and_mul", &cpu_silu_and_mul);
}
