// The ops of the decode-shaped linears (kernels: linear_kernel.h): cpu_int4_linear, cpu_int8_linear,
// cpu_linear. Schemas are declared in Python (workbench/ops/cpu_kernels/__init__.py); this file checks
// the arguments, picks the register-tile kernel or the BLAS path by the number of rows, and registers
// the implementations.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <string>

#include "linear_kernel.h"

namespace {

const wb::fp16* half_ptr(const at::Tensor& t) { return reinterpret_cast<const wb::fp16*>(t.data_ptr<at::Half>()); }

at::Tensor flat(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "workbench CPU kernels take float32 activations, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) % 32 == 0, "in_features must be a multiple of 32, got ", x.size(-1));
  return x.reshape({-1, x.size(-1)}).contiguous();
}

at::Tensor finish(at::Tensor y, const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias) {
  if (bias.has_value()) y.add_(*bias);
  auto s = x.sizes().vec();
  s.back() = N;
  return y.view(s);
}

template <class W>
at::Tensor launch(const W& wt, const at::Tensor& x2, int64_t N) {
  at::Tensor y = at::empty({x2.size(0), N}, x2.options());
  wb::linear_rows(wt, x2.data_ptr<float>(), y.data_ptr<float>(), x2.size(0), x2.size(1), N);
  return y;
}

// Prefill-sized inputs (many rows of x): the weights are decoded 256 rows at a time into a float
// tile and multiplied by BLAS, which beats re-walking the packed rows once per 8 rows of x -- for
// fp32 weights above 16 rows, for the packed formats only above 96: decoding int4/int8 into a tile
// and the per-tile GEMM calls cost more than re-decoding per 8 rows until then (int4 1536x576,
// single thread, AVX-512: 32 rows 676 us dense vs ~400 us by tiles; 128 rows 1559 vs ~1590).
constexpr int64_t kKernelRows = 16;
constexpr int64_t kQuantKernelRows = 96;

template <class W>
at::Tensor dense(const W& wt, const at::Tensor& x2, int64_t N) {
  at::Tensor y = at::empty({x2.size(0), N}, x2.options());
  at::Tensor tile_w = at::empty({std::min<int64_t>(256, N), x2.size(1)}, x2.options());
  for (int64_t n0 = 0; n0 < N; n0 += 256) {
    const int64_t rows = std::min<int64_t>(256, N - n0);
    wb::decode_rows(wt, n0, rows, tile_w.data_ptr<float>());
    y.narrow(1, n0, rows).copy_(at::mm(x2, tile_w.narrow(0, 0, rows).t()));
  }
  return y;
}

template <class W>
at::Tensor linear(const W& wt, const at::Tensor& x2, int64_t N) {
  return x2.size(0) > kQuantKernelRows ? dense(wt, x2, N) : launch(wt, x2, N);
}

at::Tensor cpu_int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& offsets, int64_t group_size, const std::optional<at::Tensor>& bias) {
  const at::Tensor x2 = flat(x);
  const int64_t K = x2.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == K && qweight.is_contiguous(),
              "int4 qweight must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.is_contiguous() &&
              offsets.is_contiguous(), "int4 scales/offsets must be contiguous float16 [N, K/group]");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.dim() == 2 && offsets.sizes() == scales.sizes() && scales.size(0) == N &&
              scales.size(1) == K / group_size, "int4 scales/offsets must be [N, K/group] = [", N, ", ",
              K / group_size, "], got ", scales.sizes());
  wb::Q4 wt{qweight.data_ptr<uint8_t>(), half_ptr(scales), half_ptr(offsets), K, K / group_size, group_size};
  return finish(linear(wt, x2, N), x, N, bias);
}

at::Tensor cpu_int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                           int64_t group_size, const std::optional<at::Tensor>& bias) {
  const at::Tensor x2 = flat(x);
  const int64_t K = x2.size(1), N = qweight.size(0);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.size(1) == K && qweight.is_contiguous(),
              "int8 qweight must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "int8 scales must be contiguous float16");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group_size,
              "int8 scales must be [N, K/group] = [", N, ", ", K / group_size, "], got ", scales.sizes());
  wb::Q8 wt{qweight.data_ptr<int8_t>(), half_ptr(scales), K, K / group_size, group_size};
  return finish(linear(wt, x2, N), x, N, bias);
}

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool ok = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
                  x.size(-1) % 32 == 0;
  if (!ok || x.numel() / x.size(-1) > kKernelRows) return at::linear(x, weight, bias);
  const at::Tensor x2 = flat(x);
  const int64_t N = weight.size(0);
  wb::F32 wt{weight.data_ptr<float>(), x2.size(1), 1, x2.size(1)};
  return finish(launch(wt, x2, N), x, N, bias);
}

// The variant this library was built as ("avx2", "avx512_vnni", "neon", ...): the loader checks it
// against the one it asked for, and the summary names it.
std::string cpu_kernels_isa() { return wb::kIsa; }
std::string cpu_kernels_int8_dot() { return wb::kInt8Dot; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench, m) {
  m.def("cpu_kernels_isa() -> str", &cpu_kernels_isa);
  m.def("cpu_kernels_int8_dot() -> str", &cpu_kernels_int8_dot);
}

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_int4_linear", &cpu_int4_linear);
  m.impl("cpu_int8_linear", &cpu_int8_linear);
  m.impl("cpu_linear", &cpu_linear);
}
