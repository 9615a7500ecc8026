// Decode steps of the paged cached attention, fp32 (torch-free core; the op, its checks and the
// reference fallback are in attention.cpp).
//
// For each sequence and KV head the scores of all query heads sharing it (GQA) are computed reading
// each key once, a vectorised softmax (fp32, polynomial exp) turns them into probabilities, and each
// value is read once. Sliding window, logit soft-capping, per-head sinks, ALiBi slopes and chunked
// local attention (chunk_size: only the keys of the query's own chunk of positions) are honoured.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace wb {

// One decode step: B sequences of one new token each, at positions pos[b] (keys 0..pos[b] valid,
// the new one already written). Caches: pages [P, page_size, Hkv, D] (values: Dv); page table
// [B, max_pages] of page numbers.
struct DecodeAttention {
  const float* q;  // [B, Hq, D]
  const float* k_cache;
  const float* v_cache;
  const int32_t* pages;
  const int32_t* pos;
  int64_t B, Hq, Hkv, D, Dv, page_size, max_pages;
  float scale;
  int64_t window = -1;          // sliding window (keys), -1: none
  float cap = 0.f;              // logit soft-cap, 0: none
  const float* sinks = nullptr;   // [Hq] or null
  const float* slopes = nullptr;  // ALiBi [Hq] or null
  int64_t chunk = -1;           // chunked local attention, -1: none
};

// scores[r, j] = (q_r . k_j) * scale for the rep query heads sharing one KV head, head dim D (a
// multiple of kLanes); keys[j] points at key j. kLanes keys at a time, their dot products summed
// together by vtranspose_sum.
//
// In a decode step the keys and values come from DRAM (the layer's weights streamed through the
// caches since this layer last ran), one 64-byte line per 16 floats at scattered page slots. The
// first query head's pass therefore prefetches the next keys and this step's values (read by
// head_values right after), so the loads overlap instead of waiting one by one.
template <int D>
void head_scores(const float* q, int64_t rep, int64_t L, const float* const* keys, const float* const* values,
                 float* scores, float scale) {
  constexpr int NZ = D / kL;
  const Vec vs = vset1(scale);
  for (int64_t r = 0; r < rep; ++r) {
    Vec qv[NZ];
    for (int z = 0; z < NZ; ++z) qv[z] = vload(q + r * D + kL * z);
    float* sr = scores + r * L;
    int64_t j = 0;
    for (; j + kL <= L; j += kL) {
      if (r == 0) {
        const int64_t ahead = std::min<int64_t>(kL, L - j - kL);
        for (int64_t i = 0; i < ahead; ++i)
          for (int z = 0; z < D; z += 16) prefetch_t0(keys[j + kL + i] + z);
        for (int i = 0; i < kL; ++i)
          for (int z = 0; z < D; z += 16) prefetch_t1(values[j + i] + z);
      }
      Vec acc[kL];
      for (int i = 0; i < kL; ++i) {
        const float* kp = keys[j + i];
        acc[i] = qv[0] * vload(kp);
        for (int z = 1; z < NZ; ++z) acc[i] = vfma(qv[z], vload(kp + kL * z), acc[i]);
      }
      vstore(sr + j, vtranspose_sum(acc) * vs);
    }
    for (; j < L; ++j) sr[j] = dot(q + r * D, keys[j], D) * scale;
  }
}

// out[r] = inv[r] * sum_j probs[r, j] v_j for RC query heads at once: their RC * NZ accumulators
// stay in registers and each value is loaded once for all of them.
template <int D, int RC>
void head_values(const float* probs, const float* inv, int64_t L, const float* const* values, float* out) {
  constexpr int NZ = D / kL;
  Vec acc[RC][NZ];
  for (int r = 0; r < RC; ++r)
    for (int z = 0; z < NZ; ++z) acc[r][z] = vzero();
  for (int64_t j = 0; j < L; ++j) {
    Vec v[NZ];
    for (int z = 0; z < NZ; ++z) v[z] = vload(values[j] + kL * z);
    for (int r = 0; r < RC; ++r) {
      const Vec p = vset1(probs[r * L + j]);
      for (int z = 0; z < NZ; ++z) acc[r][z] = vfma(p, v[z], acc[r][z]);
    }
  }
  for (int r = 0; r < RC; ++r)
    for (int z = 0; z < NZ; ++z) vstore(out + r * D + kL * z, acc[r][z] * vset1(inv[r]));
}

