// The kernels' unit harness: every kernel of one variant against plain scalar references, with no
// torch (built with -DWB_STANDALONE and one WB_ISA_* macro). It is how the ARM variants are tested on
// an x86 machine -- cross-compiled and run under qemu-user (tools/cpu_kernel_harness.py) -- and runs
// natively for the x86 variants too. Prints one line per check ("ok <name>" or "FAIL <name>: ...")
// and exits 1 if any failed.
//
// Tolerances as tests/test_cpu_kernels.py: the kernels compute the same fp32 products in another
// order, so errors are a few ulps of the accumulated magnitude.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_kernel.h"
#include "elementwise_kernel.h"
#include "linear_a8_kernel.h"
#include "linear_kernel.h"

namespace {

int failures = 0;
std::mt19937 rng(1234);

std::vector<float> randn(size_t n, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// IEEE half <-> float, bit by bit (the reference for vload_half / h2f)
float half_to_float(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 31, man = h & 1023;
  float v;
  if (exp == 0) v = std::ldexp(static_cast<float>(man), -24);
  else if (exp == 31) v = man ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  else v = std::ldexp(static_cast<float>(man | 1024), static_cast<int>(exp) - 25);
  return sign ? -v : v;
}
uint16_t float_to_half(float f) {  // round to nearest for the normal range the tests use
  if (f == 0.f) return 0;
  const uint16_t sign = f < 0 ? 0x8000 : 0;
  int e;
  const float m = std::frexp(std::fabs(f), &e);  // f = m * 2^e, m in [0.5, 1)
  int exp = e + 14;
  if (exp <= 0) return sign;
  long man = std::lrint((m * 2.f - 1.f) * 1024.f);
  if (man == 1024) man = 0, ++exp;
  return static_cast<uint16_t>(sign | (exp << 10) | man);
}

void check(const std::string& name, const float* got, const float* want, size_t n, float atol, float rtol) {
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(double(got[i]) - want[i]) - (atol + rtol * std::fabs(double(want[i])));
    if (!(err <= worst) || std::isnan(got[i])) worst = std::isnan(got[i]) ? INFINITY : err, at = i;
  }
  if (worst > 0) {
    std::printf("FAIL %s: element %zu is %.8g, expected %.8g\n", name.c_str(), at, got[at], want[at]);
    ++failures;
  } else {
    std::printf("ok %s\n", name.c_str());
  }
}

void check_vector_layer() {
  using namespace wb;
  std::vector<float> a = randn(4 * kL), out(kL, -1.f);
  // sums, maxima, partial loads and stores
  float want_sum = 0, want_max = -INFINITY;
  for (int i = 0; i < kL; ++i) want_sum += a[i], want_max = std::max(want_max, a[i]);
  float got[2] = {vsum(vload(a.data())), vmaxall(vload(a.data()))}, want[2] = {want_sum, want_max};
  check("vsum/vmaxall", got, want, 2, 1e-5f, 1e-6f);
  for (int n = 0; n <= kL; ++n) {
    std::vector<float> o(kL, -7.f), w(kL, -7.f);
    vstore_part(o.data(), vload_part(a.data(), n), n);
    for (int i = 0; i < n; ++i) w[i] = a[i];
    check("vload_part/vstore_part n=" + std::to_string(n), o.data(), w.data(), kL, 0, 0);
    vstore(o.data(), vload_part(a.data(), n));
    for (int i = n; i < kL; ++i) w[i] = 0.f;
    check("vload_part zeros n=" + std::to_string(n), o.data(), w.data(), kL, 0, 0);
  }
  // transpose-sum of kLanes vectors
  std::vector<Vec> vs(kL);
  std::vector<float> m = randn(kL * kL), ts(kL), tw(kL, 0.f);
  for (int i = 0; i < kL; ++i) {
    vs[i] = vload(m.data() + i * kL);
    for (int j = 0; j < kL; ++j) tw[i] += m[i * kL + j];
  }
  vstore(ts.data(), vtranspose_sum(vs.data()));
  check("vtranspose_sum", ts.data(), tw.data(), kL, 1e-5f, 1e-6f);
  // exp, silu
  std::vector<float> x(64), ex(64), ew(64), sx(64), sw(64);
  for (int i = 0; i < 64; ++i) x[i] = -100.f + 100.f * i / 63.f;
  for (int i = 0; i < 64; i += kL) vstore(ex.data() + i, exp_nonpositive(vload(x.data() + i)));
  for (int i = 0; i < 64; ++i) ew[i] = std::exp(x[i]);
  check("exp_nonpositive", ex.data(), ew.data(), 64, 1e-30f, 1e-6f);
  for (int i = 0; i < 64; ++i) x[i] = -30.f + 60.f * i / 63.f;
  for (int i = 0; i < 64; i += kL) vstore(sx.data() + i, silu(vload(x.data() + i)));
  for (int i = 0; i < 64; ++i) sw[i] = x[i] / (1.f + std::exp(-x[i]));
  check("silu", sx.data(), sw.data(), 64, 1e-6f, 1e-5f);
  // fp16 -> fp32
  std::vector<uint16_t> h(37);
  std::vector<float> hf(37), hw(37), hs(37);
  for (int i = 0; i < 37; ++i) h[i] = float_to_half((i - 18) * 0.37f), hw[i] = half_to_float(h[i]);
  widen(h.data(), hf.data(), 37);
  for (int i = 0; i < 37; ++i) hs[i] = h2f(h[i]);
  check("widen fp16", hf.data(), hw.data(), 37, 0, 0);
  check("h2f", hs.data(), hw.data(), 37, 0, 0);
}

struct Int4Weight {
  int64_t N, K, group;
  std::vector<uint8_t> q;   // [N, K/2]
  std::vector<uint16_t> s, o;  // [N, K/group]
  float w(int64_t n, int64_t k) const {  // the dequantized weight
    const int64_t b = k / 32, j = k % 32, g = k / group;
    const uint8_t byte = q[n * (K / 2) + b * 16 + (j % 16)];
    const int code = j < 16 ? (byte & 15) : (byte >> 4);
    return code * half_to_float(s[n * (K / group) + g]) + half_to_float(o[n * (K / group) + g]);
  }
};

Int4Weight int4_weight(int64_t N, int64_t K, int64_t group) {
  Int4Weight w{N, K, group, std::vector<uint8_t>(N * K / 2), {}, {}};
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(0.f, 1.f);
  for (auto& b : w.q) b = static_cast<uint8_t>(byte(rng));
  for (int64_t i = 0; i < N * (K / group); ++i)
    w.s.push_back(float_to_half(u(rng) * 0.02f)), w.o.push_back(float_to_half((u(rng) - 0.5f) * 0.1f));
  return w;
}

void check_linears() {
  using namespace wb;
  const int64_t K = 192, N = 37;  // 6 blocks; 37 rows: passes of 4 and 2 rows and a single one
  for (int64_t group : {32, 64}) {
    const Int4Weight w = int4_weight(N, K, group);
    for (int64_t M : {1, 2, 3, 9}) {
      std::vector<float> x = randn(M * K), y(M * N), want(M * N, 0.f);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += double(w.w(n, k)) * x[m * K + k];
          want[m * N + n] = static_cast<float>(acc);
        }
      Q4 q4{w.q.data(), w.s.data(), w.o.data(), K, K / group, group};
      linear_rows(q4, x.data(), y.data(), M, K, N);
      const std::string tag = " M=" + std::to_string(M) + " group=" + std::to_string(group);
      check("int4 linear" + tag, y.data(), want.data(), M * N, 1e-5f, 1e-5f);
      // int8 activations: the reference on the rounded activations (per block of 32, round half even)
      std::vector<float> xr(M * K);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < K / 32; ++b) {
          float amax = 0;
          for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[m * K + b * 32 + j]));
          const float d = amax / 127.f, id = amax > 0 ? 127.f / amax : 0.f;
          for (int j = 0; j < 32; ++j) xr[m * K + b * 32 + j] = std::nearbyint(x[m * K + b * 32 + j] * id) * d;
        }
      std::vector<float> want8(M * N);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (int64_t k = 0; k < K; ++k) acc += double(w.w(n, k)) * xr[m * K + k];
          want8[m * N + n] = static_cast<float>(acc);
        }
      linear_a8_rows(w.q.data(), w.s.data(), w.o.data(), x.data(), y.data(), M, K, N, group);
      check("int4 x int8 linear" + tag, y.data(), want8.data(), M * N, 2e-4f, 1e-5f);
    }
    std::vector<float> tile(N * K), want(N * K);
    Q4 q4{w.q.data(), w.s.data(), w.o.data(), K, K / group, group};
    decode_rows(q4, 0, N, tile.data());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) want[n * K + k] = w.w(n, k);
    check("int4 decode_rows group=" + std::to_string(group), tile.data(), want.data(), N * K, 1e-6f, 1e-6f);
  }
  // int8 (Q8_0) and fp32 weights
  std::uniform_int_distribution<int> code(-128, 127);
  std::vector<int8_t> q8(N * K);
  std::vector<uint16_t> s8;
  for (auto& c : q8) c = static_cast<int8_t>(code(rng));
  for (int64_t i = 0; i < N * K / 32; ++i) s8.push_back(float_to_half(0.01f + 0.001f * (i % 7)));
  std::vector<float> wf = randn(N * K);
  for (int64_t M : {1, 5, 9}) {
    std::vector<float> x = randn(M * K), y(M * N), want8(M * N), wantf(M * N);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double a8 = 0, af = 0;
        for (int64_t k = 0; k < K; ++k) {
          a8 += double(q8[n * K + k]) * half_to_float(s8[n * (K / 32) + k / 32]) * x[m * K + k];
          af += double(wf[n * K + k]) * x[m * K + k];
        }
        want8[m * N + n] = static_cast<float>(a8), wantf[m * N + n] = static_cast<float>(af);
      }
    Q8 w8{q8.data(), s8.data(), K, K / 32, 32};
    linear_rows(w8, x.data(), y.data(), M, K, N);
    check("int8 linear M=" + std::to_string(M), y.data(), want8.data(), M * N, 1e-4f, 1e-5f);
    F32 w32{wf.data(), K, 1, K};
    linear_rows(w32, x.data(), y.data(), M, K, N);
    check("fp32 linear M=" + std::to_string(M), y.data(), wantf.data(), M * N, 1e-4f, 1e-5f);
  }
}

