// cpu_int4_linear_a8: int4 weights x activations rounded to int8 per block of 32 (kernel:
// linear_a8_kernel.h). Inputs with more than kRows rows (prefill) are not quantized: they take
// cpu_int4_linear's exact path, so a prompt is read exactly as the fp32 model would.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>

#include "linear_a8_kernel.h"

namespace {

constexpr int64_t kRows = 16;  // decode-shaped inputs handled here (as cpu_int4_linear's kernel)

at::Tensor cpu_int4_linear_a8(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "cpu_int4_linear_a8 takes float32 activations, got ", x.scalar_type());
  const int64_t K = x.size(-1), rows = x.numel() / std::max<int64_t>(1, K);
  if (rows > kRows) {  // prefill: the exact int4 kernel, through the dispatcher
    static auto exact = c10::Dispatcher::singleton().findSchemaOrThrow("workbench::cpu_int4_linear", "")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const at::Tensor&, int64_t, const std::optional<at::Tensor>&)>();
    return exact.call(x, qweight, scales, offsets, group_size, bias);
  }
  const int64_t N = qweight.size(0);
  TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.size(1) * 2 == K &&
              qweight.is_contiguous(), "int4 qweight must be contiguous uint8 [N, K/2]");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "group_size must be a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.is_contiguous() &&
              offsets.is_contiguous() && scales.dim() == 2 && offsets.sizes() == scales.sizes() &&
              scales.size(0) == N && scales.size(1) == K / group_size,
              "int4 scales/offsets must be contiguous float16 [N, K/group] = [", N, ", ", K / group_size, "], got ",
              scales.sizes());
  const at::Tensor x2 = x.reshape({rows, K}).contiguous();
  at::Tensor y = at::empty({rows, N}, x2.options());
  wb::linear_a8_rows(qweight.data_ptr<uint8_t>(), reinterpret_cast<const wb::fp16*>(scales.data_ptr<at::Half>()),
                     reinterpret_cast<const wb::fp16*>(offsets.data_ptr<at::Half>()), x2.data_ptr<float>(),
                     y.data_ptr<float>(), rows, K, N, group_size);
  if (bias.has_value()) y.add_(*bias);
  auto s = x.sizes().vec();
  s.back() = N;
  return y.view(s);
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_int4_linear_a8", &cpu_int4_linear_a8);
}
