// Register tiles shared by the native CPU kernels (float32, 8-lane vectors): the dot form (two weight
// rows against up to four activation rows, `dot_rows`) and the packed-panel GEMM form (`panel_gemm` over
// [out, in] rows, `packed_gemm` over weights stored already packed), which computes the same sums in the
// same order (bit-identical results).
// Included by experts/experts_decode.cc, linear/table_linear.cc and (the vector type)
// kda/recurrent_cpu.cc; `pallas_kernels.native` keys a kernel's build on the headers it includes too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>
#endif

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


// ---- Many rows: the same sums as dot_tile, as a packed-panel GEMM (the weight rows across the lanes). ----
// dot_tile's value for (weight row o, activation row t) is: eight lane sums p_l = sum_j w[8j+l] x[8j+l]
// (FMA chains, j ascending), then ((((0 + p_0) + p_1) + ...) + p_7), then the tail d >= 8 floor(K/8)
// added in order. Here both operands are packed in lane-class order e (e = l K8 + j holds element
// 8j + l, then the tail elements in order): activations [K][PM] per PM rows (once per call), weights
// [K][PW] per PW rows (one panel at a time, inside the call: the weight is read where it is stored,
// once). A tile of PM activation rows by PW weight rows sums lane class l's FMA chain over j in 12
// accumulators (+ 2 weight vectors + 1 broadcast: AVX2's 16 registers), adds it to the running sum
// in order l = 0..7, then the tail: the same operations on the same values as dot_tile, so the bits
// equal the dot form's, and a row's result does not depend on which rows share its call. Why: the
// previous GEMM form (tokens across the lanes, weights broadcast, 24 accumulators) spilled on AVX2 and
// re-read each weight row 8 times with a stride of 8: on a Zen 3 host a [1024, 1024] layer over 512
// rows took 14.8 ms against XLA's 7.1; this form 8.2 (tools/bench_small_matmul.py --table).
constexpr int PM = 6;          // activation rows per tile
constexpr int64_t PW = 2 * L;  // weight rows per tile

// Packs rows r < m of x (row r at rows[r], K elements) into ap [K][width] in lane-class order; rows
// m..width-1 zero. With AVX, 8 rows at a time through an 8 x 8 register transpose (a scalar pack ran
// at ~4 GB/s, as slow as the whole product at 16 rows).
inline void pack_panel(const float* const* rows, int64_t m, int64_t K, int64_t width, float* ap) {
  const int64_t K8 = K / L;
  int64_t r0 = 0;
#if defined(__AVX__)
  for (; r0 + 8 <= m; r0 += 8) {
    const float* const* v = rows + r0;
    for (int64_t j = 0; j < K8; ++j) {
      __m256 a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(v[i] + L * j);
      for (int i = 0; i < 8; i += 2) {
        b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      }
      a[0] = _mm256_shuffle_ps(b[0], b[2], 0x44);
      a[1] = _mm256_shuffle_ps(b[0], b[2], 0xEE);
      a[2] = _mm256_shuffle_ps(b[1], b[3], 0x44);
      a[3] = _mm256_shuffle_ps(b[1], b[3], 0xEE);
      a[4] = _mm256_shuffle_ps(b[4], b[6], 0x44);
      a[5] = _mm256_shuffle_ps(b[4], b[6], 0xEE);
      a[6] = _mm256_shuffle_ps(b[5], b[7], 0x44);
      a[7] = _mm256_shuffle_ps(b[5], b[7], 0xEE);
      for (int i = 0; i < 4; ++i) {  // a[i]: lanes 0-3 element i of rows 0-3, lanes 4-7 element i + 4
        b[i] = _mm256_permute2f128_ps(a[i], a[i + 4], 0x20);
        b[i + 4] = _mm256_permute2f128_ps(a[i], a[i + 4], 0x31);
      }
      for (int l = 0; l < 8; ++l) _mm256_storeu_ps(ap + (l * K8 + j) * width + r0, b[l]);
    }
    for (int64_t d = L * K8; d < K; ++d)
      for (int64_t r = 0; r < 8; ++r) ap[d * width + r0 + r] = v[r][d];
  }
#endif
  for (int64_t r = r0; r < width; ++r) {
    float* o = ap + r;
    if (r >= m) {
      for (int64_t e = 0; e < K; ++e) o[e * width] = 0.f;
      continue;
    }
    const float* v = rows[r];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t j = 0; j < K8; ++j) o[(l * K8 + j) * width] = v[L * j + l];
    for (int64_t d = L * K8; d < K; ++d) o[d * width] = v[d];
  }
}

// s[t][.] += (FMA chain over j < n, from zero, of a[j PM + t] b[j PW + .]) for t < PM: one lane class's
// pass of a tile. Not inlined: inlined, GCC 12 kept part of s in registers and spilled the loop's pointers.
__attribute__((noinline)) inline void panel_pass(const float* __restrict a, const float* __restrict b, int64_t n,
                                                 vf8 (*__restrict s)[2]) {
  vf8 A0 = {}, A1 = {}, A2 = {}, A3 = {}, A4 = {}, A5 = {}, B0 = {}, B1 = {}, B2 = {}, B3 = {}, B4 = {}, B5 = {};
  for (int64_t j = 0; j < n; ++j, a += PM, b += PW) {
    const vf8 w0 = load8(b), w1 = load8(b + L);
    A0 += a[0] * w0; B0 += a[0] * w1;
    A1 += a[1] * w0; B1 += a[1] * w1;
    A2 += a[2] * w0; B2 += a[2] * w1;
    A3 += a[3] * w0; B3 += a[3] * w1;
    A4 += a[4] * w0; B4 += a[4] * w1;
    A5 += a[5] * w0; B5 += a[5] * w1;
  }
  s[0][0] = s[0][0] + A0; s[0][1] = s[0][1] + B0;
  s[1][0] = s[1][0] + A1; s[1][1] = s[1][1] + B1;
  s[2][0] = s[2][0] + A2; s[2][1] = s[2][1] + B2;
  s[3][0] = s[3][0] + A3; s[3][1] = s[3][1] + B3;
  s[4][0] = s[4][0] + A4; s[4][1] = s[4][1] + B4;
  s[5][0] = s[5][0] + A5; s[5][1] = s[5][1] + B5;
}
static_assert(PM == 6, "panel_pass is written out for six activation rows");