template <int D>
void all_head_values(const float* probs, const float* inv, int64_t rep, int64_t L, const float* const* values,
                     float* out) {
  // accumulators in about three quarters of the registers (32 on AVX-512 and NEON, 16 on AVX2)
  constexpr int kRegs = kL == 8 ? 12 : 24;
  constexpr int64_t NZ = D / kL, kMaxRC = std::max<int64_t>(1, std::min<int64_t>(6, kRegs / NZ));
  for (int64_t r0 = 0; r0 < rep; r0 += kMaxRC) {
    const float* p = probs + r0 * L;
    float* o = out + r0 * D;
    switch (std::min(kMaxRC, rep - r0)) {
      case 1: head_values<D, 1>(p, inv + r0, L, values, o); break;
      case 2: if constexpr (kMaxRC >= 2) head_values<D, 2>(p, inv + r0, L, values, o); break;
      case 3: if constexpr (kMaxRC >= 3) head_values<D, 3>(p, inv + r0, L, values, o); break;
      case 4: if constexpr (kMaxRC >= 4) head_values<D, 4>(p, inv + r0, L, values, o); break;
      case 5: if constexpr (kMaxRC >= 5) head_values<D, 5>(p, inv + r0, L, values, o); break;
      default: if constexpr (kMaxRC >= 6) head_values<D, 6>(p, inv + r0, L, values, o); break;
    }
  }
}

// Below this many multiply-adds a decode step runs as one task: forking costs more than it saves.
constexpr int64_t kMinParallelWork = 100000;
// A key chunk shared out to a thread holds at least this many keys; at most kMaxChunks per pair.
constexpr int64_t kMinChunkKeys = 32, kMaxChunks = 64;

// probs[0:n] = exp(scores - max) in place; returns their sum
inline float softmax_numerators(float* s, int64_t n, float max) {
  const Vec vm = vset1(max);
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + kL <= n; i += kL) {
    const Vec e = exp_nonpositive(vload(s + i) - vm);
    vstore(s + i, e);
    acc = acc + e;
  }
  float sum = vsum(acc);
  if (i < n) {
    const Vec e = exp_nonpositive(vload_part(s + i, n - i) - vm);
    vstore_part(s + i, e, n - i);
    float tail[kL];
    vstore(tail, e);
    for (int64_t t = 0; t < n - i; ++t) sum += tail[t];
  }
  return sum;
}

