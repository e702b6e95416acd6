// What storing the routed experts in the native kernel's panel order would buy (issue 21, "layers stored
// the way they run"; thirty-fifth session): the experts kernel as it is (`experts_decode.cc`, included
// here: each call packs every weight panel it reads, 16 rows x K in lane-class order, from the [O][K]
// rows) against the same GEMM over weights packed once beforehand (no pack in the call), on one mid-config
// MoE layer (64 experts 256 x 1024, top-8, cold weights), N tokens routed at random, 2 threads.
// Same sums in the same order: the outputs must be equal bit for bit (checked).
//
//   g++ -O3 -march=native -ffp-contract=fast -std=c++17 -I"$(python -c 'import jax; print(jax.ffi.include_dir())')" \
//       tools/native/bench_prepacked_experts.cc -o /tmp/bench_prepacked_experts -lpthread
//   /tmp/bench_prepacked_experts 8 32 128 512
#include "../../pallas_kernels/experts/experts_decode.cc"

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// panel_pass for the first P (< PM) rows of an activation panel: a panel of one token does 2 FMAs a step,
// not the 12 of a full one (the kernel's dot form reads 1-11 tokens' experts; the packed form has no rows).
template <int P>
__attribute__((noinline)) void part_pass(const float* __restrict a, const float* __restrict b, int64_t n,
                                         vf8 (*__restrict s)[2]) {
  vf8 A[P] = {}, B[P] = {};
  for (int64_t j = 0; j < n; ++j, a += PM, b += PW) {
    const vf8 w0 = load8(b), w1 = load8(b + L);
    for (int t = 0; t < P; ++t) {
      A[t] += a[t] * w0;
      B[t] += a[t] * w1;
    }
  }
  for (int t = 0; t < P; ++t) {
    s[t][0] = s[t][0] + A[t];
    s[t][1] = s[t][1] + B[t];
  }
}

void pass_rows(int64_t rows, const float* a, const float* b, int64_t n, vf8 (*s)[2]) {
  switch (rows) {
    case 1: return part_pass<1>(a, b, n, s);
    case 2: return part_pass<2>(a, b, n, s);
    case 3: return part_pass<3>(a, b, n, s);
    case 4: return part_pass<4>(a, b, n, s);
    case 5: return part_pass<5>(a, b, n, s);
    default: return panel_pass(a, b, n, s);
  }
}

// panel_gemm over a matrix already packed (its panels of [K][PW] back to back): no pack in the call.
void packed_gemm(const float* wp, int64_t O, int64_t K, const float* ap, int64_t N, float* out) {
  const int64_t K8 = K / L, np = (N + PM - 1) / PM;
  std::vector<vf8> sbuf(static_cast<size_t>(np * PM * 2));
  auto* s = reinterpret_cast<vf8(*)[PM][2]>(sbuf.data());
  for (int64_t o0 = 0; o0 < O; o0 += PW) {
    const float* bp = wp + o0 * K;
    std::fill(sbuf.begin(), sbuf.end(), vf8{});
    for (int64_t l = 0; l < L; ++l)
      for (int64_t p = 0; p < np; ++p)
        pass_rows(std::min<int64_t>(PM, N - p * PM), ap + p * PM * K + l * K8 * PM, bp + l * K8 * PW, K8, s[p]);
    for (int64_t p = 0; p < np; ++p)
      for (int64_t t = 0; t < std::min<int64_t>(PM, N - p * PM); ++t) {
        std::memcpy(out + (p * PM + t) * O + o0, &s[p][t][0], sizeof(vf8));
        std::memcpy(out + (p * PM + t) * O + o0 + L, &s[p][t][1], sizeof(vf8));
      }
  }
}

