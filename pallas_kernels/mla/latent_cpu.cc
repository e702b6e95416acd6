// Latent (absorbed-MLA) attention on CPU over a paged latent cache, as an XLA FFI custom call
// (pallas_kernels/mla/cpu_kernel.py).
//
// out[b,t,h,:] = Σ_τ p_τ c_τ,  p = softmax over τ < limit[b,t] of scale·(q_hat[b,t,h]·c_τ + q_pe[b,t,h]·kpe_τ)
// where key τ of sequence b lies at page block_table[b, τ / P], offset τ % P, of layer `layer` of the
// pools c_pages [..., n_pages, P, r] and kpe_pages [..., n_pages, P, dr] (leading dims flattened). A
// contiguous cache [B, S, r] is the case P = S, block_table[b] = {b}.
//
// Why native code: XLA:CPU runs a decode step's [H, S] x [S, r] product GEMV-shaped (~4 GB/s on a
// 64K-token cache) and its blockwise prefill loop at a fraction of its GEMM rate; here the keys are
// read once, in place (no gathered copy of the pages), in blocks of KB keys, with an online softmax
// (one block of scores at a time), a vectorised exp, and register tiles of four query rows by
// two to four vectors for both products; keys past a row's limit are never visited.
//
// Work items: (sequence, block of QB query rows t·H + h, key split). Decode-sized calls (T ≤
// SPLIT_MAX_T) split the keys into fixed spans of SPLIT keys so that one sequence's long cache keeps
// every thread busy; the partial (max, sum, accumulator) of each split are merged in split order.
// A row's arithmetic depends only on its own query and keys (the splits are fixed by key position,
// not by the batch), so a sequence alone and in a batch get the same bits.
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

// One vector of L float lanes: 16 (a 512-bit register) where the compiler targets AVX-512 (`-march=native`
// on such a host), 8 (256 bits) elsewhere. The arithmetic of a row still depends only on its own query
// and keys (batch invariance holds on every host); its bits differ between the two widths.
#if defined(__AVX512F__)
constexpr int64_t L = 16;
#else
constexpr int64_t L = 8;
#endif
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));
constexpr int64_t KB = 64;           // keys per block (one block of scores per row at a time)
constexpr int64_t SPLIT = 4096;      // keys per split of a decode-sized call
constexpr int64_t SPLIT_MAX_T = 8;   // calls with at most this many queries per sequence split keys
constexpr int64_t PREFETCH_L2 = 128;  // how far ahead (keys) a key's rows are prefetched into L2
constexpr float NEG = -1e30f;        // a finite minus infinity (masked scores)

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf splat(float x) { return x - vf{}; }