// out [B, Hq, Dv] for one decode step (the new keys and values already in the caches).
inline void decode_attention(const DecodeAttention& a, float* o) {
  const int64_t B = a.B, Hq = a.Hq, Hkv = a.Hkv, D = a.D, Dv = a.Dv, page_size = a.page_size;
  const int64_t page_stride = page_size * Hkv * D, vpage_stride = page_size * Hkv * Dv;
  const int64_t rep = Hq / Hkv;
  // Work items: (sequence, KV head, key chunk). A decode step of one sequence has only Hkv
  // (sequence, head) pairs -- 3 for SmolLM2 -- and its keys and values come from DRAM (the weights
  // streamed since the last layer evicted them), so the keys of each pair are also split into
  // chunks the threads share (flash-decoding): each chunk leaves its own max, sum of exponentials
  // and unnormalised output, merged below. Small steps stay one task (a fork costs more).
  int64_t work = 0, max_len = 0;
  for (int64_t b = 0; b < B; ++b) work += (a.pos[b] + 1) * Hq * (D + Dv), max_len = std::max<int64_t>(max_len, a.pos[b] + 1);
  const int64_t threads = num_threads();
  const int64_t pairs = B * Hkv;
  int64_t chunks = 1;
  if (work >= kMinParallelWork && threads > 1 && pairs < 2 * threads)
    chunks = std::clamp<int64_t>(std::min<int64_t>((2 * threads + pairs - 1) / pairs, max_len / kMinChunkKeys), 1,
                                 kMaxChunks);
  const int64_t tasks = pairs * chunks;
  const int64_t grain = work < kMinParallelWork ? tasks : 1;
  // per task: rep unnormalised outputs [rep, Dv], and per query head its max and sum of exponentials
  std::vector<float> part_o(chunks > 1 ? tasks * rep * Dv : 0), part_m(tasks * rep), part_l(tasks * rep);
  // head dims with a vectorised path (kLanes keys per step, values into register accumulators)
  const int64_t vec_d = (D == Dv && (D == 64 || D == 128)) ? D : 0;
  parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    // inv[r]: what the values' sum is scaled by -- 1 / the softmax denominator for one chunk; 1 for
    // several, whose unnormalised partials are merged below
    std::vector<float> scores, inv(rep);
    std::vector<const float*> keys, values;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pair = t / chunks, c = t % chunks, b = pair / Hkv, g = pair % Hkv, last = a.pos[b];
      int64_t first_key = a.window >= 0 ? std::max<int64_t>(0, last - a.window + 1) : 0;
      if (a.chunk > 0) first_key = std::max<int64_t>(first_key, last / a.chunk * a.chunk);
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
      const float* qb = a.q + (b * Hq + g * rep) * D;
      scores.resize(rep * L);
      // where each key/value of the chunk lives (pages walked once, no division per key)
      keys.resize(L);
      values.resize(L);
      for (int64_t j = 0, page = first / page_size, slot = first % page_size; j < L; ++j, ++slot) {
        if (slot == page_size) slot = 0, ++page;
        const int64_t phys = a.pages[b * a.max_pages + page];
        keys[j] = a.k_cache + phys * page_stride + slot * Hkv * D + g * D;
        values[j] = a.v_cache + phys * vpage_stride + slot * Hkv * Dv + g * Dv;
      }
      if (vec_d == 64) {
        head_scores<64>(qb, rep, L, keys.data(), values.data(), scores.data(), a.scale);
      } else if (vec_d == 128) {
        head_scores<128>(qb, rep, L, keys.data(), values.data(), scores.data(), a.scale);
      } else {  // scores[r, j]: each key is read once for the `rep` query heads that share it
        for (int64_t j = 0; j < L; ++j)
          for (int64_t r = 0; r < rep; ++r) scores[r * L + j] = dot(qb + r * D, keys[j], D) * a.scale;
      }
      if (a.cap > 0.f)
        for (float& s : scores) s = a.cap * std::tanh(s / a.cap);
      if (a.slopes != nullptr)  // ALiBi: slopes[h] * (key position - query position)
        for (int64_t r = 0; r < rep; ++r) {
          const float sl = a.slopes[g * rep + r];
          float* sr = scores.data() + r * L;
          for (int64_t j = 0; j < L; ++j) sr[j] += sl * static_cast<float>(first + j - last);
        }
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * L;
        float m = sr[0];
        for (int64_t j = 1; j < L; ++j) m = std::max(m, sr[j]);
        if (a.sinks != nullptr && chunks == 1) m = std::max(m, a.sinks[g * rep + r]);
        float denom = softmax_numerators(sr, L, m);
        if (a.sinks != nullptr && chunks == 1) denom += std::exp(a.sinks[g * rep + r] - m);  // joins the normaliser only
        mb[r] = m, lb[r] = denom;
        inv[r] = chunks == 1 ? 1.f / denom : 1.f;
      }
      if (vec_d == 64) {
        all_head_values<64>(scores.data(), inv.data(), rep, L, values.data(), ob);
      } else if (vec_d == 128) {
        all_head_values<128>(scores.data(), inv.data(), rep, L, values.data(), ob);
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
        const float* sink = a.sinks != nullptr ? a.sinks + g * rep + r : nullptr;
        float M = sink != nullptr ? *sink : -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) M = std::max(M, part_m[(pair * chunks + c) * rep + r]);
        float denom = sink != nullptr ? std::exp(*sink - M) : 0.f;
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
}

}  // namespace wb
