// HostCtx: the CPU side of the Ctx contract of intranode_roles.cuh (one std::thread per warp,
// width 1, std atomics, steady_clock bounded waits; timeouts count nanoseconds), plus the thread
// helpers of the CPU backends (intranode_cpu.cpp, internode_cpu.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/intranode_roles.cuh"

namespace moe_dispatch {
namespace intranode {

// Reusable barrier of a fixed number of threads (a named barrier of a warp group).
class ThreadBarrier {
 public:
  explicit ThreadBarrier(int count) : count_(count) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == count_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != generation; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int count_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

template <class T>
struct HostElem;
template <>
struct HostElem<Bf16Tag> {
  using Storage = uint16_t;
  static float load(Storage v) { return bf16_to_float(v); }
  static Storage store(float f) { return float_to_bf16(f); }
};
template <>
struct HostElem<F32Tag> {
  using Storage = float;
  static float load(Storage v) { return v; }
  static Storage store(float f) { return f; }
};

// CommonT: intranode Common, or internode::Common (whose RDMA context extends this one).
template <class CommonT>
struct HostCtxT {
  const CommonT* common;
  ThreadBarrier* group;  // null: a one-thread group

  int lane() const { return 0; }
  int width() const { return 1; }
  int tid() const { return 0; }
  int num_threads() const { return 1; }
  void warp_sync() const {}
  void block_sync() const {}
  void group_sync() const {
    if (group != nullptr) group->arrive_and_wait();
  }

  int32_t load_acquire(const int32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void store_release(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void store_relaxed(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  void signal_add(int32_t* p, int32_t v) const { __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
  void count_add(int64_t* p, int64_t v) const { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  int32_t shared_load(const int32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void shared_store(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void shared_add(int32_t* p, int32_t v) const { __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
  // shared_load/shared_store acquire/release already order what fence_block orders on the GPU
  // (and ThreadSanitizer does not model fences).
  void fence_block() const {}

  // As DeviceCtx::offer_timeout: the better-named cause (lower timeout_level) wins.
  void offer_timeout(const WaitSite& site, int32_t expected, int32_t observed) const {
    ErrorRecord* e = common->error;
    const int32_t level = timeout_level(site.counter, observed);
    int32_t unlocked = 0;
    while (!__atomic_compare_exchange_n(&e->lock, &unlocked, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      unlocked = 0;
      std::this_thread::yield();
    }
    if (e->phase == 0 || level < e->level) {
      e->phase = site.phase;
      e->role = site.role;
      e->rank = site.rank;
      e->channel = site.channel;
      e->peer = site.peer;
      e->counter = site.counter;
      e->expected = expected;
      e->observed = observed;
      e->level = level;
    }
    __atomic_store_n(&e->lock, 0, __ATOMIC_RELEASE);
  }

  // Polls load() until it is >= target; -1 after timeout_cycles (ns), or once another wait
  // timed out (offering this wait too if it had waited half the bound).
  template <class Load>
  int64_t bounded_wait(Load load, int64_t target, const WaitSite& site) const {
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t spin = 0;; ++spin) {
      const int64_t v = load();
      if (v >= target) return v;
      const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::steady_clock::now() - start).count();
      if (__atomic_load_n(&common->error->flag, __ATOMIC_ACQUIRE) != 0) {
        if (2 * waited > common->timeout_cycles)
          offer_timeout(site, static_cast<int32_t>(target), static_cast<int32_t>(v));
        return -1;
      }
      if (waited > common->timeout_cycles) {
        __atomic_store_n(&common->error->flag, 1, __ATOMIC_RELEASE);
        offer_timeout(site, static_cast<int32_t>(target), static_cast<int32_t>(v));
        return -1;
      }
      if (spin < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
  }
  int32_t wait_ge_lane(const int32_t* p, int32_t target, const WaitSite& site) const {
    return static_cast<int32_t>(bounded_wait([this, p]() { return static_cast<int64_t>(load_acquire(p)); }, target, site));
  }
  int32_t wait_ge(const int32_t* p, int32_t target, const WaitSite& site) const {
    return wait_ge_lane(p, target, site);
  }

  int32_t block_exclusive_scan(int32_t* data, int n) const {
    int32_t total = 0;
    for (int i = 0; i < n; ++i) {
      const int32_t v = data[i];
      data[i] = total;
      total += v;
    }
    return total;
  }

  void copy_in(char* dst, const char* src, int bytes) const { std::memcpy(dst, src, bytes); }
  void copy_out(char* dst, const char* src, int bytes) const { std::memcpy(dst, src, bytes); }
  void zero_row(char* dst, int bytes) const { std::memset(dst, 0, bytes); }
  int32_t queue_i32(const char* p) const {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  float queue_f32(const char* p) const {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }

  template <class T>
  void reduce_rows(char* out, char* const* rows, const float* scales, int num_rows, int bytes) const {
    using E = HostElem<T>;
    using S = typename E::Storage;
    const int n = bytes / static_cast<int>(sizeof(S));
    for (int i = 0; i < n; ++i) {
      float acc = 0.0f;
      for (int h = 0; h < num_rows; ++h) {
        S v;
        std::memcpy(&v, rows[h] + i * sizeof(S), sizeof(S));
        acc = combine_step(acc, E::load(v), scales[h]);
      }
      const S r = E::store(acc);
      std::memcpy(out + i * sizeof(S), &r, sizeof(S));
    }
  }
};

using HostCtx = HostCtxT<Common>;

// Runs fn(...) on threads and joins them all; the first exception (e.g. std::system_error
// when the OS refuses a thread) is rethrown after the join.
class Threads {
 public:
  template <class Fn>
  void spawn(Fn fn) {
    threads_.emplace_back([this, fn]() {
      try {
        fn();
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    });
  }
  void join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace intranode
}  // namespace moe_dispatch
