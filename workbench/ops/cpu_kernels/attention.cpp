// workbench::cpu_cached_attention -- the CPU kernel of the paged cached attention
// (schema and semantics: workbench/ops/attention/torch_cached_attention.py).
//
// Decode-only steps (num_prefill == 0, every sequence one new token) with float32 q/k/v and caches
// run here: the new k/v are written to their slot, then for each sequence and KV head the scores
// of all query heads sharing it (GQA) are computed reading each key once, a vectorised softmax
// (fp32, polynomial exp) turns them into probabilities, and each value is read once. Sliding window, logit soft-capping,
// per-head sinks and ALiBi slopes are honoured, and so is chunked local attention (chunk_size: only the keys of the
// query's own chunk of positions). Anything else (prefill rows, other dtypes) is handed to the
// reference op through the dispatcher, so this op is a drop-in backend for every step.
//
// Why a kernel: the reference's decode path is one SDPA call plus the Python around it, ~200 us a
// layer on a 2-core CPU for SmolLM2 -- more than the layer's matrix products at 4 bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <immintrin.h>

#include "vec_math.h"

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

inline float dot(const float* a, const float* b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float s = _mm512_reduce_add_ps(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// out += p * v  (length d)
inline void axpy(float* out, float p, const float* v, int64_t d) {
  const __m512 vp = _mm512_set1_ps(p);
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(out + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(v + i), _mm512_loadu_ps(out + i)));
  for (; i < d; ++i) out[i] += p * v[i];
}

// lane i = the sum of a[i]'s 16 lanes: one transpose-add tree (unpack pairs, then 64-bit pairs,
// then 128-bit blocks) of 45 shuffles and adds for 16 dot products, instead of a horizontal sum each.
WB_INLINE __m512 sum16(const __m512* a) {
  __m512 l1[8], l2[4];
  for (int i = 0; i < 8; ++i)
    l1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 128-bit lane L of l2[i]: keys 4i..4i+3, summed over lane L of the inputs
    const __m512d x = _mm512_castps_pd(l1[2 * i]), y = _mm512_castps_pd(l1[2 * i + 1]);
    l2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[0], l2[1], 0x44), _mm512_shuffle_f32x4(l2[0], l2[1], 0xEE));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(l2[2], l2[3], 0x44), _mm512_shuffle_f32x4(l2[2], l2[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}

// scores[r, j] = (q_r . k_j) * scale for the rep query heads sharing one KV head, head dim 16 * DZ;
// keys[j] points at key j. Sixteen keys at a time, their dot products summed together by sum16.
//
// In a decode step the keys and values come from DRAM (the layer's weights streamed through the
// caches since this layer last ran), one 64-byte line per 16 floats at scattered page slots. The
// first query head's pass therefore prefetches the next block of keys and this block's values
// (read by head_values right after), so the loads overlap instead of waiting one by one.
template <int DZ>
void head_scores(const float* q, int64_t rep, int64_t L, const float* const* keys, const float* const* values,
                 float* scores, float scale) {
  constexpr int64_t D = 16 * DZ;
  const __m512 vs = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < rep; ++r) {
    __m512 qv[DZ];
    for (int z = 0; z < DZ; ++z) qv[z] = _mm512_loadu_ps(q + r * D + 16 * z);
    float* sr = scores + r * L;
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
      if (r == 0) {
        const int64_t ahead = std::min<int64_t>(16, L - j - 16);
        for (int64_t i = 0; i < ahead; ++i)
          for (int z = 0; z < DZ; ++z) _mm_prefetch(reinterpret_cast<const char*>(keys[j + 16 + i] + 16 * z), _MM_HINT_T0);
        for (int i = 0; i < 16; ++i)
          for (int z = 0; z < DZ; ++z) _mm_prefetch(reinterpret_cast<const char*>(values[j + i] + 16 * z), _MM_HINT_T1);
      }
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        const float* kp = keys[j + i];
        acc[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kp));
        for (int z = 1; z < DZ; ++z) acc[i] = _mm512_fmadd_ps(qv[z], _mm512_loadu_ps(kp + 16 * z), acc[i]);
      }
      _mm512_storeu_ps(sr + j, _mm512_mul_ps(sum16(acc), vs));
    }
    for (; j < L; ++j) sr[j] = dot(q + r * D, keys[j], D) * scale;
  }
}

// out[r] = inv[r] * sum_j probs[r, j] v_j for RC query heads at once: their RC * DZ accumulators
// stay in registers and each value is loaded once for all of them.
template <int DZ, int RC>
void head_values(const float* probs, const float* inv, int64_t L, const float* const* values, float* out) {
  constexpr int64_t D = 16 * DZ;
  __m512 acc[RC][DZ];
  for (int r = 0; r < RC; ++r)
    for (int z = 0; z < DZ; ++z) acc[r][z] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m512 v[DZ];
    for (int z = 0; z < DZ; ++z) v[z] = _mm512_loadu_ps(values[j] + 16 * z);
    for (int r = 0; r < RC; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * L + j]);
      for (int z = 0; z < DZ; ++z) acc[r][z] = _mm512_fmadd_ps(p, v[z], acc[r][z]);
    }
  }
  for (int r = 0; r < RC; ++r)
    for (int z = 0; z < DZ; ++z) _mm512_storeu_ps(out + r * D + 16 * z, _mm512_mul_ps(acc[r][z], _mm512_set1_ps(inv[r])));
}

