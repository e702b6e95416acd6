// Routed experts for a few tokens on CPU, as an XLA FFI custom call (pallas_kernels/experts/cpu_kernel.py).
//
// out[n] = sum_j wts[n, j] * expert_{idx[n, j]}(x[n]), expert_e(v) = wd[e] . swiglu(wg[e] . v, wu[e] . v),
// swiglu(g, u) = min(silu(g), L) * clip(u, -L, L) when L > 0, silu(g) * u when L = 0.
// Why: XLA:CPU copies an expert's weights before every GEMM that reads them (a dynamic slice is a
// copy), so a decode step streams each used expert twice; here each used expert's weights are read
// once, in place, for all the tokens that picked it, split over `threads` threads by expert, in
// register tiles of two weight rows by four tokens (dot_tile), so the FMA units, not the loads, bound it;
// an expert picked by many tokens (prefill) runs the same sums as a packed-panel GEMM (panel_gemm).
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
#include "../native_tiles.h"

namespace ffi = xla::ffi;

namespace {

using namespace ling_tiles;

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
  std::vector<float> xc, g, u, hc, y;  // the GEMM path's operands (run_expert_gemm)
};

// Experts picked by at least this many tokens run the GEMM path: same bits, faster from ~8 on (one
// mid-config MoE layer, tools/bench_moe_decode.py, against the dot path alone: 128 tokens 23 -> 17 ms,
// 512 tokens 72 -> 48 ms, 2,048 tokens 332 -> 232 ms; thresholds 8, 12, 16 within 2%, 24 slower at 128;
// fourteenth session, the previous GEMM form). The packed-panel form (thirty-second session, a Zen 3
// host, AVX2): 128 tokens 24.9 -> 21.2 ms, 512 tokens 87.7 -> 64.8 ms against the previous form.
constexpr int64_t kGemmRows = 12;

// The GEMM form of one expert. packed = false: its weights are [out, in] rows, each panel packed in the call
// (panel_gemm). packed = true (the `packed` attribute: gate/up [E][I/16 panels][D][16], down [E][D/16
// panels][I][16], each panel in pack_panel's order; pallas_kernels/experts/panels.py): the panels are read in
// place (packed_gemm), at every token count. Same bits either way. Why packed: the per-call pack is a memory
// stall between two panels' passes; one mid-config MoE layer on a Zen 3 host (tools/bench_moe_decode.py)
// took 0.72x the time at 128 tokens, 0.87x at 512, 0.95x at 8.
void run_expert_gemm(const Job& job, const float* x, const float* wg, const float* wu, const float* wd, float lim,
                     int64_t k, int64_t D, int64_t I, float* ybuf, Scratch& s, bool packed) {
  const auto gemm = packed ? packed_gemm : panel_gemm;
  const int64_t R = static_cast<int64_t>(job.slots.size());
  const float* g_e = wg + job.expert * I * D;
  const float* u_e = wu + job.expert * I * D;
  const float* d_e = wd + job.expert * D * I;
  s.xr.resize(R);
  s.hr.resize(R);
  for (int64_t r = 0; r < R; ++r) s.xr[r] = x + (job.slots[r] / k) * D;
  pack_activations(s.xr.data(), R, D, s.xc);
  s.g.resize(static_cast<size_t>(R * I));
  s.u.resize(static_cast<size_t>(R * I));
  gemm(g_e, I, D, s.xc.data(), R, s.g.data(), I);
  gemm(u_e, I, D, s.xc.data(), R, s.u.data(), I);
  for (int64_t r = 0; r < R; ++r) {  // token r's hidden vector, in place of its gate row
    float* h = s.g.data() + r * I;
    for (int64_t i = 0; i < I; ++i) h[i] = swiglu(h[i], s.u[r * I + i], lim);
    s.hr[r] = h;
  }
  pack_activations(s.hr.data(), R, I, s.hc);
  s.y.resize(static_cast<size_t>(R * D));
  gemm(d_e, D, I, s.hc.data(), R, s.y.data(), D);
  for (int64_t r = 0; r < R; ++r) std::memcpy(ybuf + job.slots[r] * D, s.y.data() + r * D, D * sizeof(float));
}

void run_expert(const Job& job, const float* x, const float* wg, const float* wu, const float* wd, float lim,
                int64_t k, int64_t D, int64_t I, float* ybuf, Scratch& s, bool packed) {
  const int64_t R = static_cast<int64_t>(job.slots.size());
  if (packed || R >= kGemmRows) return run_expert_gemm(job, x, wg, wu, wd, lim, k, D, I, ybuf, s, packed);
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
                             ffi::Buffer<ffi::F32> limit, ffi::ResultBuffer<ffi::F32> out, int64_t threads,
                             int64_t packed) {
  const auto xd = x.dimensions(), id = idx.dimensions(), gd = wg.dimensions(), dd = wd.dimensions();
  const auto ud = wu.dimensions(), td = wts.dimensions();
  if (xd.size() != 2 || id.size() != 2 || gd.size() != 3 || dd.size() != 3 || ud.size() != 3 || td.size() != 2 ||
      id[0] != xd[0] || gd[2] != xd[1] || dd[1] != xd[1] || dd[2] != gd[1] || dd[0] != gd[0] ||
      ud[0] != gd[0] || ud[1] != gd[1] || ud[2] != gd[2] || td[0] != id[0] || td[1] != id[1] ||
      limit.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_experts_decode: inconsistent shapes");
  const int64_t N = xd[0], D = xd[1], k = id[1], E = gd[0], I = gd[1];
  if (packed && (I % PW != 0 || D % PW != 0))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "ling_experts_decode: packed experts need D and I multiples of 16");
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
                 ybuf.data(), h, packed != 0);
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
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("packed"));