void check_elementwise() {
  using namespace wb;
  const int64_t rows = 3, h = 64;
  std::vector<float> x = randn(rows * h), w = randn(h), y(rows * h), want(rows * h);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < h; ++i) ss += double(x[r * h + i]) * x[r * h + i];
    const double inv = 1.0 / std::sqrt(ss / h + 1e-5);
    for (int64_t i = 0; i < h; ++i) want[r * h + i] = static_cast<float>(w[i] * (x[r * h + i] * inv));
  }
  rmsnorm_rows(x.data(), w.data(), y.data(), h, 1e-5f, 0, rows);
  check("rmsnorm", y.data(), want.data(), rows * h, 1e-5f, 1e-5f);
  for (int64_t d : {64, 6}) {  // a vector path and a scalar tail
    std::vector<float> q = randn(d), c = randn(d), s = randn(d), o(d), r(d);
    for (int64_t i = 0; i < d / 2; ++i) {
      r[i] = q[i] * c[i] - q[i + d / 2] * s[i];
      r[i + d / 2] = q[i + d / 2] * c[i + d / 2] + q[i] * s[i + d / 2];
    }
    rotate(q.data(), c.data(), s.data(), o.data(), d);
    check("rope d=" + std::to_string(d), o.data(), r.data(), d, 1e-5f, 1e-5f);
  }
  const int64_t inner = 96;
  std::vector<float> gu = randn(2 * 2 * inner, 6.f), out(2 * inner), ref(2 * inner);
  for (int64_t r = 0; r < 2; ++r)
    for (int64_t i = 0; i < inner; ++i) {
      const float g = gu[r * 2 * inner + i];
      ref[r * inner + i] = g / (1.f + std::exp(-g)) * gu[r * 2 * inner + inner + i];
    }
  silu_and_mul_rows(gu.data(), out.data(), inner, 0, 2);
  check("silu_and_mul", out.data(), ref.data(), 2 * inner, 1e-5f, 1e-5f);
}