template <int DZ>
void all_head_values(const float* probs, const float* inv, int64_t rep, int64_t L, const float* const* values,
                     float* out) {
  constexpr int64_t D = 16 * DZ, kMaxRC = 24 / DZ;  // accumulators in 24 of the 32 registers
  for (int64_t r0 = 0; r0 < rep; r0 += kMaxRC) {
    const float* p = probs + r0 * L;
    float* o = out + r0 * D;
    switch (std::min(kMaxRC, rep - r0)) {
      case 1: head_values<DZ, 1>(p, inv + r0, L, values, o); break;
      case 2: head_values<DZ, 2>(p, inv + r0, L, values, o); break;
      case 3: head_values<DZ, 3>(p, inv + r0, L, values, o); break;
      case 4: if constexpr (kMaxRC >= 4) head_values<DZ, 4>(p, inv + r0, L, values, o); break;
      case 5: if constexpr (kMaxRC >= 5) head_values<DZ, 5>(p, inv + r0, L, values, o); break;
      default: if constexpr (kMaxRC >= 6) head_values<DZ, 6>(p, inv + r0, L, values, o); break;
    }
  }
}

// Below this many multiply-adds a decode step runs as one task: forking costs more than it saves.
constexpr int64_t kMinParallelWork = 100000;
// A key chunk shared out to a thread holds at least this many keys; at most kMaxChunks per pair.
constexpr int64_t kMinChunkKeys = 32, kMaxChunks = 64;

