// Register tiles shared by the native CPU kernels (float32, 8-lane vectors): the dot form (two weight
// rows against up to four activation rows, `dot_rows`) and the GEMM form with the tokens across the
// lanes (`class_gemm`), which computes the same sums in the same order (bit-identical results).
// Included by experts/experts_decode.cc, linear/table_linear.cc and (the vector type)
// kda/recurrent_cpu.cc; `pallas_kernels.native` keys a kernel's build on the headers it includes too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace ling_tiles {

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

}  // namespace ling_tiles
