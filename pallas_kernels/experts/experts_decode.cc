// Routed experts for a few tokens on CPU, as an XLA FFI custom call (pallas_kernels/experts/cpu_kernel.py).
//
// out[n] = sum_j wts[n, j] * expert_{idx[n, j]}(x[n]), expert_e(v) = wd[e] . swiglu(wg[e] . v, wu[e] . v),
// swiglu(g, u) = min(silu(g), L) * clip(u, -L, L) when L > 0, silu(g) * u when L = 0.
// Why: XLA:CPU copies an expert's weights before every GEMM that reads them (a dynamic slice is a
// copy), so a decode step streams each used expert twice; here each used expert's weights are read
// once, in place, for all the tokens that picked it, split over `threads` threads by expert, in
// register tiles of two weight rows by four tokens (dot_tile), so the FMA units, not the loads, bound it;
// an expert picked by many tokens (prefill) runs the same sums as a GEMM over tokens (class_tile).
// Deterministic: every expert's output goes to its own (token, slot) row, summed afterwards per
// token in slot order, so the thread split never changes a bit of the result.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Eight float lanes (one AVX2 register; GCC/Clang lower it to whatever the target has).
typedef float vf8 __attribute__((vector_size(32)));
constexpr int64_t L = 8;

inline vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float hsum(vf8 v) {
  float s = 0.f;
  for (int l = 0; l < L; ++l) s += v[l];
  return s;
}

// out[r][0] = w0 . x[r], out[r][1] = w1 . x[r] for r < RB (vectors of length n): two weight rows
// against RB activation rows at once, so each loaded weight vector feeds RB FMAs and each loaded
// activation vector two (8 independent accumulators at RB = 4). Every row's sum is accumulated in
// the same order whatever RB is, so a token's result never depends on which tokens share its tile.
template <int RB>
inline void dot_tile(const float* w0, const float* w1, const float* const* x, int64_t n, float (*out)[2]) {
  vf8 a0[RB], a1[RB];
  for (int r = 0; r < RB; ++r) a0[r] = a1[r] = vf8{};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    // 8 KiB ahead in each weight row (the next pair's rows; prefetches never fault past the end).
    // Spelled out here: GCC 12 dropped them from a helper. One MoE layer (bench_moe_decode.py): 8 tokens
    // 5.1 -> 4.0 ms, 32 tokens 11.3 -> 7.4 ms (26.6 GB/s of the two cores' ~28 read bandwidth).
    __builtin_prefetch(w0 + i + 2048, 0, 1);
    __builtin_prefetch(w1 + i + 2048, 0, 1);
    const vf8 p = load8(w0 + i), q = load8(w1 + i);
    for (int r = 0; r < RB; ++r) {
      const vf8 v = load8(x[r] + i);
      a0[r] += p * v;
      a1[r] += q * v;
    }
  }
  for (int r = 0; r < RB; ++r) {
    float s0 = hsum(a0[r]), s1 = hsum(a1[r]);
    for (int64_t j = i; j < n; ++j) {
      s0 = __builtin_fmaf(w0[j], x[r][j], s0);  // explicit: the GEMM path's tail does the same
      s1 = __builtin_fmaf(w1[j], x[r][j], s1);
    }
    out[r][0] = s0;
    out[r][1] = s1;
  }
}

// dot_tile over all R rows: tiles of 4, then the 1-3 left (same per-row arithmetic).
inline void dot_rows(const float* w0, const float* w1, const float* const* x, int64_t R, int64_t n,
                     float (*out)[2]) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) dot_tile<4>(w0, w1, x + r, n, out + r);
  switch (R - r) {
    case 3: dot_tile<3>(w0, w1, x + r, n, out + r); break;
    case 2: dot_tile<2>(w0, w1, x + r, n, out + r); break;
    case 1: dot_tile<1>(w0, w1, x + r, n, out + r); break;
    default: break;
  }
}


// ---- Many tokens per expert: the same sums as dot_tile, as a register-tiled GEMM. ----
// dot_tile's value for (weight row o, token t) is: eight lane sums p_l = sum_j w[8j+l] x[8j+l] (FMA chains,
// j ascending), then ((((0 + p_0) + p_1) + ...) + p_7), then the tail d >= 8 floor(n/8) added in order.
// Here the tokens lie across the vector lanes and each lane class l (d = 8j + l) is one pass: a pass
// accumulates p_l of MO rows x 8 NV tokens in registers (the weight rows broadcast, the activations
// loaded), then adds it to the running sum in order l = 0..7. Same operations on the same values in
// the same order, so the bits equal the dot path's: a token's result still does not depend on how
// many tokens picked its expert. Why: with many tokens per expert (prefill) the dot form spends its
// time on horizontal sums and activation loads (~90 GFLOP/s of the two cores' ~230 peak); here every
// weight broadcast feeds NV FMAs and every activation vector MO (~147 GFLOP/s at 64 tokens an expert).
constexpr int MO = 6, NV = 4;  // 24 accumulators: AVX-512VL's 32 vector registers
constexpr int64_t TW = NV * L;  // tokens per tile