// probs[0:n] = exp(scores - max) in place; returns their sum
inline float softmax_numerators(float* s, int64_t n, float max) {
  const __m512 vm = _mm512_set1_ps(max);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
    _mm512_storeu_ps(s + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm));
    _mm512_mask_storeu_ps(s + i, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
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
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] == 1, "num_prefill=0: every sequence must have one new token, sequence ", b, " has ", lens[b]);
    TORCH_CHECK(pos[b] >= 0 && pos[b] / page_size < max_pages, "sequence ", b, " at position ", pos[b],
                " needs more pages than page_table has (", max_pages, ")");
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
  float* o = out.data_ptr<float>();
  const float* qp = qc.data_ptr<float>();
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  // ALiBi: slopes[h] * (key position - query position) joins query head h's logits
  const at::Tensor slopes_c = alibi_slopes.has_value() ? alibi_slopes->contiguous() : at::Tensor();
  const float* slope = alibi_slopes.has_value() ? slopes_c.data_ptr<float>() : nullptr;
  const int64_t rep = Hq / Hkv;
  const float fscale = static_cast<float>(scale);
  const float cap = logit_cap.has_value() ? static_cast<float>(*logit_cap) : 0.f;
  // Work items: (sequence, KV head, key chunk). A decode step of one sequence has only Hkv
  // (sequence, head) pairs -- 3 for SmolLM2 -- and its keys and values come from DRAM (the weights
  // streamed since the last layer evicted them), so the keys of each pair are also split into
  // chunks the threads share (flash-decoding): each chunk leaves its own max, sum of exponentials
  // and unnormalised output, merged below. Small steps stay one task (a fork costs more).
  int64_t work = 0, max_len = 0;
  for (int64_t b = 0; b < B; ++b) work += (pos[b] + 1) * Hq * (D + Dv), max_len = std::max<int64_t>(max_len, pos[b] + 1);
  const int64_t threads = at::get_num_threads();
  const int64_t pairs = B * Hkv;
  int64_t chunks = 1;
  if (work >= kMinParallelWork && threads > 1 && pairs < 2 * threads)
    chunks = std::clamp<int64_t>(std::min<int64_t>((2 * threads + pairs - 1) / pairs, max_len / kMinChunkKeys), 1,
                                 kMaxChunks);
  const int64_t tasks = pairs * chunks;
  const int64_t grain = work < kMinParallelWork ? tasks : 1;
  // per task: rep unnormalised outputs [rep, Dv], and per query head its max and sum of exponentials
  std::vector<float> part_o(chunks > 1 ? tasks * rep * Dv : 0), part_m(tasks * rep), part_l(tasks * rep);
  // head dims with a vectorised path (sixteen keys per step, values into register accumulators)
  const int DZ = (D == Dv && (D == 64 || D == 128)) ? static_cast<int>(D / 16) : 0;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    // inv[r]: what the values' sum is scaled by -- 1 / the softmax denominator for one chunk; 1 for
    // several, whose unnormalised partials are merged below
    std::vector<float> scores, inv(rep);
    std::vector<const float*> keys, values;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pair = t / chunks, c = t % chunks, b = pair / Hkv, g = pair % Hkv, last = pos[b];
      int64_t first_key = sliding_window.has_value() ? std::max<int64_t>(0, last - *sliding_window + 1) : 0;
      // chunked local attention: only the keys of the query's own chunk of positions
      if (chunk_size.has_value()) first_key = std::max<int64_t>(first_key, last / *chunk_size * *chunk_size);
      const int64_t n = last - first_key + 1;
      // this chunk's keys: [first, first + L)
      const int64_t first = first_key + n * c / chunks, L = first_key + n * (c + 1) / chunks - first;
      float* ob = chunks > 1 ? part_o.data() + t * rep * Dv : o + (b * Hq + g * rep) * Dv;
      float* mb = part_m.data() + t * rep;
      float* lb = part_l.data() + t * rep;
      if (L == 0) {  // more chunks than keys (a sequence much shorter than the longest)
        std::fill(mb, mb + rep, -std::numeric_limits<float>::infinity());
        std::fill(lb, lb + rep, 0.f);
        std::fill(ob, ob + rep * Dv, 0.f);
        continue;
      }
      const float* qb = qp + (b * Hq + g * rep) * D;
      scores.resize(rep * L);
      // where each key/value of the chunk lives (pages walked once, no division per key)
      keys.resize(L);
      values.resize(L);
      for (int64_t j = 0, page = first / page_size, slot = first % page_size; j < L; ++j, ++slot) {
        if (slot == page_size) slot = 0, ++page;
        const int64_t phys = pages[b * max_pages + page];
        keys[j] = kcache + phys * page_stride + slot * Hkv * D + g * D;
        values[j] = vcache + phys * vpage_stride + slot * Hkv * Dv + g * Dv;
      }
      if (DZ == 4) {
        head_scores<4>(qb, rep, L, keys.data(), values.data(), scores.data(), fscale);
      } else if (DZ == 8) {
        head_scores<8>(qb, rep, L, keys.data(), values.data(), scores.data(), fscale);
      } else {  // scores[r, j]: each key is read once for the `rep` query heads that share it
        for (int64_t j = 0; j < L; ++j)
          for (int64_t r = 0; r < rep; ++r) scores[r * L + j] = dot(qb + r * D, keys[j], D) * fscale;
      }
      if (cap > 0.f)
        for (float& s : scores) s = cap * std::tanh(s / cap);
      if (slope != nullptr)
        for (int64_t r = 0; r < rep; ++r) {
          const float sl = slope[g * rep + r];
          float* sr = scores.data() + r * L;
          for (int64_t j = 0; j < L; ++j) sr[j] += sl * static_cast<float>(first + j - last);
        }
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * L;
        float m = sr[0];
        for (int64_t j = 1; j < L; ++j) m = std::max(m, sr[j]);
        if (sink != nullptr && chunks == 1) m = std::max(m, sink[g * rep + r]);
        float denom = softmax_numerators(sr, L, m);
        if (sink != nullptr && chunks == 1) denom += std::exp(sink[g * rep + r] - m);  // joins the normaliser only
        mb[r] = m, lb[r] = denom;
        inv[r] = chunks == 1 ? 1.f / denom : 1.f;
      }
      if (DZ == 4) {
        all_head_values<4>(scores.data(), inv.data(), rep, L, values.data(), ob);
      } else if (DZ == 8) {
        all_head_values<8>(scores.data(), inv.data(), rep, L, values.data(), ob);
      } else {
        for (int64_t r = 0; r < rep; ++r) std::fill(ob + r * Dv, ob + (r + 1) * Dv, 0.f);
        for (int64_t j = 0; j < L; ++j)  // each value read once
          for (int64_t r = 0; r < rep; ++r) axpy(ob + r * Dv, scores[r * L + j] * inv[r], values[j], Dv);
      }
    }
  });
  if (chunks > 1) {
    // out = sum_c e^(m_c - M) o_c / (sum_c e^(m_c - M) l_c [+ e^(sink - M)]),  M = max(m_c [, sink])
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t b = pair / Hkv, g = pair % Hkv;
      for (int64_t r = 0; r < rep; ++r) {
        float M = sink != nullptr ? sink[g * rep + r] : -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) M = std::max(M, part_m[(pair * chunks + c) * rep + r]);
        float denom = sink != nullptr ? std::exp(sink[g * rep + r] - M) : 0.f;
        float w[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t t = pair * chunks + c;
          w[c] = part_l[t * rep + r] > 0.f ? std::exp(part_m[t * rep + r] - M) : 0.f;
          denom += w[c] * part_l[t * rep + r];
        }
        float* dst = o + (b * Hq + g * rep + r) * Dv;
        std::fill(dst, dst + Dv, 0.f);
        for (int64_t c = 0; c < chunks; ++c)
          if (w[c] > 0.f) axpy(dst, w[c] / denom, part_o.data() + ((pair * chunks + c) * rep + r) * Dv, Dv);
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(workbench, CPU, m) {
  m.impl("cpu_cached_attention", &cpu_cached_attention);
}
