// One layer's linear layer read in place from its scanned run's stacked weights, as an XLA FFI custom
// call (pallas_kernels/linear/cpu_kernel.py).
//
// out[n, o] = sum_k table[b + o, k] * x[n, k] for o < O, b = base clamped to [0, R - O] (what
// `lax.dynamic_slice` of rows [b, b + O) reads). Why: inside a scanned layer loop a layer's weight is a
// dynamic slice of the run's stack [repeats * n * O, K], and XLA:CPU copies such a slice before the dot
// that reads it, so a decode step streamed every dense weight twice (and wrote it once); here the rows
// are read where they are stored. Few activation rows (decode, verify): `dot_rows` tiles of two weight
// rows by four activation rows; from kGemmRows rows the packed-panel GEMM (`panel_gemm`, native_tiles.h:
// the same sums in the same order, so a row's result never depends on how many rows share the call).
// The weight rows are split over the caller and persistent worker threads (each output element is
// written by one thread): deterministic whatever the split. LingTableHeads: the per-head form MLA's
// absorbed attention applies kv_b_proj with (W_UK rows contracted, W_UV rows as outputs; TableHeadsImpl).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <cstdint>
#include <thread>
#include <unistd.h>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "../native_tiles.h"

namespace ffi = xla::ffi;

namespace {

using namespace ling_tiles;

// From this many activation rows the GEMM form (the experts kernel's threshold, measured there).
constexpr int64_t kGemmRows = 12;
// Below this many weight elements the calling thread does it all (waking a worker costs ~10-30 us).
constexpr int64_t kThreadElems = 1 << 18;

// Runs fn(chunk) for chunks [0, n_chunks) on the caller and `threads - 1` persistent workers (chunks
// handed out one at a time). Why persistent: a decode step makes a few hundred such calls of
// 0.1-1 ms, and starting a thread per call cost ~30-60 us of each. One call at a time uses the
// workers; a concurrent caller (XLA may run two independent custom calls at once) runs inline.
class Workers {
 public:
  explicit Workers(int64_t n) {
    for (int64_t t = 0; t < n; ++t) threads_.emplace_back([this] { loop(); });
  }
  ~Workers() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int64_t size() const { return static_cast<int64_t>(threads_.size()); }
  std::mutex& caller() { return caller_mu_; }
  // Publishes `work` to the workers, runs it on the calling thread too, waits for the workers.
  void run(const std::function<void()>& work) {
    {
      std::lock_guard<std::mutex> g(mu_);
      work_ = &work;
      pending_ = static_cast<int>(threads_.size());
      ++gen_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [this] { return pending_ == 0; });
    work_ = nullptr;
  }

 private:
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void()>* w;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || gen_ != seen; });
        if (stop_) return;
        seen = gen_;
        w = work_;
      }
      (*w)();
      {
        std::lock_guard<std::mutex> g(mu_);
        if (--pending_ == 0) done_cv_.notify_one();
      }
    }
  }
  std::vector<std::thread> threads_;
  std::mutex mu_, caller_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void()>* work_ = nullptr;
  int pending_ = 0;
  uint64_t gen_ = 0;
  bool stop_ = false;
};

// The process's workers, sized by the first call (never destroyed: they live as long as the process).
// A forked child has none of its parent's threads: it starts its own.
Workers& workers(int64_t n) {
  static std::mutex mu;
  static Workers* w = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> g(mu);
  if (w == nullptr || owner != getpid()) {
    w = new Workers(n);  // (a parent's object, if any, is left alone: its threads are not ours)
    owner = getpid();
  }
  return *w;
}

template <typename F>
void parallel_chunks(int64_t n_chunks, int64_t threads, F fn) {
  std::atomic<int64_t> next{0};
  std::function<void()> work = [&]() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks;) fn(c);
  };
  if (threads <= 1 || n_chunks <= 1) return work();
  Workers& w = workers(threads - 1);
  std::unique_lock<std::mutex> l(w.caller(), std::try_to_lock);
  if (!l.owns_lock() || w.size() == 0) return work();
  w.run(work);
}

// out[n * os + o] = w[o] . xr[n] for n < N, o < O (w [O][K] rows): few rows, dot tiles.
void dot_path(const float* const* xr, const float* w, int64_t N, int64_t K, int64_t O, float* out, int64_t os,
              int64_t threads) {
  constexpr int64_t kPairs = 16;  // weight row pairs per chunk
  const int64_t pairs = (O + 1) / 2, chunks = (pairs + kPairs - 1) / kPairs;
  parallel_chunks(chunks, threads, [&](int64_t c) {
    std::vector<float> buf(static_cast<size_t>(2 * N));
    auto* pair = reinterpret_cast<float (*)[2]>(buf.data());
    for (int64_t p = c * kPairs; p < std::min(pairs, (c + 1) * kPairs); ++p) {
      const int64_t o0 = 2 * p, o1 = std::min(o0 + 1, O - 1);  // an odd O's last row paired with itself
      dot_rows(w + o0 * K, w + o1 * K, xr, N, K, pair);
      for (int64_t n = 0; n < N; ++n) {
        out[n * os + o0] = pair[n][0];
        if (o1 != o0) out[n * os + o1] = pair[n][1];
      }
    }
  });
}

// The same values for many rows: the packed-panel GEMM (native_tiles.h).
void gemm_path(const float* const* xr, const float* w, int64_t N, int64_t K, int64_t O, float* out, int64_t os,
               int64_t threads) {
  std::vector<float> ap;
  pack_activations(xr, N, K, ap);
  constexpr int64_t kRows = 2 * PW;  // weight rows per chunk
  const int64_t chunks = (O + kRows - 1) / kRows;
  parallel_chunks(chunks, threads, [&](int64_t c) {
    const int64_t o0 = c * kRows;
    panel_gemm(w + o0 * K, std::min(kRows, O - o0), K, ap.data(), N, out + o0, os);
  });
}