// exp on L lanes: x = n·ln2 + f, |f| ≤ ln2/2, e^f by the Cephes degree-5 minimax polynomial
// (≈1 ulp), 2^n through the exponent bits. Inputs below -87 give ~1e-38 (masked lanes are zeroed by
// the caller, not by underflow).
inline vf vexp(vf x) {
  const vf hi = splat(88.f), lo = splat(-87.f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.f);  // 1.5·2^23: adding it rounds to the nearest integer
  const vf t = x * splat(1.44269504088896341f) + magic;
  const vf n = t - magic;
  vi ni;
  std::memcpy(&ni, &t, sizeof ni);
  vi mi;
  std::memcpy(&mi, &magic, sizeof mi);
  ni = ni - mi;
  const vf f = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * f + splat(1.3981999507e-3f);
  p = p * f + splat(8.3334519073e-3f);
  p = p * f + splat(4.1665795894e-2f);
  p = p * f + splat(1.6666665459e-1f);
  p = p * f + splat(5.0000001201e-1f);
  p = p * (f * f) + f + splat(1.f);
  const vi e = (ni + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

struct Geometry {
  int64_t B, T, H, r, dr, n_pages, P, nb, QB;
  const float *q_hat, *q_pe, *c, *kpe;  // c, kpe: this layer's pages
  const int32_t *bt, *limit;
  float scale;
};

struct Item {
  int64_t b, rb, k0, k1;  // sequence, row block, keys [k0, k1)
  int64_t part;           // index of its partial result
};

struct Scratch {
  std::vector<float> qs, kt, s;
  std::vector<const float*> crow, krow, lines;
};

// s[i][0:KB] = qs[i] · kT[:, 0:KB] for i < R (R a multiple of 4): four rows by two L-key vectors.
void scores(const float* qs, const float* kt, int64_t R, int64_t d, float* s) {
  for (int64_t i = 0; i < R; i += 4)
    for (int64_t j = 0; j < KB; j += 2 * L) {
      vf a[4][2];
      for (int u = 0; u < 4; ++u) a[u][0] = a[u][1] = vf{};
      for (int64_t e = 0; e < d; ++e) {
        const vf k0 = loadv(kt + e * KB + j), k1 = loadv(kt + e * KB + j + L);
        for (int u = 0; u < 4; ++u) {
          const vf q = splat(qs[(i + u) * d + e]);
          a[u][0] += q * k0;
          a[u][1] += q * k1;
        }
      }
      for (int u = 0; u < 4; ++u) {
        storev(s + (i + u) * KB + j, a[u][0]);
        storev(s + (i + u) * KB + j + L, a[u][1]);
      }
    }
}

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// {Σ v[0], ..., Σ v[L-1]}: L horizontal sums as one vector. Round s (s = 1, 2, 4, ...) adds lanes s
// apart and interleaves two vectors' sums in blocks of s lanes; log2(L) rounds of shuffles and adds.
#if defined(__AVX512F__)
inline vf hsum(const vf* v) {
  vf t[8], u[4], w[2];
  for (int a = 0; a < 8; ++a)
    t[a] = SHUF(v[2 * a], v[2 * a + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SHUF(v[2 * a], v[2 * a + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  for (int a = 0; a < 4; ++a)
    u[a] = SHUF(t[2 * a], t[2 * a + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUF(t[2 * a], t[2 * a + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  for (int a = 0; a < 2; ++a)
    w[a] = SHUF(u[2 * a], u[2 * a + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUF(u[2 * a], u[2 * a + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  return SHUF(w[0], w[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUF(w[0], w[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
#else
inline vf hsum(const vf* v) {
  vf t[4], u[2];
  for (int a = 0; a < 4; ++a)
    t[a] = SHUF(v[2 * a], v[2 * a + 1], 0, 8, 2, 10, 4, 12, 6, 14) + SHUF(v[2 * a], v[2 * a + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int a = 0; a < 2; ++a)
    u[a] = SHUF(t[2 * a], t[2 * a + 1], 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(t[2 * a], t[2 * a + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}
#endif

// One cache line prefetched into L2 (`prefetcht2`). On x86-64 an `asm volatile` instruction: GCC
// deletes a loop whose body is only `__builtin_prefetch` (it has no side effect), which left this
// kernel with no software prefetch at all.
inline void prefetch_l2(const float* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// The cache lines of the keys a few blocks ahead, prefetched a few at a time between the arithmetic of
// the current block (decode / verify), not all at once before it. Why: a burst of a block's ~256 line
// prefetches fills the core's outstanding-miss slots, so the core waits for memory at the burst and then
// computes with nothing in flight — compute and memory time added up (a 256K-key decode call over a pool
// out of cache, 2 cores: 4.6-5.2 ms, against 2.2-2.9 ms with its keys in L2). Issued a few per step of
// the block's dot products and P·V: 3.0-3.7 ms (thirty-eighth session, BENCHMARKS.md).
struct LineQueue {
  const float* const* line = nullptr;
  int64_t n = 0, next = 0;
  int64_t left() const { return n - next; }
  void issue(int64_t k) {
    for (const int64_t end = std::min(n, next + k); next < end;) prefetch_l2(line[next++]);
  }
};

// The few-row form of `scores` (decode / verify: R ≤ 8 rows), with no transposed copy of the keys:
// s[i][j] = qs[i] · key_j for j < nk (key_j = [crow[j] ; krow[j]], r and dr multiples of L), L
// keys at a time, each key's products over d in its own vector, summed by `hsum`; zeros past nk.
// Issues `lines` of `pf` spread over its R · KB / L steps.
void scores_few(const float* qs, const float* const* crow, const float* const* krow, int64_t nk, int64_t R,
                int64_t r, int64_t dr, float* s, LineQueue& pf, int64_t lines) {
  const int64_t per = (lines + R * (KB / L) - 1) / (R * (KB / L));
  for (int64_t j0 = 0; j0 < KB; j0 += L) {
    if (j0 >= nk) {
      for (int64_t i = 0; i < R; ++i) storev(s + i * KB + j0, vf{});
      continue;
    }
    const int64_t n = std::min<int64_t>(L, nk - j0);
    const float* cr[L];
    const float* kr[L];
    for (int u = 0; u < L; ++u) {  // past nk: any valid row (its score is never used)
      cr[u] = crow[j0 + (u < n ? u : 0)];
      kr[u] = krow[j0 + (u < n ? u : 0)];
    }
    for (int64_t i = 0; i < R; ++i) {  // each query vector loaded once per L keys
      const float* q = qs + i * (r + dr);
      vf a[L];
      for (int u = 0; u < L; ++u) a[u] = vf{};
      for (int64_t e = 0; e < r; e += L) {
        const vf qv = loadv(q + e);
        for (int u = 0; u < L; ++u) a[u] += qv * loadv(cr[u] + e);
      }
      for (int64_t e = 0; e < dr; e += L) {
        const vf qv = loadv(q + r + e);
        for (int u = 0; u < L; ++u) a[u] += qv * loadv(kr[u] + e);
      }
      storev(s + i * KB + j0, hsum(a));
      pf.issue(per);
    }
  }
}

// acc[i][0:r] += Σ_{j<nk} p[i][j] · crow[j][0:r] for i < R (multiple of 4): four rows by NV vectors.
// Issues `lines` of `pf` spread over its keys.
template <int NV>
inline void pv_tile(const float* p, const float* const* crow, int64_t nk, int64_t i, int64_t col, int64_t r,
                    float* acc, LineQueue& pf, int64_t lines) {
  const int64_t per = (lines + nk - 1) / std::max<int64_t>(nk, 1), stop = pf.next + lines;
  vf a[4][NV];
  for (int u = 0; u < 4; ++u)
    for (int v = 0; v < NV; ++v) a[u][v] = loadv(acc + (i + u) * r + col + v * L);
  for (int64_t j = 0; j < nk; ++j) {
    vf cv[NV];
    for (int v = 0; v < NV; ++v) cv[v] = loadv(crow[j] + col + v * L);
    for (int u = 0; u < 4; ++u) {
      const vf pu = splat(p[(i + u) * KB + j]);
      for (int v = 0; v < NV; ++v) a[u][v] += pu * cv[v];
    }
    pf.issue(std::min(per, stop - pf.next));
  }
  for (int u = 0; u < 4; ++u)
    for (int v = 0; v < NV; ++v) storev(acc + (i + u) * r + col + v * L, a[u][v]);
}

// ... and issues what is left of `pf`, each tile its share of the columns still to do.
void pv(const float* p, const float* const* crow, int64_t nk, int64_t R, int64_t r, float* acc, LineQueue& pf) {
  // lines for a tile of `cols` columns at rows i.., column col
  auto share = [&](int64_t i, int64_t col, int64_t cols) {
    const int64_t rest = (R - i) / 4 * r - col;
    return (pf.left() * cols + rest - 1) / rest;
  };
  for (int64_t i = 0; i < R; i += 4) {
    int64_t col = 0;
    for (; col + 4 * L <= r; col += 4 * L) pv_tile<4>(p, crow, nk, i, col, r, acc, pf, share(i, col, 4 * L));
    // the rest in one pass over the keys (r = 48 with 16 lanes: one 3-vector tile, not 2 + 1)
    if (col + 3 * L <= r) {
      pv_tile<3>(p, crow, nk, i, col, r, acc, pf, share(i, col, 3 * L));
      col += 3 * L;
    } else if (col + 2 * L <= r) {
      pv_tile<2>(p, crow, nk, i, col, r, acc, pf, share(i, col, 2 * L));
      col += 2 * L;
    }
    for (; col + L <= r; col += L) pv_tile<1>(p, crow, nk, i, col, r, acc, pf, share(i, col, L));
    for (; col < r; ++col)
      for (int u = 0; u < 4; ++u) {
        float a = acc[(i + u) * r + col];
        for (int64_t j = 0; j < nk; ++j) a += p[(i + u) * KB + j] * crow[j][col];
        acc[(i + u) * r + col] = a;
      }
  }
}

// f(c, k, n) for each page's run of keys [a, b) of one sequence (block table `bt`): n keys whose rows
// lie contiguous in both pools, from c (r floats a key) and k (dr floats a key).
template <class F>
inline void page_runs(const Geometry& g, const int32_t* bt, int64_t a, int64_t b, F&& f) {
  for (int64_t pg = a / g.P, off = a % g.P; a < b; ++pg, off = 0) {
    const int64_t n = std::min(g.P - off, b - a);
    const int64_t slot = static_cast<int64_t>(bt[pg]) * g.P + off;
    f(g.c + slot * g.r, g.kpe + slot * g.dr, n);
    a += n;
  }
}

// The cache lines of keys [a, b) of one sequence into `out`; returns their number.
inline int64_t key_lines(const Geometry& g, const int32_t* bt, int64_t a, int64_t b, const float** out) {
  int64_t m = 0;
  page_runs(g, bt, a, b, [&](const float* c, const float* k, int64_t n) {
    for (int64_t e = 0; e < n * g.r; e += 16) out[m++] = c + e;
    for (int64_t e = 0; e < n * g.dr; e += 16) out[m++] = k + e;
  });
  return m;
}

// One line in every 4 KiB of each page run of keys [a, b) of one sequence, and the run's last line, prefetched
// now (decode / verify, before the block's spread `LineQueue`): each run's memory pages then start their
// translation and their first reads together, not one after another as the spread queue reaches them. A
// 256K-key decode call over shuffled pages (a pool after churn), 2 cores: -8 to -12%; pages in order: 0 to -5%;
// keys in cache: level (thirty-ninth session, BENCHMARKS.md).
inline void prefetch_run_heads(const Geometry& g, const int32_t* bt, int64_t a, int64_t b) {
  constexpr int64_t STRIDE = 4096 / sizeof(float);
  page_runs(g, bt, a, b, [&](const float* c, const float* k, int64_t n) {
    for (int64_t e = 0; e < n * g.r; e += STRIDE) prefetch_l2(c + e);
    prefetch_l2(c + n * g.r - 1);
    for (int64_t e = 0; e < n * g.dr; e += STRIDE) prefetch_l2(k + e);
    prefetch_l2(k + n * g.dr - 1);
  });
}

// One item: rows [rb·QB, rb·QB + QB) of sequence b against keys [k0, k1); writes m, l [QB] and
// acc [QB, r] (unnormalised).
void run_item(const Geometry& g, const Item& it, float* m, float* l, float* acc, Scratch& s) {
  const int64_t d = g.r + g.dr, rows = g.T * g.H;
  const int64_t row0 = it.rb * g.QB, R = g.QB;  // R is a multiple of 4
  s.qs.assign(static_cast<size_t>(R * d), 0.f);
  s.kt.resize(static_cast<size_t>(d * KB));
  s.s.resize(static_cast<size_t>(R * KB));
  s.crow.resize(KB);
  s.krow.resize(KB);
  s.lines.resize(static_cast<size_t>(KB * ((g.r + 15) / 16 + (g.dr + 15) / 16)));  // one block's lines
  // the few-row form needs r and dr in whole L-lane vectors
  const bool few = R <= 8 && g.r % L == 0 && g.dr % L == 0;
  std::vector<int64_t> lim(static_cast<size_t>(R), 0);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t row = row0 + i;
    m[i] = NEG;
    l[i] = 0.f;
    std::fill(acc + i * g.r, acc + (i + 1) * g.r, 0.f);
    if (row >= rows) continue;  // padding rows of the last block: no keys
    const int64_t t = row / g.H, h = row % g.H;
    lim[i] = g.limit[it.b * g.T + t];
    const float* qh = g.q_hat + ((it.b * g.T + t) * g.H + h) * g.r;
    const float* qp = g.q_pe + ((it.b * g.T + t) * g.H + h) * g.dr;
    for (int64_t e = 0; e < g.r; ++e) s.qs[i * d + e] = qh[e] * g.scale;
    for (int64_t e = 0; e < g.dr; ++e) s.qs[i * d + g.r + e] = qp[e] * g.scale;
  }
  float* sc = s.s.data();
  const int32_t* bt = g.bt + it.b * g.nb;
  for (int64_t kb0 = it.k0; kb0 < it.k1; kb0 += KB) {
    const int64_t nk = std::min(KB, it.k1 - kb0);
    int64_t got = 0;  // where this block's keys lie: one page's run of keys at a time through the block table
    page_runs(g, bt, kb0, kb0 + nk, [&](const float* c, const float* k, int64_t n) {
      for (int64_t t = 0; t < n; ++t, ++got) {
        s.crow[got] = c + t * g.r;
        s.krow[got] = k + t * g.dr;
      }
    });
    // and the keys PREFETCH_L2 ahead of this block's into L2 (not into L1: the block being scored is
    // reread from L1 by every query row and by P·V, and a whole next block fetched into L1 evicted it).
    // Pages anywhere in the pool defeat the hardware prefetcher at each page boundary. Decode / verify
    // spread the lines over the block's arithmetic, half in the dot products and half in P·V (LineQueue),
    // after one line per 4 KiB of each page run at once (`prefetch_run_heads`);
    // prefill issues them before its block (64 query rows: 8-16x a decode block's arithmetic).
    // Thirtieth session (2-core AVX-512 host, 256K keys, ms): per page run instead of per key, keys in L2
    // 2.86 -> 2.2; an L1 prefetch besides costs +0.3 there and gains nothing (BENCHMARKS.md).
    const int64_t ahead0 = kb0 + PREFETCH_L2, ahead1 = std::min(kb0 + PREFETCH_L2 + nk, it.k1);
    LineQueue pf{s.lines.data(), key_lines(g, bt, ahead0, ahead1, s.lines.data()), 0};
    if (few) {  // decode / verify: dot products straight from the pages
      prefetch_run_heads(g, bt, ahead0, ahead1);
      scores_few(s.qs.data(), s.crow.data(), s.krow.data(), nk, R, g.r, g.dr, sc, pf, pf.n / 2);
    } else {  // prefill: the block's keys transposed to [d, KB] once (zeros past nk), then tiles
      pf.issue(pf.n);
      for (int64_t j = 0; j < KB; ++j) {
        if (j < nk) {
          const float* cr = s.crow[j];
          const float* kr = s.krow[j];
          for (int64_t e = 0; e < g.r; ++e) s.kt[e * KB + j] = cr[e];
          for (int64_t e = 0; e < g.dr; ++e) s.kt[(g.r + e) * KB + j] = kr[e];
        } else {
          for (int64_t e = 0; e < d; ++e) s.kt[e * KB + j] = 0.f;
        }
      }
      scores(s.qs.data(), s.kt.data(), R, d, sc);
    }
    for (int64_t i = 0; i < R; ++i) {  // online softmax: this block's probabilities, rescaled history
      float* si = sc + i * KB;
      const int64_t vis = std::max<int64_t>(0, std::min<int64_t>(nk, lim[i] - kb0));  // keys j < vis are visible
      if (vis == 0) {
        std::fill(si, si + KB, 0.f);
        continue;
      }
      // max, exp and sum on L lanes (scalar chains of 64 dependent steps were a third of a decode)
      const int64_t whole = vis / L * L;  // keys in whole visible vectors
      float mx = m[i];
      if (whole > 0) {
        vf vm = loadv(si);
        for (int64_t j = L; j < whole; j += L) {
          const vf v = loadv(si + j);
          vm = v > vm ? v : vm;
        }
        for (int l = 0; l < L; ++l) mx = std::max(mx, vm[l]);
      }
      for (int64_t j = whole; j < vis; ++j) mx = std::max(mx, si[j]);
      vf vs = vf{};
      for (int64_t j = 0; j < whole; j += L) {
        const vf p = vexp(loadv(si + j) - splat(mx));
        storev(si + j, p);
        vs += p;
      }
      float sum = 0.f;
      for (int l = 0; l < L; ++l) sum += vs[l];
      for (int64_t j = whole; j < KB; ++j) {  // the partly visible vector, then zeros
        si[j] = j < vis ? std::exp(si[j] - mx) : 0.f;
        sum += si[j];
      }
      if (mx != m[i]) {
        const float alpha = std::exp(m[i] - mx);
        l[i] *= alpha;
        for (int64_t e = 0; e < g.r; ++e) acc[i * g.r + e] *= alpha;
        m[i] = mx;
      }
      l[i] += sum;
    }
    pv(sc, s.crow.data(), nk, R, g.r, acc, pf);
    pf.issue(pf.left());  // none left unless r < L (no vector tile)
  }
}

ffi::Error LatentAttentionImpl(ffi::Buffer<ffi::F32> q_hat, ffi::Buffer<ffi::F32> q_pe, ffi::Buffer<ffi::F32> c_pages,
                               ffi::Buffer<ffi::F32> kpe_pages, ffi::Buffer<ffi::S32> block_table,
                               ffi::Buffer<ffi::S32> limit, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::F32> scale,
                               ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  const auto qd = q_hat.dimensions(), pd = q_pe.dimensions(), cd = c_pages.dimensions();
  const auto kd = kpe_pages.dimensions(), bd = block_table.dimensions(), ld = limit.dimensions();
  if (qd.size() != 4 || pd.size() != 4 || cd.size() < 3 || kd.size() != cd.size() || bd.size() != 2 ||
      ld.size() != 2 || pd[0] != qd[0] || pd[1] != qd[1] || pd[2] != qd[2] || bd[0] != qd[0] || ld[0] != qd[0] ||
      ld[1] != qd[1] || cd[cd.size() - 1] != qd[3] || kd[kd.size() - 1] != pd[3] || layer.element_count() != 1 ||
      scale.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_latent_attention: inconsistent shapes");
  for (size_t a = 0; a + 1 < cd.size(); ++a)
    if (cd[a] != kd[a]) return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_latent_attention: pools differ");
  Geometry g;
  g.B = qd[0];
  g.T = qd[1];
  g.H = qd[2];
  g.r = qd[3];
  g.dr = pd[3];
  g.P = cd[cd.size() - 2];
  g.n_pages = cd[cd.size() - 3];
  g.nb = bd[1];
  int64_t n_layers = 1;
  for (size_t a = 0; a + 3 < cd.size(); ++a) n_layers *= cd[a];
  const int64_t lay = layer.typed_data()[0];
  if (lay < 0 || lay >= n_layers)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_latent_attention: layer out of range");
  g.c = c_pages.typed_data() + lay * g.n_pages * g.P * g.r;
  g.kpe = kpe_pages.typed_data() + lay * g.n_pages * g.P * g.dr;
  g.q_hat = q_hat.typed_data();
  g.q_pe = q_pe.typed_data();
  g.bt = block_table.typed_data();
  g.limit = limit.typed_data();
  g.scale = scale.typed_data()[0];
  const int64_t rows = g.T * g.H;
  g.QB = g.T <= SPLIT_MAX_T ? std::min<int64_t>(32, (rows + 3) / 4 * 4) : 64;
  const int64_t n_rb = (rows + g.QB - 1) / g.QB, max_keys = g.nb * g.P;
  std::vector<Item> items;
  std::vector<int64_t> first(static_cast<size_t>(g.B * n_rb + 1), 0);  // items of (b, rb) start here
  int64_t work = 0;
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t rb = 0; rb < n_rb; ++rb) {
      first[b * n_rb + rb] = static_cast<int64_t>(items.size());
      int64_t top = 0;  // the furthest key any row of the block sees (clamped to the table)
      for (int64_t row = rb * g.QB; row < std::min(rows, (rb + 1) * g.QB); ++row)
        top = std::max<int64_t>(top, g.limit[b * g.T + row / g.H]);
      top = std::min(top, max_keys);
      const int64_t span = g.T <= SPLIT_MAX_T ? SPLIT : std::max<int64_t>(top, 1);
      for (int64_t k0 = 0; k0 < std::max<int64_t>(top, 1); k0 += span) {
        items.push_back({b, rb, k0, std::min(top, k0 + span), static_cast<int64_t>(items.size())});
        work += (std::min(top, k0 + span) - k0) * g.QB;
      }
    }
  first[g.B * n_rb] = static_cast<int64_t>(items.size());
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::vector<float> pm(static_cast<size_t>(n_items * g.QB)), pl(pm.size()), pacc(static_cast<size_t>(n_items * g.QB * g.r));
  // threads only when there is enough work to pay for starting them (~65K row-key pairs)
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>({threads, n_items, 1 + work / (1 << 16)}));
  // items handed out one at a time (not a fixed split): a thread the OS takes away for a while (a
  // server's HTTP thread, a co-located client) delays the call by one item, not by its share
  std::atomic<int64_t> next{0};
  auto run = [&](int64_t) {
    Scratch s;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const Item& it = items[static_cast<size_t>(i)];
      run_item(g, it, pm.data() + it.part * g.QB, pl.data() + it.part * g.QB, pacc.data() + it.part * g.QB * g.r, s);
    }
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < nt; ++t) pool.emplace_back(run, t);
  run(0);
  for (auto& th : pool) th.join();
  float* o = out->typed_data();
  std::vector<float> accum(static_cast<size_t>(g.r));
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t rb = 0; rb < n_rb; ++rb) {
      const int64_t i0 = first[b * n_rb + rb], i1 = first[b * n_rb + rb + 1];
      for (int64_t i = 0; i < g.QB; ++i) {
        const int64_t row = rb * g.QB + i;
        if (row >= rows) break;
        float mx = NEG;
        for (int64_t it = i0; it < i1; ++it) mx = std::max(mx, pm[it * g.QB + i]);
        std::fill(accum.begin(), accum.end(), 0.f);
        float sum = 0.f;
        for (int64_t it = i0; it < i1; ++it) {  // splits merged in key order
          const float lv = pl[it * g.QB + i];
          if (lv == 0.f) continue;
          const float w = std::exp(pm[it * g.QB + i] - mx);
          sum += w * lv;
          const float* a = pacc.data() + (it * g.QB + i) * g.r;
          for (int64_t e = 0; e < g.r; ++e) accum[e] += w * a[e];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a row that sees no key gives zeros
        float* dst = o + (b * g.T * g.H + row) * g.r;
        for (int64_t e = 0; e < g.r; ++e) dst[e] = accum[e] * inv;
      }
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LingLatentAttention, LatentAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
