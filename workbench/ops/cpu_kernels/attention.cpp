// workbench::cpu_cached_attention -- the CPU kernel of the paged cached attention
// (schema and semantics: workbench/ops/attention/torch_cached_attention.py; kernel: attention_kernel.h).
//
// Decode-only steps (num_prefill == 0, every sequence one new token) with float32 q/k/v and caches
// run here: the new k/v are written to their slot, then attention_kernel.h's decode_attention reads
// the cache. Anything else (prefill rows, other dtypes) is handed to the reference op through the
// dispatcher, so this op is a drop-in backend for every step.
//
// Why a kernel: the reference's decode path is one SDPA call plus the Python around it, ~200 us a
// layer on a 2-core CPU for SmolLM2 -- more than the layer's matrix products at 4 bits.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include "attention_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& seq_lens, const at::Tensor& input_pos,
                     const at::Tensor& page_table, int64_t num_prefill, double scale,
                     std::optional<int64_t> sliding_window, std::optional<double> logit_cap,
                     const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& alibi_slopes,
                     std::optional<int64_t> chunk_size) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("workbench::torch_cached_attention", "");
  torch::jit::Stack stack;
  stack.reserve(15);
  for (const at::Tensor* t : {&q, &k, &v, &k_cache, &v_cache, &seq_lens, &input_pos, &page_table}) stack.emplace_back(*t);
  stack.emplace_back(num_prefill);
  stack.emplace_back(scale);
  stack.emplace_back(sliding_window.has_value() ? c10::IValue(*sliding_window) : c10::IValue());
  stack.emplace_back(logit_cap.has_value() ? c10::IValue(*logit_cap) : c10::IValue());
  stack.emplace_back(sinks.has_value() ? c10::IValue(*sinks) : c10::IValue());
  stack.emplace_back(alibi_slopes.has_value() ? c10::IValue(*alibi_slopes) : c10::IValue());
  stack.emplace_back(chunk_size.has_value() ? c10::IValue(*chunk_size) : c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor cpu_cached_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                                at::Tensor& v_cache, const at::Tensor& seq_lens, const at::Tensor& input_pos,
                                const at::Tensor& page_table, int64_t num_prefill, double scale,
                                std::optional<int64_t> sliding_window, std::optional<double> logit_cap,
                                const std::optional<at::Tensor>& sinks,
                                const std::optional<at::Tensor>& alibi_slopes, std::optional<int64_t> chunk_size) {
  const bool f32 = q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                   k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat &&
                   (!sinks.has_value() || sinks->scalar_type() == at::kFloat) &&
                   (!alibi_slopes.has_value() || alibi_slopes->scalar_type() == at::kFloat);
  const bool layout = q.dim() == 4 && q.size(0) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                      k_cache.dim() == 4 && page_table.scalar_type() == at::kInt && input_pos.scalar_type() == at::kInt &&
                      seq_lens.scalar_type() == at::kInt;
  const int64_t B = seq_lens.numel();
  if (num_prefill != 0 || !f32 || !layout || q.size(1) != B) {
    return reference(q, k, v, k_cache, v_cache, seq_lens, input_pos, page_table, num_prefill, scale, sliding_window,
                     logit_cap, sinks, alibi_slopes, chunk_size);
  }
  const int64_t Hq = q.size(2), D = q.size(3), Hkv = k.size(2), Dv = v.size(3);
  const int64_t page_size = k_cache.size(1), max_pages = page_table.size(1);
  TORCH_CHECK(Hq % Hkv == 0, Hq, " query heads is not a multiple of ", Hkv, " KV heads");
  TORCH_CHECK(!chunk_size.has_value() || *chunk_size >= 1, "chunk_size must be >= 1, got ", chunk_size.value_or(0));
  TORCH_CHECK(!alibi_slopes.has_value() || alibi_slopes->numel() == Hq, "alibi_slopes must hold one slope per query head (",
              Hq, "), got ", alibi_slopes.has_value() ? alibi_slopes->numel() : 0);
  TORCH_CHECK(k_cache.size(2) == Hkv && k_cache.size(3) == D && v_cache.size(3) == Dv,
              "cache pages do not hold this layer's k/v");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* pos = input_pos.data_ptr<int32_t>();
  const auto pt = page_table.contiguous();
  const int32_t* pages = pt.data_ptr<int32_t>();
  const int64_t num_pages = std::min(k_cache.size(0), v_cache.size(0));
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] == 1, "num_prefill=0: every sequence must have one new token, sequence ", b, " has ", lens[b]);
    TORCH_CHECK(pos[b] >= 0 && pos[b] / page_size < max_pages, "sequence ", b, " at position ", pos[b],
                " needs more pages than page_table has (", max_pages, ")");
    // every page this step reads or writes must lie in the pool (the K/V copy below writes through it)
    for (int64_t p = 0; p <= pos[b] / page_size; ++p) {
      const int32_t page = pages[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < num_pages, "sequence ", b, " reads page ", page,
                  " of a cache of ", num_pages, " pages");
    }
  }
  float* kcache = k_cache.data_ptr<float>();
  float* vcache = v_cache.data_ptr<float>();
  const int64_t page_stride = page_size * Hkv * D, vpage_stride = page_size * Hkv * Dv;
  auto slot_k = [&](int64_t b, int64_t p, int64_t g) {
    return kcache + pages[b * max_pages + p / page_size] * page_stride + (p % page_size) * Hkv * D + g * D;
  };
  auto slot_v = [&](int64_t b, int64_t p, int64_t g) {
    return vcache + pages[b * max_pages + p / page_size] * vpage_stride + (p % page_size) * Hkv * Dv + g * Dv;
  };
  const float* kn = kc.data_ptr<float>();
  const float* vn = vc.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      std::copy(kn + (b * Hkv + g) * D, kn + (b * Hkv + g + 1) * D, slot_k(b, pos[b], g));
      std::copy(vn + (b * Hkv + g) * Dv, vn + (b * Hkv + g + 1) * Dv, slot_v(b, pos[b], g));
    }

  at::Tensor out = at::empty({1, B, Hq, Dv}, q.options());
  // ALiBi: slopes[h] * (key position - query position) joins query head h's logits
  const at::Tensor slopes_c = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  const at::Tensor sinks_c = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  wb::DecodeAttention a{qc.data_ptr<float>(), kcache, vcache, pages, pos, B, Hq, Hkv, D, Dv, page_size, max_pages,
                        static_cast<float>(scale)};
  a.window = sliding_window.has_value() ? *sliding_window : -1;
  a.cap = logit_cap.has_value() ? static_cast<float>(*logit_cap) : 0.f;
  a.sinks = sinks.has_value() ? sinks_c.data_ptr<float>() : nullptr;
  a.slopes = alibi_slopes.has_value() ? slopes_c.data_ptr<float>() : nullptr;
  a.chunk = chunk_size.has_value() ? *chunk_size : -1;
  wb::decode_attention(a, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_cached_attention", &cpu_cached_attention);
}