void check_attention(int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t window, float cap, bool sinks, bool alibi,
                     int64_t chunk, int64_t threads) {
  using namespace wb;
  const int64_t page_size = 16, max_pages = 20, P = B * max_pages;
  std::vector<float> kc = randn(P * page_size * Hkv * D), vc = randn(P * page_size * Hkv * D), q = randn(B * Hq * D);
  std::vector<int32_t> pages(B * max_pages), pos(B);
  for (int64_t i = 0; i < B * max_pages; ++i) pages[i] = static_cast<int32_t>((i * 7 + 3) % P);  // scattered
  const int32_t lens[] = {255, 37, 6, 180};
  for (int64_t b = 0; b < B; ++b) pos[b] = lens[b % 4];
  std::vector<float> sk = randn(Hq), sl(Hq);
  for (int64_t h = 0; h < Hq; ++h) sl[h] = -0.05f * (h + 1);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  DecodeAttention a{q.data(), kc.data(), vc.data(), pages.data(), pos.data(), B, Hq, Hkv, D, D, page_size, max_pages,
                    scale};
  a.window = window, a.cap = cap, a.sinks = sinks ? sk.data() : nullptr, a.slopes = alibi ? sl.data() : nullptr;
  a.chunk = chunk;
  std::vector<float> out(B * Hq * D), want(B * Hq * D, 0.f);
  standalone_threads() = threads;
  decode_attention(a, out.data());
  standalone_threads() = 1;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv), last = pos[b];
      int64_t first = window >= 0 ? std::max<int64_t>(0, last - window + 1) : 0;
      if (chunk > 0) first = std::max<int64_t>(first, last / chunk * chunk);
      std::vector<double> logit;
      for (int64_t j = first; j <= last; ++j) {
        const float* k = kc.data() + (pages[b * max_pages + j / page_size] * page_size + j % page_size) * Hkv * D + g * D;
        double s = 0;
        for (int64_t i = 0; i < D; ++i) s += double(q[(b * Hq + h) * D + i]) * k[i];
        s *= scale;
        if (cap > 0) s = cap * std::tanh(s / cap);
        if (alibi) s += sl[h] * double(j - last);
        logit.push_back(s);
      }
      double mx = sinks ? sk[h] : -INFINITY, den = 0;
      for (double s : logit) mx = std::max(mx, s);
      for (double s : logit) den += std::exp(s - mx);
      if (sinks) den += std::exp(sk[h] - mx);
      for (int64_t j = first; j <= last; ++j) {
        const float* v = vc.data() + (pages[b * max_pages + j / page_size] * page_size + j % page_size) * Hkv * D + g * D;
        const double p = std::exp(logit[j - first] - mx) / den;
        for (int64_t i = 0; i < D; ++i) want[(b * Hq + h) * D + i] += static_cast<float>(p * v[i]);
      }
    }
  char tag[160];
  std::snprintf(tag, sizeof tag, "attention B=%ld Hq=%ld Hkv=%ld D=%ld window=%ld cap=%g sinks=%d alibi=%d chunk=%ld threads=%ld",
                long(B), long(Hq), long(Hkv), long(D), long(window), cap, int(sinks), int(alibi), long(chunk), long(threads));
  check(tag, out.data(), want.data(), out.size(), 2e-6f, 1e-5f);
}

}  // namespace

int main() {
  std::printf("variant %s, %d float lanes, int8 dots by %s\n", wb::kIsa, wb::kL, wb::kInt8Dot);
  check_vector_layer();
  check_linears();
  check_elementwise();
  check_attention(1, 9, 3, 64, -1, 0.f, false, false, -1, 1);   // SmolLM2's decode shape
  check_attention(1, 9, 3, 64, -1, 0.f, false, false, -1, 4);   // its keys split into chunks
  check_attention(3, 12, 2, 128, -1, 30.f, false, false, -1, 1);
  check_attention(2, 14, 2, 64, 20, 0.f, true, false, -1, 3);
  check_attention(4, 8, 2, 64, 70, 0.f, true, false, -1, 5);    // sinks joined at the chunks' merge
  check_attention(3, 4, 2, 32, -1, 0.f, false, true, -1, 2);    // no vector path for D=32; ALiBi
  check_attention(2, 6, 3, 64, -1, 0.f, false, false, 16, 1);   // chunked local attention
  std::printf("%s: %d check(s) failed\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