// The GEMM's activation operand for Rp tokens (a multiple of 8; padding tokens zero) is tile-major:
// tiles of TW tokens, the last one Rp mod TW wide, each [K][its width] with the K rows in lane-class
// order (row l K8 + j holds element 8j + l, K8 = K / 8; then the tail elements d >= 8 K8 in order).
// So a tile's pass reads one contiguous run (with the tokens' rows [K][Rp] interleaved instead, one
// MoE layer of 512 tokens took 50 ms, tile-major 44; 2,048 tokens 244 -> 208 ms; <= 128 tokens within 2%).
// put_token writes the K-vector v of token r into it.
inline void put_token(float* xc, const float* v, int64_t r, int64_t K, int64_t Rp) {
  const int64_t t0 = r / TW * TW, w = std::min(TW, Rp - t0), K8 = K / L;
  float* o = xc + t0 * K + (r - t0);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t j = 0; j < K8; ++j) o[(l * K8 + j) * w] = v[L * j + l];
  for (int64_t d = L * K8; d < K; ++d) o[d * w] = v[d];
}

// out[i * ostride + t0 + t] for the mo weight rows w[i * K ...] (read in place: each pass broadcasts
// every 8th element) and the 8 nv tokens of one tile xc ([K][xs], xs = 8 nv, as put_token lays it out).
// xs is a runtime argument on purpose: a compile-time stride made GCC 12 schedule the loop worse
// (128 tokens 16.6 -> 18.9 ms).
template <int mo, int nv>
inline void class_tile(const float* w, const float* xc, int64_t K, int64_t xs, int64_t t0, float* out,
                       int64_t ostride) {
  const int64_t K8 = K / L;
  vf8 S[mo][nv];
  for (int i = 0; i < mo; ++i)
    for (int v = 0; v < nv; ++v) S[i][v] = vf8{};
  for (int64_t l = 0; l < L; ++l) {
    vf8 A[mo][nv];
    for (int i = 0; i < mo; ++i)
      for (int v = 0; v < nv; ++v) A[i][v] = vf8{};
    const float* xl = xc + l * K8 * xs;
    const float* wl = w + l;
    for (int64_t j = 0; j < K8; ++j) {
      if (l == 0)  // the next tile's weight rows (one line of each every other j): 128 tokens 20.4 -> 17.9 ms
        for (int i = 0; i < mo; ++i) __builtin_prefetch(w + (mo + i) * K + L * j, 0, 1);
      vf8 xv[nv];
      for (int v = 0; v < nv; ++v) xv[v] = load8(xl + j * xs + v * L);
      for (int i = 0; i < mo; ++i) {
        const float b = wl[i * K + L * j];
        for (int v = 0; v < nv; ++v) A[i][v] += b * xv[v];
      }
    }
    for (int i = 0; i < mo; ++i)
      for (int v = 0; v < nv; ++v) S[i][v] = S[i][v] + A[i][v];
  }
  for (int64_t d = L * K8; d < K; ++d) {
    const float* xd = xc + d * xs;
    for (int v = 0; v < nv; ++v)
      for (int i = 0; i < mo; ++i)
        for (int q = 0; q < L; ++q) S[i][v][q] = __builtin_fmaf(w[i * K + d], xd[v * L + q], S[i][v][q]);
  }
  for (int i = 0; i < mo; ++i)
    for (int v = 0; v < nv; ++v) std::memcpy(out + i * ostride + t0 + v * L, &S[i][v], sizeof(vf8));
}

template <int mo>
inline void class_rows(const float* w, const float* xc, int64_t K, int64_t Rp, float* out) {
  int64_t t = 0;
  for (; t + TW <= Rp; t += TW) class_tile<mo, NV>(w, xc + t * K, K, TW, t, out, Rp);
  switch ((Rp - t) / L) {
    case 3: class_tile<mo, 3>(w, xc + t * K, K, Rp - t, t, out, Rp); break;
    case 2: class_tile<mo, 2>(w, xc + t * K, K, Rp - t, t, out, Rp); break;
    case 1: class_tile<mo, 1>(w, xc + t * K, K, Rp - t, t, out, Rp); break;
    default: break;
  }
}

