// HostCtx: the CPU side of the Ctx contract of intranode_roles.cuh (one std::thread per warp,
// width 1, std atomics, steady_clock bounded waits; timeouts count nanoseconds), plus the thread
// helpers and launch scaffolding of the CPU backends (intranode_cpu.cpp, internode_cpu.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/intranode_cpu.h"
#include "kernels/intranode_roles.cuh"

namespace moe_dispatch {
namespace intranode {

// HostCtx::discard's byte. A line of it (bf16 -2.9e-16, int32 -1515870811) matches no row,
// top-k id or source index the tests send.
constexpr int kDiscardPoison = 0xA5;

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
struct HostElem<F16Tag> {
  using Storage = uint16_t;
  static float load(Storage v) { return f16_to_float(v); }
  static Storage store(float f) { return float_to_f16(f); }
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

  int32_t broadcast(int32_t v) const { return v; }
  uint64_t warp_or(uint64_t v) const { return v; }
  int32_t load_acquire(const int32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  int64_t load_acquire64(const int64_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  int64_t load_relaxed64(const int64_t* p) const { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  void store_release64(int64_t* p, int64_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void store_relaxed64(int64_t* p, int64_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  void store_release(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void store_relaxed(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  void signal_add(int32_t* p, int32_t v) const { __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
  void count_add(int64_t* p, int64_t v) const { __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
  int32_t shared_load(const int32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  void shared_store(int32_t* p, int32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  void shared_add(int32_t* p, int32_t v) const { __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL); }
  int32_t shared_fetch_max(int32_t* p, int32_t v) const {
    int32_t old = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    }
    return old;
  }
  static constexpr int kMaxRows = kMaxRowsInFlight;
  int rows_in_flight(const Variant& v) const { return v.rows_in_flight; }
  bool slot_flags(const Variant& v) const { return v.slot_flags != 0; }
  void relax() const { std::this_thread::yield(); }
  void backoff(int) const { relax(); }
  // shared_load/shared_store acquire/release already order what fence_block orders on the GPU
  // (and ThreadSanitizer does not model fences).
  void fence_block() const {}
  // An RMW on one process-wide word: RMWs on a word are totally ordered and each reads the one
  // before, so of two threads that store, fence and load, one sees the other's store (a plain
  // seq_cst fence would do, but ThreadSanitizer does not model fences).
  void fence_sc() const {
    static int32_t word = 0;
    __atomic_fetch_add(&word, 0, __ATOMIC_SEQ_CST);
  }

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

  // As DeviceCtx::offer_mismatch: the lowest (peer, relayed) key wins.
  void offer_mismatch(const Check& check, int rank, int peer, int via, int field, int64_t mine, int64_t theirs) const {
    MismatchRecord* r = check.mismatch;
    if (r == nullptr || !records_verdict(check.header.w[kHdrStatus], field, mine, theirs)) return;
    int64_t unlocked = 0;
    while (!__atomic_compare_exchange_n(&r->lock, &unlocked, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED)) {
      unlocked = 0;
      std::this_thread::yield();
    }
    const int64_t key = 2 * static_cast<int64_t>(peer) + (via >= 0);
    if (__atomic_load_n(&r->flag, __ATOMIC_RELAXED) == 0 || key < 2 * r->peer + (r->via >= 0)) {
      r->rank = rank;
      r->peer = peer;
      r->field = field;
      r->mine = mine;
      r->theirs = theirs;
      r->via = via;
      __atomic_store_n(&r->flag, 1, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&r->lock, 0, __ATOMIC_RELEASE);
  }

  // Polls load() until it is >= target; -1 after timeout_cycles (ns), or once another wait
  // timed out (offering this wait too if it had waited half the bound).
  template <class Load>
  int64_t bounded_wait(Load load, int64_t target, const WaitSite& site) const {
    const auto start = std::chrono::steady_clock::now();
    for (uint32_t spin = 0;; ++spin) {
      const int64_t v = load();
      if (v >= target) return v;
      const auto waited =
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
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
    return static_cast<int32_t>(
        bounded_wait([this, p]() { return static_cast<int64_t>(load_acquire(p)); }, target, site));
  }
  int32_t wait_ge(const int32_t* p, int32_t target, const WaitSite& site) const {
    return wait_ge_lane(p, target, site);
  }
  int64_t wait_ge64_lane(const int64_t* p, int64_t target, const WaitSite& site) const {
    return bounded_wait([this, p]() { return load_acquire64(p); }, target, site);
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
  void copy_in_rows(char* const* dst, const char* const* src, int n, int bytes) const {
    for (int r = 0; r < n; ++r) std::memcpy(dst[r], src[r], bytes);
  }
  void copy_out_rows(char* const* dst, const char* const* src, int n, int bytes) const {
    copy_in_rows(dst, src, n, bytes);
  }
  void zero_row(char* dst, int bytes) const { std::memset(dst, 0, bytes); }
  // The GPU's discard leaves indeterminate bytes: a pattern that no oracle value matches, so a
  // slot read after its discard fails the tests.
  void discard(char* slot, int bytes) const {
    const LineSpan lines = inner_lines(slot, bytes);
    std::memset(lines.first, kDiscardPoison, static_cast<size_t>(lines.count) * kLine);
  }
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

  // Bytes [offset, offset + bytes) of out: DeviceCtxT::reduce_rows's sums, element by element (the
  // summation order's level, moe_dispatch/semantics/summation.py).
  template <class T>
  void reduce_rows(char* out, char* const* rows, const float* scales, int num_rows, int offset, int bytes) const {
    using E = HostElem<T>;
    using S = typename E::Storage;
    const int first = offset / static_cast<int>(sizeof(S)), n = first + bytes / static_cast<int>(sizeof(S));
    for (int i = first; i < n; ++i) {
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

// The launch scaffolding both CPU backends share. Ctx is HostCtx or a context derived from
// HostCtxT (brace elision fills its base: Ctx{common, barrier}); CommonT has the launch fields
// num_launch_ranks, rank_begin, skip_rank and num_channels.

inline void check_cpu_options(const CpuOptions& o) {
  if (o.group_warps < 1 || o.group_warps > 8)
    throw std::invalid_argument("cpu group_warps must be in [1, 8], got " + std::to_string(o.group_warps));
  if (o.num_workers < 1 || o.num_workers > kNumWarps - 1)
    throw std::invalid_argument("cpu num_workers must be in [1, " + std::to_string(kNumWarps - 1) + "], got " +
                                std::to_string(o.num_workers));
}

// fn(rank) for every launched rank but the withheld one (the tests' skip_rank).
template <class CommonT, class Fn>
void for_each_launched_rank(const CommonT& c, Fn fn) {
  for (int i = 0; i < c.num_launch_ranks; ++i) {
    const int rank = c.rank_begin + i;
    if (rank != c.skip_rank) fn(rank);
  }
}

// The op epochs of a launch's ranks (intranode.cuh): read before its threads start and
// advanced after they all joined, as the GPU's blocks do (op_epoch_begin / op_epoch_end).
// `word(rank)` is the rank's epoch word; a withheld rank's is left alone.
template <class CommonT, class Word>
class OpEpochs {
 public:
  OpEpochs(const CommonT& c, Word word) : common_(c), word_(word) {
    values_.assign(c.num_launch_ranks, 0);
    for_each_launched_rank(
        c, [&](int rank) { values_[rank - c.rank_begin] = __atomic_load_n(word_(rank), __ATOMIC_RELAXED); });
  }
  uint64_t operator()(int rank) const { return values_[rank - common_.rank_begin]; }
  void advance() const {
    for_each_launched_rank(common_, [&](int rank) {
      __atomic_store_n(word_(rank), values_[rank - common_.rank_begin] + 1, __ATOMIC_RELAXED);
    });
  }

 private:
  const CommonT& common_;
  Word word_;
  std::vector<uint64_t> values_;
};

template <class CommonT, class Word>
OpEpochs<CommonT, Word> op_epochs(const CommonT& c, Word word) {
  return OpEpochs<CommonT, Word>(c, word);
}

// The notify launch: one thread per launched rank, notify(ctx, args, rank, state).
template <class Ctx, class State, class Args, class Notify>
void run_notify_threads(const Args& args, Notify notify) {
  std::vector<std::unique_ptr<State>> states;
  Threads threads;
  for_each_launched_rank(args.common, [&](int rank) {
    states.push_back(std::make_unique<State>());
    State* st = states.back().get();
    threads.spawn([&args, notify, rank, st]() {
      Ctx ctx{&args.common, nullptr};
      notify(ctx, args, rank, st);
    });
  });
  threads.join();
}

// Threads of the group-structured blocks: per (launched rank, channel, role) num_groups groups
// (one per peer rank, or per node) of group_warps threads, each group with its GroupState and,
// when it has several threads, its barrier; role(ctx, role, rank, channel, group, warp,
// group_warps, state).
template <class Ctx, int kMaxGroups, class CommonT, class Role>
void run_groups(const CommonT& c, const CpuOptions& o, int num_groups, int num_roles, Role role) {
  struct Block {
    GroupState groups[kMaxGroups];
    std::vector<std::unique_ptr<ThreadBarrier>> barriers;
  };
  std::vector<std::unique_ptr<Block>> blocks;
  Threads threads;
  for_each_launched_rank(c, [&](int rank) {
    for (int channel = 0; channel < c.num_channels; ++channel) {
      for (int r = 0; r < num_roles; ++r) {
        blocks.push_back(std::make_unique<Block>());
        Block* block = blocks.back().get();
        std::memset(block->groups, 0, sizeof(block->groups));
        for (int g = 0; g < num_groups; ++g) {
          block->barriers.push_back(o.group_warps > 1 ? std::make_unique<ThreadBarrier>(o.group_warps) : nullptr);
          ThreadBarrier* barrier = block->barriers.back().get();
          for (int w = 0; w < o.group_warps; ++w) {
            threads.spawn([&c, &o, role, rank, channel, r, g, w, block, barrier]() {
              Ctx ctx{&c, barrier};
              role(ctx, r, rank, channel, g, w, o.group_warps, &block->groups[g]);
            });
          }
        }
      }
    }
  });
  threads.join();
}

// The combine launch: per (launched rank, channel) a receiver coordinator and num_workers
// workers on their own threads (coordinator(ctx, rank, channel, state), worker(ctx, rank,
// channel, w, state)), while send() runs the senders; the receivers are joined even when
// send() throws, then its error is rethrown.
template <class Ctx, class RecvState, class CommonT, class Coordinator, class Worker, class Send>
void run_combine_threads(const CommonT& c, int num_workers, Coordinator coordinator, Worker worker, Send send) {
  std::vector<std::unique_ptr<RecvState>> states;
  Threads receivers;
  for_each_launched_rank(c, [&](int rank) {
    for (int channel = 0; channel < c.num_channels; ++channel) {
      states.push_back(std::make_unique<RecvState>());
      RecvState* st = states.back().get();
      std::memset(st, 0, sizeof(*st));
      receivers.spawn([&c, coordinator, rank, channel, st]() {
        Ctx ctx{&c, nullptr};
        coordinator(ctx, rank, channel, st);
      });
      for (int w = 0; w < num_workers; ++w) {
        receivers.spawn([&c, worker, rank, channel, w, st]() {
          Ctx ctx{&c, nullptr};
          worker(ctx, rank, channel, w, st);
        });
      }
    }
  });
  std::exception_ptr send_error;
  try {
    send();
  } catch (...) {
    send_error = std::current_exception();
  }
  receivers.join();
  if (send_error) std::rethrow_exception(send_error);
}

}  // namespace intranode
}  // namespace moe_dispatch
