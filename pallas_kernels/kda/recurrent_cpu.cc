// The gated delta rule token by token on CPU, in place on a slot pool (pallas_kernels/kda/cpu_kernel.py).
//
// For every row r and head h, the state S = pool[layer, rows[r], h] ([dk, dv], zero first when
// fresh[r]) takes T tokens, each (spec 9.6):
//   S <- S * exp(g)[:, None];  err = v - S^T k;  S <- S + (beta k) err^T;  o = S^T q
// and is written back where it was read (the pool is aliased to the result: no copy of it).
// Rows outside [0, slots) are padding: their output is zero and no state is touched. Real rows are
// distinct slots (two jobs never write one state).
// Why native code: XLA:CPU runs the step as four or five fusions, each a pass over every row's
// state (32 rows x 8 heads x 64 KiB per layer on the mid config: 16 MiB, past the caches), so the
// step moved ~5x the state's bytes, and the engine gathered the rows out of the pool and scattered
// them back around it. Here each (row, head) state is visited per 64-column block, a block's two
// passes (decay + read-out of err, then the write and the read-out of o) on 32 KiB that stay in L1/L2.
// The columns of S are independent in every step, so blocks need no communication.
// Deterministic: every (row, head) is one job on one thread, sums in a fixed order.
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

using ling_tiles::L;
using ling_tiles::load8;
using ling_tiles::vf8;

inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }

inline vf8 splat(float x) { return vf8{x, x, x, x, x, x, x, x}; }

// One token on the columns [c0, c0 + NB*8) of one state s [dk, dv] (row stride dv).
template <int NB>
inline void token_block(float* s, int64_t dk, int64_t dv, int64_t c0, const float* eg, const float* k,
                        const float* q, const float* v, float beta, float* o) {
  vf8 acc[NB];
  for (int i = 0; i < NB; ++i) acc[i] = splat(0.f);
  for (int64_t a = 0; a < dk; ++a) {  // decay, and err's read-out S^T k
    float* row = s + a * dv + c0;
    const vf8 e = splat(eg[a]), kk = splat(k[a]);
    for (int i = 0; i < NB; ++i) {
      const vf8 x = load8(row + i * L) * e;
      store8(row + i * L, x);
      acc[i] += x * kk;
    }
  }
  vf8 w[NB];
  for (int i = 0; i < NB; ++i) {
    w[i] = (load8(v + c0 + i * L) - acc[i]) * splat(beta);
    acc[i] = splat(0.f);
  }
  for (int64_t a = 0; a < dk; ++a) {  // the write (beta k) err^T, and o's read-out S^T q
    float* row = s + a * dv + c0;
    const vf8 kk = splat(k[a]), qq = splat(q[a]);
    for (int i = 0; i < NB; ++i) {
      const vf8 x = load8(row + i * L) + kk * w[i];
      store8(row + i * L, x);
      acc[i] += x * qq;
    }
  }
  for (int i = 0; i < NB; ++i) store8(o + c0 + i * L, acc[i]);
}

// The same on single columns [c0, dv) (dv not a multiple of 8).
inline void token_scalar(float* s, int64_t dk, int64_t dv, int64_t c0, const float* eg, const float* k,
                         const float* q, const float* v, float beta, float* o) {
  for (int64_t c = c0; c < dv; ++c) {
    float acc = 0.f;
    for (int64_t a = 0; a < dk; ++a) {
      s[a * dv + c] *= eg[a];
      acc += s[a * dv + c] * k[a];
    }
    const float w = (v[c] - acc) * beta;
    acc = 0.f;
    for (int64_t a = 0; a < dk; ++a) {
      s[a * dv + c] += k[a] * w;
      acc += s[a * dv + c] * q[a];
    }
    o[c] = acc;
  }
}