// out[o * Rp + t] = dot_tile's sum of weight row o of w [O, K] with token t (xc tile-major, above).
inline void class_gemm(const float* w, int64_t O, int64_t K, const float* xc, int64_t Rp, float* out) {
  for (int64_t o0 = 0; o0 < O; o0 += MO) {
    const int mo = static_cast<int>(std::min<int64_t>(MO, O - o0));
    const float* wt = w + o0 * K;
    float* o = out + o0 * Rp;
    switch (mo) {
      case 6: class_rows<6>(wt, xc, K, Rp, o); break;
      case 5: class_rows<5>(wt, xc, K, Rp, o); break;
      case 4: class_rows<4>(wt, xc, K, Rp, o); break;
      case 3: class_rows<3>(wt, xc, K, Rp, o); break;
      case 2: class_rows<2>(wt, xc, K, Rp, o); break;
      default: class_rows<1>(wt, xc, K, Rp, o); break;
    }
  }
}

inline float swiglu(float g, float u, float lim) {
  float a = g / (1.f + std::exp(-g));
  if (lim > 0.f) {
    a = std::min(a, lim);
    u = std::min(std::max(u, -lim), lim);
  }
  return a * u;
}

struct Job {
  int64_t expert;
  std::vector<int64_t> slots;  // assignment slots n * k + j that picked this expert
};

struct Scratch {
  std::vector<const float*> xr, hr;
  std::vector<float> h;
  std::vector<float> pair;  // [R][2]
  std::vector<float> xc, g, u, hc, y, hrow;  // the GEMM path's operands (run_expert_gemm)
};

// Experts picked by at least this many tokens run the GEMM path: same bits, faster from ~8 on (one
// mid-config MoE layer, tools/bench_moe_decode.py, against the dot path alone: 128 tokens 23 -> 17 ms,
// 512 tokens 72 -> 48 ms, 2,048 tokens 332 -> 232 ms; thresholds 8, 12, 16 within 2%, 24 slower at 128).
constexpr int64_t kGemmRows = 12;

void run_expert_gemm(const Job& job, const float* x, const float* wg, const float* wu, const float* wd, float lim,
                     int64_t k, int64_t D, int64_t I, float* ybuf, Scratch& s) {
  const int64_t R = static_cast<int64_t>(job.slots.size()), Rp = (R + L - 1) / L * L;
  const float* g_e = wg + job.expert * I * D;
  const float* u_e = wu + job.expert * I * D;
  const float* d_e = wd + job.expert * D * I;
  s.xc.assign(static_cast<size_t>(D * Rp), 0.f);
  for (int64_t r = 0; r < R; ++r) put_token(s.xc.data(), x + (job.slots[r] / k) * D, r, D, Rp);
  s.g.resize(static_cast<size_t>(I * Rp));
  s.u.resize(static_cast<size_t>(I * Rp));
  class_gemm(g_e, I, D, s.xc.data(), Rp, s.g.data());
  class_gemm(u_e, I, D, s.xc.data(), Rp, s.u.data());
  s.hc.assign(static_cast<size_t>(I * Rp), 0.f);
  s.hrow.resize(static_cast<size_t>(I));
  for (int64_t r = 0; r < R; ++r) {  // token r's hidden vector, then into the down GEMM's operand
    for (int64_t i = 0; i < I; ++i) s.hrow[i] = swiglu(s.g[i * Rp + r], s.u[i * Rp + r], lim);
    put_token(s.hc.data(), s.hrow.data(), r, I, Rp);
  }
  s.y.resize(static_cast<size_t>(D * Rp));
  class_gemm(d_e, D, I, s.hc.data(), Rp, s.y.data());
  for (int64_t r = 0; r < R; ++r) {
    float* yr = ybuf + job.slots[r] * D;
    for (int64_t d = 0; d < D; ++d) yr[d] = s.y[d * Rp + r];
  }
}

