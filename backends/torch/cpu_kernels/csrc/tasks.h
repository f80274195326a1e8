// Tasks split into one contiguous run per thread, as at::parallel_for splits them, except
// that a thread done with its own run takes the remaining tasks off the back of the others'.
//
// Where the threads share their cores with other work (the server's event loop, a noisy
// neighbour), the OS takes a thread away now and then. Under a static split the others then
// wait at the end of the region for its whole remaining run; here they take over all of it
// but the task it is in. A thread still streams its own run front to back (one span of
// memory: interleaving tasks between threads read 20% slower in the packed linear).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace carousel {

namespace detail {
// a run [front, back) in one word, so that its owner and a thief never take the same task
inline uint64_t pack_run(uint64_t front, uint64_t back) { return front << 32 | back; }
inline uint64_t run_front(uint64_t run) { return run >> 32; }
inline uint64_t run_back(uint64_t run) { return run & 0xFFFFFFFFu; }

// the front (owner) or back (thief) task of `run`, or -1 when it is empty
inline int64_t take(std::atomic<uint64_t>& run, bool from_front) {
  uint64_t r = run.load(std::memory_order_relaxed);
  while (run_front(r) < run_back(r)) {
    const uint64_t front = run_front(r), back = run_back(r);
    const uint64_t next = from_front ? pack_run(front + 1, back) : pack_run(front, back - 1);
    if (run.compare_exchange_weak(r, next, std::memory_order_relaxed))
      return static_cast<int64_t>(from_front ? front : back - 1);
  }
  return -1;
}

// one run per cache line: the owners' updates must not bounce one line between cores
struct alignas(64) Run {
  std::atomic<uint64_t> run;
};
}  // namespace detail

// f(task) for every task in [0, n), each exactly once (n below 2^32)
template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  std::unique_ptr<detail::Run[]> runs(new detail::Run[threads]);
  for (int64_t i = 0; i < threads; ++i)
    runs[i].run.store(detail::pack_run(i * n / threads, (i + 1) * n / threads));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t me = begin; me < end; ++me) {
      for (int64_t t; (t = detail::take(runs[me].run, true)) >= 0;) f(t);
      for (int64_t k = 1; k < threads; ++k)
        for (int64_t t; (t = detail::take(runs[(me + k) % threads].run, false)) >= 0;) f(t);
    }
  });
}

}  // namespace carousel