void rows_as_outputs(const float* const* xr, const float* w, int64_t N, int64_t K, int64_t O, float* out, int64_t os,
                     int64_t threads) {
  if (N >= kGemmRows)
    gemm_path(xr, w, N, K, O, out, os, threads);
  else
    dot_path(xr, w, N, K, O, out, os, threads);
}

// out[n * os + k] = sum_{d < D} xr[n][d] w[d K + k] (d ascending: one FMA chain per output from zero,
// so a row's result does not depend on the rows beside it) for n < N, k < K: the weight's rows
// contracted (x @ W, W [D][K] read in place). Tiles of 6 rows by 16 columns; a 16-column strip of W
// (D x 16 floats) is read once per tile from L1.
void rows_contracted(const float* const* xr, const float* w, int64_t N, int64_t D, int64_t K, float* out, int64_t os) {
  const int64_t K16 = K / PW * PW;
  for (int64_t k0 = 0; k0 < K16; k0 += PW)
    for (int64_t n0 = 0; n0 < N; n0 += PM) {
      const int64_t mt = std::min<int64_t>(PM, N - n0);
      vf8 acc[PM][2];
      for (int t = 0; t < PM; ++t) acc[t][0] = acc[t][1] = vf8{};
      for (int64_t d = 0; d < D; ++d) {
        const vf8 w0 = load8(w + d * K + k0), w1 = load8(w + d * K + k0 + L);
        for (int64_t t = 0; t < mt; ++t) {
          acc[t][0] += xr[n0 + t][d] * w0;
          acc[t][1] += xr[n0 + t][d] * w1;
        }
      }
      for (int64_t t = 0; t < mt; ++t) {
        std::memcpy(out + (n0 + t) * os + k0, &acc[t][0], sizeof(vf8));
        std::memcpy(out + (n0 + t) * os + k0 + L, &acc[t][1], sizeof(vf8));
      }
    }
  for (int64_t n = 0; n < N; ++n)  // the columns past the last 16-column strip
    for (int64_t k = K16; k < K; ++k) {
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s = __builtin_fmaf(xr[n][d], w[d * K + k], s);
      out[n * os + k] = s;
    }
}

ffi::Error TableLinearImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> base,
                           ffi::ResultBuffer<ffi::F32> out, int64_t threads) {
  const auto xd = x.dimensions(), td = table.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || td.size() != 2 || od.size() != 2 || td[1] != xd[1] || od[0] != xd[0] || od[1] > td[0] ||
      base.element_count() != 1)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_table_linear: inconsistent shapes");
  const int64_t N = xd[0], K = xd[1], R = td[0], O = od[1];
  const int64_t b = std::min<int64_t>(std::max<int64_t>(base.typed_data()[0], 0), R - O);
  const float* w = table.typed_data() + b * K;
  const int64_t T = O * K < kThreadElems ? 1 : std::max<int64_t>(1, threads);
  if (N == 0 || O == 0) return ffi::Error::Success();
  std::vector<const float*> xr(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) xr[n] = x.typed_data() + n * K;
  rows_as_outputs(xr.data(), w, N, K, O, out->typed_data(), O, T);
  return ffi::Error::Success();
}

// Per head h < H of a block of H x stride rows at base (clamped to [0, R - H stride]): the head's rows
// [h stride + offset, + rows) as a [rows, K] weight W_h. contract = 0: out[n, h, :rows] = x[n, h, :K] @ W_h^T
// (x [N, H K], out [N, H rows]); contract = 1: out[n, h, :K] = x[n, h, :rows] @ W_h (x [N, H rows],
// out [N, H K]). What MLA's absorbed attention does with kv_b_proj (W_UV and W_UK), read in place.
ffi::Error TableHeadsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> base,
                          ffi::ResultBuffer<ffi::F32> out, int64_t threads, int64_t heads, int64_t stride,
                          int64_t offset, int64_t rows, int64_t contract) {
  const auto xd = x.dimensions(), td = table.dimensions(), od = out->dimensions();
  const int64_t H = heads;
  if (xd.size() != 2 || td.size() != 2 || od.size() != 2 || base.element_count() != 1 || H <= 0 || rows <= 0 ||
      offset < 0 || offset + rows > stride || H * stride > td[0] || od[0] != xd[0] ||
      xd[1] != H * (contract ? rows : td[1]) || od[1] != H * (contract ? td[1] : rows))
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "ling_table_heads: inconsistent shapes");
  const int64_t N = xd[0], K = td[1], R = td[0];
  const int64_t b = std::min<int64_t>(std::max<int64_t>(base.typed_data()[0], 0), R - H * stride);
  if (N == 0) return ffi::Error::Success();
  const int64_t xs = xd[1], os = od[1], xh = contract ? rows : K, oh = contract ? K : rows;
  const int64_t T = H * rows * K < kThreadElems ? 1 : std::max<int64_t>(1, threads);
  parallel_chunks(H, T, [&](int64_t h) {  // a head per chunk, each on one thread
    const float* w = table.typed_data() + (b + h * stride + offset) * K;
    std::vector<const float*> xr(static_cast<size_t>(N));
    for (int64_t n = 0; n < N; ++n) xr[n] = x.typed_data() + n * xs + h * xh;
    float* o = out->typed_data() + h * oh;
    if (contract)
      rows_contracted(xr.data(), w, N, rows, K, o, os);
    else
      rows_as_outputs(xr.data(), w, N, K, rows, o, os, 1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LingTableLinear, TableLinearImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(LingTableHeads, TableHeadsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("stride")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("contract"));
