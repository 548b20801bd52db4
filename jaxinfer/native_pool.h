// Work items of one custom call spread over XLA's intra-op thread pool: shared by jaxinfer's native
// CPU kernels (jaxinfer/native.py builds them with this directory on the include path).
//
// The calling thread and up to workers - 1 pool tasks take items from one counter, so tasks the pool
// starts late (or never) only find it spent; the caller then spins until every item is done. Using
// XLA's own pool, not threads of the kernel's, keeps that pool's threads awake for the XLA ops around
// the call (a pool of the kernel's own measured 2.2x slower over a chain of the model's matmuls).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// fn(i) for every i < items. workers: 0 = the caller plus the pool's size; n > 0 = n in all.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t workers, int64_t items, Fn fn) {
  struct Shared {
    Fn fn;
    int64_t items;
    std::atomic<int64_t> next{0}, done{0};
    Shared(Fn f, int64_t n) : fn(std::move(f)), items(n) {}
    void work() {
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
        fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  if (workers <= 0) workers = std::max<int64_t>(1, pool.num_threads());
  auto shared = std::make_shared<Shared>(std::move(fn), items);
  for (int64_t i = 1; i < std::min(workers, items); ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < items; ++spins) {
    if (spins < 4096) {
#if defined(__SSE2__)
      _mm_pause();
#endif
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace jaxinfer