// Packs activation rows rows[0..N) (K elements each) for panel_gemm: ceil(N / PM) panels of [K][PM].
inline void pack_activations(const float* const* rows, int64_t N, int64_t K, std::vector<float>& ap) {
  const int64_t np = (N + PM - 1) / PM;
  ap.resize(static_cast<size_t>(np * PM * K));
  for (int64_t p = 0; p < np; ++p)
    pack_panel(rows + p * PM, std::min<int64_t>(PM, N - p * PM), K, PM, ap.data() + p * PM * K);
}

// panel_pass over the first P < PM rows of a panel (its other rows are padding): the same chains for
// those rows, without the padding rows' FMAs (a panel of one token does 2 a step, not 12).
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

// One lane class's pass over a panel holding `rows` real activation rows (1 .. PM).
inline void pass_rows(int64_t rows, const float* a, const float* b, int64_t n, vf8 (*s)[2]) {
  switch (rows) {
    case 1: return part_pass<1>(a, b, n, s);
    case 2: return part_pass<2>(a, b, n, s);
    case 3: return part_pass<3>(a, b, n, s);
    case 4: return part_pass<4>(a, b, n, s);
    case 5: return part_pass<5>(a, b, n, s);
    default: return panel_pass(a, b, n, s);
  }
}

// out[n * ostride + o0 + r] for r < mo, n < N: weight panel bp ([K][PW], pack_panel's order) against every
// activation panel of ap (pack_activations); s: scratch of ceil(N / PM) panels' sums. For each lane class l
// every activation panel runs against the panel's pass slice (K/8 x PW floats, in L1), summing into s.
inline void panel_product(const float* bp, int64_t mo, int64_t o0, int64_t K, const float* ap, int64_t N, float* out,
                          int64_t ostride, std::vector<vf8>& sbuf) {
  const int64_t K8 = K / L, np = (N + PM - 1) / PM;
  sbuf.assign(static_cast<size_t>(np * PM * 2), vf8{});
  auto* s = reinterpret_cast<vf8(*)[PM][2]>(sbuf.data());
  for (int64_t l = 0; l < L; ++l)
    for (int64_t p = 0; p < np; ++p)
      pass_rows(std::min<int64_t>(PM, N - p * PM), ap + p * PM * K + l * K8 * PM, bp + l * K8 * PW, K8, s[p]);
  for (int64_t p = 0; p < np; ++p) {
    const float* a = ap + p * PM * K;
    for (int64_t d = L * K8; d < K; ++d) {
      const vf8 b0 = load8(bp + d * PW), b1 = load8(bp + d * PW + L);
      for (int t = 0; t < PM; ++t)
        for (int q = 0; q < L; ++q) {
          s[p][t][0][q] = __builtin_fmaf(b0[q], a[d * PM + t], s[p][t][0][q]);
          s[p][t][1][q] = __builtin_fmaf(b1[q], a[d * PM + t], s[p][t][1][q]);
        }
    }
    for (int64_t t = 0; t < std::min<int64_t>(PM, N - p * PM); ++t) {
      float row[PW];
      std::memcpy(row, &s[p][t][0], sizeof(vf8));
      std::memcpy(row + L, &s[p][t][1], sizeof(vf8));
      std::memcpy(out + (p * PM + t) * ostride + o0, row, static_cast<size_t>(mo) * sizeof(float));
    }
  }
}

// out[n * ostride + o] = dot_tile's sum of weight row o of w [O][K] (read in place) with activation row
// n < N (ap from pack_activations): per panel of PW weight rows, pack it, then `panel_product`.
// (Prefetching the next panel's rows during the passes was tried: no change at 16 or 64 rows; again in
// the thirty-fifth session: -1 to -4% at 128-512 rows of the experts kernel, worse at 16 in the linear one.)
inline void panel_gemm(const float* w, int64_t O, int64_t K, const float* ap, int64_t N, float* out,
                       int64_t ostride) {
  std::vector<float> bp(static_cast<size_t>(PW * K));
  std::vector<vf8> sbuf;
  const float* rows[PW];
  for (int64_t o0 = 0; o0 < O; o0 += PW) {
    const int64_t mo = std::min<int64_t>(PW, O - o0);
    for (int64_t r = 0; r < mo; ++r) rows[r] = w + (o0 + r) * K;
    pack_panel(rows, mo, K, PW, bp.data());
    panel_product(bp.data(), mo, o0, K, ap, N, out, ostride, sbuf);
  }
}

// panel_gemm over a weight stored packed ([O / PW] panels of [K][PW] in pack_panel's order, back to back;
// O a multiple of PW): nothing packed in the call, the panels read in place. Same bits as panel_gemm.
inline void packed_gemm(const float* wp, int64_t O, int64_t K, const float* ap, int64_t N, float* out,
                        int64_t ostride) {
  std::vector<vf8> sbuf;
  for (int64_t o0 = 0; o0 < O; o0 += PW) panel_product(wp + o0 * K, PW, o0, K, ap, N, out, ostride, sbuf);
}

}  // namespace ling_tiles