void run_expert(const Job& job, const float* x, const float* wg, const float* wu, const float* wd, float lim,
                int64_t k, int64_t D, int64_t I, float* ybuf, Scratch& s) {
  const int64_t R = static_cast<int64_t>(job.slots.size());
  if (R >= kGemmRows) return run_expert_gemm(job, x, wg, wu, wd, lim, k, D, I, ybuf, s);
  const float* g_e = wg + job.expert * I * D;
  const float* u_e = wu + job.expert * I * D;
  const float* d_e = wd + job.expert * D * I;
  s.xr.resize(R);
  s.hr.resize(R);
  s.h.assign(static_cast<size_t>(R * I), 0.f);
  s.pair.resize(static_cast<size_t>(2 * R));
  auto* pair = reinterpret_cast<float (*)[2]>(s.pair.data());
  for (int64_t r = 0; r < R; ++r) {
    s.xr[r] = x + (job.slots[r] / k) * D;
    s.hr[r] = s.h.data() + r * I;
  }
  for (int64_t i = 0; i < I; ++i) {  // gate and up row i, read once, against every row that picked e
    dot_rows(g_e + i * D, u_e + i * D, s.xr.data(), R, D, pair);
    for (int64_t r = 0; r < R; ++r) s.h[r * I + i] = swiglu(pair[r][0], pair[r][1], lim);
  }
  int64_t d = 0;
  for (; d + 2 <= D; d += 2) {  // down rows d, d+1 against every row's hidden vector
    dot_rows(d_e + d * I, d_e + (d + 1) * I, s.hr.data(), R, I, pair);
    for (int64_t r = 0; r < R; ++r) {
      ybuf[job.slots[r] * D + d] = pair[r][0];
      ybuf[job.slots[r] * D + d + 1] = pair[r][1];
    }
  }
  if (d < D) {  // odd D: the last row paired with itself
    dot_rows(d_e + d * I, d_e + d * I, s.hr.data(), R, I, pair);
    for (int64_t r = 0; r < R; ++r) ybuf[job.slots[r] * D + d] = pair[r][0];
  }
}

ffi::Error ExpertsDecodeImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> idx, ffi::Buffer<ffi::F32> wts,
                             ffi::Buffer<ffi::F32> wg, ffi::Buffer<ffi::F32> wu, ffi::Buffer<ffi::F32> wd,
                             ffi::Buffer<ffi::F32> limit, ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  const auto xd = x.dimensions(), id = idx.dimensions(), gd = wg.dimensions(), dd = wd.dimensions();
  const auto ud = wu.dimensions(), td = wts.dimensions();
  if (xd.size() != 2 || id.size() != 2 || gd.size() != 3 || dd.size() != 3 || ud.size() != 3 || td.size() != 2 ||
      id[0] != xd[0] || gd[2] != xd[1] || dd[1] != xd[1] || dd[2] != gd[1] || dd[0] != gd[0] ||
      ud[0] != gd[0] || ud[1] != gd[1] || ud[2] != gd[2] || td[0] != id[0] || td[1] != id[1] ||
      limit.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_experts_decode: inconsistent shapes");
  const int64_t N = xd[0], D = xd[1], k = id[1], E = gd[0], I = gd[1];
  const float lim = limit.typed_data()[0];
  const int32_t* ids = idx.typed_data();
  std::vector<int64_t> which(static_cast<size_t>(E), -1);
  std::vector<Job> jobs;
  for (int64_t m = 0; m < N * k; ++m) {  // group the assignments by expert, experts in id order
    const int64_t e = ids[m];
    if (e < 0 || e >= E) continue;  // another device's expert, or masked
    if (which[e] < 0) which[e] = 0;
  }
  for (int64_t e = 0; e < E; ++e)
    if (which[e] == 0) {
      which[e] = static_cast<int64_t>(jobs.size());
      jobs.push_back({e, {}});
    }
  for (int64_t m = 0; m < N * k; ++m) {
    const int64_t e = ids[m];
    if (e >= 0 && e < E) jobs[which[e]].slots.push_back(m);
  }
  std::vector<float> ybuf(static_cast<size_t>(N * k * D), 0.f);
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(threads, static_cast<int64_t>(jobs.size())));
  // experts handed out one at a time (not a fixed split): a descheduled thread delays the call by
  // one expert, not by its share; each expert writes its own rows of ybuf, so the bits do not change
  std::atomic<size_t> next{0};
  auto work = [&](int64_t) {
    Scratch h;
    for (size_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < jobs.size();)
      run_expert(jobs[j], x.typed_data(), wg.typed_data(), wu.typed_data(), wd.typed_data(), lim, k, D, I,
                 ybuf.data(), h);
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < T; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& th : pool) th.join();
  float* o = out->typed_data();
  const float* w = wts.typed_data();
  for (int64_t n = 0; n < N; ++n) {
    float* on = o + n * D;
    std::fill(on, on + D, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t m = n * k + j, e = ids[m];
      if (e < 0 || e >= E) continue;
      const float wj = w[m];
      const float* y = ybuf.data() + m * D;
      for (int64_t d = 0; d < D; ++d) on[d] += wj * y[d];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LingExpertsDecode, ExpertsDecodeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