void packed_expert(const Job& job, const float* x, const float* pg, const float* pu, const float* pd, int64_t k,
                   int64_t D, int64_t I, float* ybuf, Scratch& s) {
  const int64_t R = static_cast<int64_t>(job.slots.size());
  s.xr.resize(R);
  s.hr.resize(R);
  for (int64_t r = 0; r < R; ++r) s.xr[r] = x + (job.slots[r] / k) * D;
  pack_activations(s.xr.data(), R, D, s.xc);
  s.g.resize(R * I);
  s.u.resize(R * I);
  packed_gemm(pg + job.expert * I * D, I, D, s.xc.data(), R, s.g.data());
  packed_gemm(pu + job.expert * I * D, I, D, s.xc.data(), R, s.u.data());
  for (int64_t r = 0; r < R; ++r) {
    float* h = s.g.data() + r * I;
    for (int64_t i = 0; i < I; ++i) h[i] = swiglu(h[i], s.u[r * I + i], 0.f);
    s.hr[r] = h;
  }
  pack_activations(s.hr.data(), R, I, s.hc);
  s.y.resize(R * D);
  packed_gemm(pd + job.expert * D * I, D, I, s.hc.data(), R, s.y.data());
  for (int64_t r = 0; r < R; ++r) std::memcpy(ybuf + job.slots[r] * D, s.y.data() + r * D, D * sizeof(float));
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t E = 64, I = 256, D = 1024, k = 8, threads = 2;
  std::vector<float> wg(E * I * D), wu(E * I * D), wd(E * D * I), pg(wg.size()), pu(wu.size()), pd(wd.size());
  for (auto* v : {&wg, &wu, &wd})
    for (auto& f : *v) f = (rand() / static_cast<float>(RAND_MAX) - 0.5f) * 0.05f;
  auto prepack = [&](const std::vector<float>& w, std::vector<float>& p, int64_t O, int64_t K) {
    const float* rows[PW];
    for (int64_t e = 0; e < E; ++e)
      for (int64_t o0 = 0; o0 < O; o0 += PW) {
        for (int64_t r = 0; r < PW; ++r) rows[r] = w.data() + e * O * K + (o0 + r) * K;
        pack_panel(rows, PW, K, PW, p.data() + e * O * K + o0 * K);
      }
  };
  prepack(wg, pg, I, D);
  prepack(wu, pu, I, D);
  prepack(wd, pd, D, I);
  printf("| tokens | kernel as it is, ms (min of 9) | prepacked weights, ms | prepacked / as is | equal bits |\n");
  printf("|---:|---:|---:|---:|---|\n");
  for (int a = 1; a < argc; ++a) {
    const int64_t N = atoi(argv[a]);
    std::vector<float> x(N * D);
    for (auto& f : x) f = rand() / static_cast<float>(RAND_MAX) - 0.5f;
    std::vector<int64_t> which(E, -1);
    std::vector<Job> jobs;
    for (int64_t n = 0; n < N; ++n) {  // top-8 of 64 at random, jobs grouped by expert as the kernel does
      std::vector<int64_t> p(E);
      for (int64_t e = 0; e < E; ++e) p[e] = e;
      for (int64_t j = 0; j < k; ++j) {
        std::swap(p[j], p[j + rand() % (E - j)]);
        if (which[p[j]] < 0) which[p[j]] = static_cast<int64_t>(jobs.size()), jobs.push_back({p[j], {}});
        jobs[which[p[j]]].slots.push_back(n * k + j);
      }
    }
    std::vector<float> y0(N * k * D), y1(N * k * D);
    double best[2] = {1e9, 1e9};
    for (int it = 0; it < 9; ++it)
      for (int v = 0; v < 2; ++v) {
        std::atomic<size_t> next{0};
        auto work = [&]() {
          Scratch h;
          for (size_t j; (j = next.fetch_add(1)) < jobs.size();) {
            if (v == 0) run_expert(jobs[j], x.data(), wg.data(), wu.data(), wd.data(), 0.f, k, D, I, y0.data(), h);
            else packed_expert(jobs[j], x.data(), pg.data(), pu.data(), pd.data(), k, D, I, y1.data(), h);
          }
        };
        const double t0 = now();
        std::vector<std::thread> pool;
        for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
        work();
        for (auto& t : pool) t.join();
        best[v] = std::min(best[v], now() - t0);
      }
    printf("| %ld | %.2f | %.2f | %.2f | %s |\n", static_cast<long>(N), best[0] * 1e3, best[1] * 1e3, best[1] / best[0],
           std::memcmp(y0.data(), y1.data(), y0.size() * sizeof(float)) == 0 ? "yes" : "NO");
  }
}