ffi::Error KdaRecurrentImpl(ffi::Buffer<ffi::F32> pool_in, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> rows,
                            ffi::Buffer<ffi::S32> fresh, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                            ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                            ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> pool, int64_t threads) {
  // pool [..., S, H, dk, dv] (the leading dims: M stacked layers, none for one layer's state); q, k, g
  // [R, T, H, dk]; v [R, T, H, dv]; beta [R, T, H]. The pool keeps its stacked shape (no reshape on
  // the Python side: XLA copied a reshaped operand of this in-place call).
  const auto pd = pool_in.dimensions(), qd = q.dimensions(), vd = v.dimensions(), bd = beta.dimensions();
  auto same = [&](decltype(qd) a) {
    if (a.size() != qd.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i] != qd[i]) return false;
    return true;
  };
  if (pd.size() < 4 || qd.size() != 4 || vd.size() != 4 || bd.size() != 3 || !same(k.dimensions()) ||
      !same(g.dimensions()) || rows.element_count() != qd[0] || fresh.element_count() != qd[0] ||
      layer.element_count() != 1 || qd[2] != pd[pd.size() - 3] || qd[3] != pd[pd.size() - 2] || vd[0] != qd[0] ||
      vd[1] != qd[1] || vd[2] != qd[2] || vd[3] != pd[pd.size() - 1] || bd[0] != qd[0] || bd[1] != qd[1] || bd[2] != qd[2])
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_kda_recurrent: inconsistent shapes");
  const size_t nd = pd.size();
  int64_t M = 1;
  for (size_t i = 0; i + 4 < nd; ++i) M *= pd[i];
  const int64_t S = pd[nd - 4], H = pd[nd - 3], dk = pd[nd - 2], dv = pd[nd - 1], R = qd[0], T = qd[1];
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= M) return ffi::Error(ffi::ErrorCode::kOutOfRange, "ling_kda_recurrent: layer out of range");
  float* P = pool->typed_data();
  if (P != pool_in.typed_data())  // not aliased (XLA copied or gave another buffer): start from the input
    std::memcpy(P, pool_in.typed_data(), sizeof(float) * static_cast<size_t>(pool_in.element_count()));
  const int32_t* rw = rows.typed_data();
  const int32_t* fr = fresh.typed_data();
  const float *Q = q.typed_data(), *K = k.typed_data(), *V = v.typed_data(), *G = g.typed_data();
  const float* B = beta.typed_data();
  float* O = out->typed_data();
  const int64_t jobs = R * H;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(threads, jobs));
  std::atomic<int64_t> next{0};  // (row, head) jobs handed out one at a time: see latent_cpu.cc
  auto work = [&](int64_t) {
    std::vector<float> eg(static_cast<size_t>(dk));
    for (int64_t j; (j = next.fetch_add(1, std::memory_order_relaxed)) < jobs;) {
      const int64_t r = j / H, h = j % H, slot = rw[r];
      if (slot < 0 || slot >= S) {  // a padding row
        for (int64_t tt = 0; tt < T; ++tt) std::fill_n(O + ((r * T + tt) * H + h) * dv, dv, 0.f);
        continue;
      }
      float* s = P + (((l * S + slot) * H) + h) * dk * dv;
      if (fr[r]) std::fill_n(s, dk * dv, 0.f);
      for (int64_t tt = 0; tt < T; ++tt) {
        const int64_t at = (r * T + tt) * H + h;
        const float *qa = Q + at * dk, *ka = K + at * dk, *ga = G + at * dk, *va = V + at * dv;
        for (int64_t a = 0; a < dk; ++a) eg[a] = std::exp(ga[a]);
        float* o = O + at * dv;
        int64_t c = 0;
        for (; c + 8 * L <= dv; c += 8 * L) token_block<8>(s, dk, dv, c, eg.data(), ka, qa, va, B[at], o);
        for (; c + L <= dv; c += L) token_block<1>(s, dk, dv, c, eg.data(), ka, qa, va, B[at], o);
        if (c < dv) token_scalar(s, dk, dv, c, eg.data(), ka, qa, va, B[at], o);
      }
    }
  };
  std::vector<std::thread> ths;
  for (int64_t t = 1; t < nth; ++t) ths.emplace_back(work, t);
  work(0);
  for (auto& th : ths) th.join();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LingKdaRecurrent, KdaRecurrentImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
