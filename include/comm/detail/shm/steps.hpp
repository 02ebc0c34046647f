#pragma once
// The step protocol of the Shm engine over its segment (the file comment of engine.hpp describes
// it): where each rank's halves, control lines and point-to-point channels lie, publishing a step,
// waiting for a peer's step (spin, yield, futex sleep) and ending a wait that cannot succeed with
// the error that names the rank at fault. The engine's algorithms are written on top of it.

#include <sched.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/shm/segment.hpp>
#include <comm/detail/shm/wait.hpp>
#include <comm/error.hpp>

namespace comm::detail::shm {

class Steps {
 protected:
  using Clock = std::chrono::steady_clock;
  struct Unchecked {
    std::uint64_t step;
    Fingerprint fp;  // this rank's in that step
  };

  Steps(int rank, int size, std::chrono::milliseconds timeout, std::size_t chunk)
      : layout_(size, chunk),
        seen_(static_cast<std::size_t>(size), 0),
        watch_(static_cast<std::size_t>(size)),
        table_(static_cast<std::size_t>(size)),
        window_matched_(static_cast<std::size_t>(size), 0),
        step_rank_(rank),
        step_size_(size),
        wait_limit_(timeout) {
    unchecked_.reserve(kRing);  // at most kLag are kept (settle), so this never grows on a call
  }

  // ---- layout ----

  [[nodiscard]] RankCtl& ctl(int p) const noexcept {
    return reinterpret_cast<RankCtl*>(map_.base() + layout_.ctl)[p];
  }
  /// Rank p's header line of step s.
  [[nodiscard]] StepHeader* slot(int p, std::uint64_t s) const noexcept {
    return reinterpret_cast<StepHeader*>(map_.base() + layout_.lanes +
                                         (static_cast<std::size_t>(p) * kRing + s % kRing) * kLine);
  }
  /// Rank p's body of step s (payloads of kInline-kLaneBytes bytes).
  [[nodiscard]] std::byte* body(int p, std::uint64_t s) const noexcept {
    return map_.base() + layout_.bodies + (static_cast<std::size_t>(p) * kBodyRing + s % kBodyRing) * kLaneBytes;
  }
  /// Rank p's half of step s (payloads above kLaneBytes).
  [[nodiscard]] std::byte* half(int p, std::uint64_t s) const noexcept {
    return map_.base() + layout_.halves + (static_cast<std::size_t>(p) * 2 + (s & 1)) * layout_.half_bytes;
  }
  [[nodiscard]] ChannelCtl& channel(int from, int to) const noexcept {
    return reinterpret_cast<ChannelCtl*>(map_.base() + layout_.channels)[static_cast<std::size_t>(from) *
                                                                             static_cast<std::size_t>(step_size_) +
                                                                         static_cast<std::size_t>(to)];
  }
  [[nodiscard]] std::byte* channel_slot(int from, int to, std::uint64_t chunk) const noexcept {
    const std::size_t c = static_cast<std::size_t>(from) * static_cast<std::size_t>(step_size_) + static_cast<std::size_t>(to);
    return map_.base() + layout_.slots + (c * 2 + (chunk & 1)) * layout_.slot_bytes;
  }
  /// Where rank p's payload of step s lies when the step carries `bytes` (the writer's and the
  /// readers' `bytes` agree whenever their fingerprints do, and a reader checks that first).
  [[nodiscard]] std::byte* payload(int p, std::uint64_t s, std::size_t bytes) const noexcept {
    if (bytes <= kInline) return reinterpret_cast<std::byte*>(slot(p, s)) + kInlineAt;
    return bytes <= kLaneBytes ? body(p, s) : half(p, s);
  }
  // Where the parts of a header line lie (segment.hpp, StepHeader). The word after the
  // fingerprint is the verified step at two ranks (settle_by_peer) and the window sum above two
  // (settle_by_window).
  static constexpr std::size_t kFpAt = sizeof(std::uint64_t);
  static constexpr std::size_t kVerifiedAt = kFpAt + sizeof(Fingerprint);
  static constexpr std::size_t kWindowAt = kVerifiedAt;
  static constexpr std::size_t kInlineAt = kVerifiedAt + sizeof(std::uint64_t);
  static_assert(kInlineAt + kInline == kLine);

  // ---- steps ----

  [[nodiscard]] std::uint64_t next_step() noexcept { return ++step_; }

  /// Returns once this rank's header line of step s may be rewritten (every peer published s -
  /// kRing + kLag: it compared the line's fingerprint at most kLag steps after it) and the place
  /// of a payload of `bytes` too: body s%kBodyRing, last written in step s - kBodyRing at the
  /// latest (every peer published the step after it, so it read it), or half s%2 (every peer
  /// left step s-2: published s-1).
  void ensure_free(std::uint64_t s, std::size_t bytes) {
    std::uint64_t need = s + kLag > kRing ? s + kLag - kRing : 0;
    if (bytes > kLaneBytes)
      need = std::max(need, s - 1);
    else if (bytes > kInline && s > kBodyRing)
      need = std::max(need, s - kBodyRing + 1);
    for (int p = 0; p < step_size_; ++p) {
      auto& seen = seen_[static_cast<std::size_t>(p)];
      if (p == step_rank_ || seen >= need) continue;
      // A peer that kept up has published s-1: reading that line instead of need's tells this
      // rank that it need not look again for a while (a root of back-to-back small broadcasts
      // would otherwise read one of its reader's lines every step).
      if (s - 1 > need && slot(p, s - 1)->step.load(std::memory_order_acquire) >= s - 1) {
        seen = s - 1;
        continue;
      }
      wait_published(p, need);
    }
  }

  /// This rank's payload of `bytes` for step `s`, once it may be written.
  std::byte* begin(std::uint64_t s, std::size_t bytes) {
    ensure_free(s, bytes);
    return payload(step_rank_, s, bytes);
  }

  /// Publishes step `s` with the current operation's fingerprint; wakes sleepers on this rank.
  /// Where every rank registered for its peers' fences (peer_fence_), the store needs no fence of
  /// its own: a waiter fences this rank before it sleeps (wait.hpp, fence_peers), so either the
  /// sleeper count read here includes it or it sees the step. A fenced store would wait for the
  /// header line to come back from the reader that last read it (the root of back-to-back small
  /// broadcasts: 0.01-0.03 us of a 0.17 us call; benchmarks/RESULTS.md, "A publish without a fence").
  void publish(std::uint64_t s) {
    ensure_free(s, 0);
    StepHeader* h = slot(step_rank_, s);
    std::memcpy(reinterpret_cast<std::byte*>(h) + kFpAt, &fp_, sizeof(Fingerprint));
    if (step_size_ == 2) {
      const std::uint64_t verified =
          std::min(unchecked_.empty() ? s - 1 : unchecked_.front().step - 1, verified_cap_);
      std::memcpy(reinterpret_cast<std::byte*>(h) + kVerifiedAt, &verified, sizeof verified);
    } else {
      std::uint64_t& old = window_terms_[s % kRing];
      const std::uint64_t term = window_term(s, fp_);
      window_ += term - old;
      old = term;
      std::memcpy(reinterpret_cast<std::byte*>(h) + kWindowAt, &window_, sizeof window_);
    }
    note_cpu();
    if (peer_fence_)
      h->step.store(s, std::memory_order_release);
    else
      h->step.store(s, std::memory_order_seq_cst);
    wake_sleepers();
  }

  /// After a publish: wakes this rank's sleepers, if one announced itself. Where the publish was a
  /// plain release store, C++ would let the compiler move this load above it (a release store
  /// orders only what comes before it); the sleeper's fence (wait.hpp) orders the two on the CPU,
  /// but only as the program has them, so the compiler must keep them in that order too.
  void wake_sleepers() noexcept {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    if (ctl(step_rank_).sleepers.load(std::memory_order_seq_cst) != 0) ring(step_rank_);
  }

  void ring(int p) noexcept {
    ctl(p).bell.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&ctl(p).bell);
  }

  /// Records that rank `p`'s process is gone (the first such rank wins) and wakes every rank, so
  /// that each survivor's error names the dead rank: a survivor that fails on it and aborts the
  /// communicator must not be named in its place by the ranks that had not seen the death yet.
  /// Once a rank has aborted the communicator, a death is no longer recorded: the abort names the
  /// cause, and a rank that died after it (say of the uncaught error it brought) is its echo.
  void declare_dead(int p) noexcept {
    std::uint32_t none = 0;
    if (header_->abort.load(std::memory_order_acquire) == 0)
      (void)header_->dead.compare_exchange_strong(none, static_cast<std::uint32_t>(p + 1));
    for (int q = 0; q < step_size_; ++q) ring(q);
  }

  /// Waits until peer `p` has published step `s`, then checks its fingerprint.
  void wait_step(int p, std::uint64_t s) {
    wait_published(p, s);
    if (!same(*header_fp(p, s), fp_)) desync(s);
  }

  /// The first step of every operation: waits for every peer and compares every fingerprint.
  void wait_all(std::uint64_t s) {
    bool mismatch = false;
    for (int p = 0; p < step_size_; ++p) {
      if (p == step_rank_) continue;
      wait_published(p, s);
      mismatch = mismatch || !same(*header_fp(p, s), fp_);
    }
    if (mismatch) desync(s);
  }

  /// Every peer has published `s` (wait_all/wait_step done): DesyncError naming every call.
  [[noreturn]] void desync(std::uint64_t s) {
    verified_cap_ = std::min(verified_cap_, s - 1);
    for (int p = 0; p < step_size_; ++p) {
      if (p != step_rank_) wait_published(p, s);
      std::memcpy(&table_[static_cast<std::size_t>(p)], p == step_rank_ ? &fp_ : header_fp(p, s), sizeof(Fingerprint));
    }
    auto msg = desync_message(table_);
    if (msg.empty()) msg = "a peer ran a different step of this operation";
    throw DesyncError(op_name_, step_rank_,
                      "desync (always checked on shm): " + msg +
                          "; every rank must issue the same collectives in the same order with matching sizes");
  }

  // ---- the deferred fingerprint check of one-step operations ----
  //
  // A one-step operation in which this rank did not read every peer's header (the root of a
  // broadcast or scatter, a non-root of a gather or reduce) returns without waiting for the peers;
  // it leaves that step unchecked. The peers' fingerprints of the step stay in their slots until
  // this rank has published kLag more steps (ensure_free), so the comparison can wait: the next
  // operation's entry compares them all; a small rooted operation compares them once the oldest
  // is kLag steps old, so that a root of back-to-back small broadcasts runs ahead of its readers.
  // A mismatch is a DesyncError, naming the mismatched calls, thrown before this rank publishes
  // anything of the operation it is entering. At two ranks the peer has usually compared the step
  // itself (it read this rank's header): its newest header says so (settle_by_peer). Above two
  // ranks a reader of a broadcast compared only the root's header, so every rank has unchecked
  // steps, and comparing each of them with every peer read n - 1 freshly written lines per call:
  // 4-rank 8-16 B rooted operations took 0.23-0.25 us a call, 0.12-0.19 with no comparison at
  // all. There every header carries the sum of a hash of each of the rank's last kRing steps
  // (step number and fingerprint): equal sums at step t say that the two ranks ran the same
  // operations in every step of that window, which holds every unchecked step up to t
  // (settle_by_window); only where the sums differ are the steps compared one by one, to find and
  // name the mismatch. Two windows that differ but hash to the same sum (a chance of 2^-64)
  // would leave a mismatch unreported; every step a rank reads is still compared in full, so
  // nothing of another operation is ever read. Since then the 4-rank 8-16 B broadcast and scatter
  // take 0.12-0.17 us, reduce 0.18-0.22 (benchmarks/RESULTS.md, "Above two ranks: one
  // comparison for many steps").

  /// Marks step `s` of the current operation as not compared with every peer.
  void leave_unchecked(std::uint64_t s) {
    unchecked_.push_back(Unchecked{s, fp_});
  }

  /// After the one step of a rooted operation (broadcast, scatter, gather, reduce), in which no
  /// peer waits for this rank's next step: asks for this rank's next header line now. The peers
  /// read that line kRing steps ago and the root reads its reader's lines as it runs ahead, so
  /// writing it takes it back from them, and the locked exchange that ends the call (the queue
  /// lock's) waits for that store: a line transfer on every call's path. Taken now, the transfer
  /// overlaps the time between calls: 2-rank 8-16 B broadcast, gather, reduce and scatter went
  /// from 0.23 to 0.11 us while this VM moved a line in ~200 ns (benchmarks/RESULTS.md, "The
  /// next header line, taken ahead"). Not after a symmetric step: there a peer polls that line
  /// next, and taking it early made it travel once more (8-16 B all_reduce, all_gather and
  /// all_to_all 1.2-1.4x slower).
  void take_next_line(std::uint64_t s) noexcept { prefetch_for_write(slot(step_rank_, s + 1)); }

  /// Asks for `line` in a state that can be written (PREFETCHW: a hint, which never faults and
  /// changes nothing that another CPU reads).
  static void prefetch_for_write(const void* line) noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(line)));
#else
    __builtin_prefetch(line, 1, 3);
#endif
  }

  /// Compares the unchecked steps with every peer's, waiting for the peers: all of them (`all`),
  /// or, entering step `next`, once the oldest is kLag steps old. DesyncError on a mismatch.
  void settle(bool all, std::uint64_t next = 0) {
    if (unchecked_.empty() || (!all && unchecked_.front().step + kLag > next)) return;
    if (step_size_ == 2) {
      settle_by_peer();
      std::size_t done = 0;
      for (; done < unchecked_.size() && (all || unchecked_[done].step + kLag <= next); ++done)
        compare_step(unchecked_[done]);
      unchecked_.erase(unchecked_.begin(), unchecked_.begin() + static_cast<std::ptrdiff_t>(done));
    } else {
      settle_by_window(all);
    }
  }

  /// Waits for every peer to publish `u`'s step, then compares its fingerprint with every peer's.
  /// Every peer's header first: a rank must not throw (and abort the communicator) while a peer
  /// has yet to publish the step, or that peer's own check, and the error table here, would read
  /// a slot that does not hold it.
  void compare_step(const Unchecked& u) {
    for (int p = 0; p < step_size_; ++p)
      if (p != step_rank_) wait_published(p, u.step);
    for (int p = 0; p < step_size_; ++p)
      if (p != step_rank_ && !same(*header_fp(p, u.step), u.fp)) mismatch_found(u);
  }

  /// Above two ranks (settle): settles the unchecked steps by the window sums, peer by peer.
  /// Equal sums at step t with peer p cover every step up to t with p (every unchecked step lies
  /// within kRing of t: none is older than kLag steps); a step is settled once that holds for
  /// every peer. A peer already matched up to the steps needed (all of them, or the oldest, which
  /// is due) is not looked at, so a peer that kept up is read once per kLag / 2 steps or so, and
  /// one that lags (the root of a gather, whose writers run ahead) at its line of the due step,
  /// which ensure_free reads then anyway. Each peer's t is the newest unchecked step if the peer
  /// has published it (all, or the probe of its line finds it there), else the middle between
  /// the oldest and it if published, else the oldest (waiting for it, as the step is due).
  void settle_by_window(bool all) {
    const std::uint64_t oldest = unchecked_.front().step;
    const std::uint64_t newest = unchecked_.back().step;
    std::uint64_t settled = newest;
    for (int p = 0; p < step_size_; ++p) {
      if (p == step_rank_) continue;
      auto& matched = window_matched_[static_cast<std::size_t>(p)];
      if (matched < (all ? newest : oldest)) {
        std::uint64_t t = newest;
        if (!all) {
          auto& seen = seen_[static_cast<std::size_t>(p)];
          const std::uint64_t mid = oldest + (newest - oldest) / 2;
          if (seen < t && slot(p, t)->step.load(std::memory_order_acquire) >= t) seen = t;
          if (seen < mid && slot(p, mid)->step.load(std::memory_order_acquire) >= mid) seen = mid;
          t = std::max(oldest, std::min(t, seen));
        }
        wait_published(p, t);
        if (window_of(p, t) != window_of(step_rank_, t))
          for (std::size_t k = 0; k < unchecked_.size() && unchecked_[k].step <= t; ++k) compare_step(unchecked_[k]);
        matched = t;
      }
      settled = std::min(settled, matched);
    }
    std::size_t done = 0;
    while (done < unchecked_.size() && unchecked_[done].step <= settled) ++done;
    unchecked_.erase(unchecked_.begin(), unchecked_.begin() + static_cast<std::ptrdiff_t>(done));
  }

  /// Rank p's window sum in its header of step t (published; not yet rewritten).
  [[nodiscard]] std::uint64_t window_of(int p, std::uint64_t t) const noexcept {
    std::uint64_t w = 0;
    std::memcpy(&w, reinterpret_cast<const std::byte*>(slot(p, t)) + kWindowAt, sizeof w);
    return w;
  }

  /// A step's term of the window sum: its number and its fingerprint, mixed so that another
  /// operation, count or root, or the same operations in another order, change the sum.
  [[nodiscard]] static std::uint64_t window_term(std::uint64_t s, const Fingerprint& f) noexcept {
    std::uint64_t words[sizeof(Fingerprint) / sizeof(std::uint64_t)];
    std::memcpy(words, &f, sizeof words);
    std::uint64_t h = s * 0x9e3779b97f4a7c15ULL;
    for (const std::uint64_t w : words) {
      h ^= w;
      h *= 0xbf58476d1ce4e5b9ULL;
      h ^= h >> 31;
    }
    return h;
  }

  /// Two ranks: drops the unchecked steps that the peer's newest header (of the last step this
  /// rank published, if the peer has published it too) says it compared itself. At two ranks
  /// every one-step rooted operation has a rank that reads the other's header (the reader of a
  /// broadcast or scatter, the root of a gather or reduce) and compares the fingerprints; a rank
  /// writes into every header the step below its oldest step not compared (verified_cap_ holds it
  /// below any mismatch found), so a step that neither rank compared (a desync in which both
  /// wrote) stays unchecked on both, and is compared with the peer's line as before. One line
  /// read per kLag steps where a root of back-to-back broadcasts read one a step.
  void settle_by_peer() {
    const int p = 1 - step_rank_;
    const std::uint64_t t = step_;
    const StepHeader* h = slot(p, t);
    if (t == 0 || h->step.load(std::memory_order_acquire) != t) return;
    auto& seen = seen_[static_cast<std::size_t>(p)];
    seen = std::max(seen, t);
    std::uint64_t verified = 0;
    std::memcpy(&verified, reinterpret_cast<const std::byte*>(h) + kVerifiedAt, sizeof verified);
    std::size_t k = 0;
    while (k < unchecked_.size() && unchecked_[k].step <= verified) ++k;
    unchecked_.erase(unchecked_.begin(), unchecked_.begin() + static_cast<std::ptrdiff_t>(k));
  }

  /// A peer aborted the communicator while this rank waited: if a step this rank left unchecked
  /// is mismatched, that was most likely the peer's cause, and this rank reports the DesyncError
  /// itself rather than a RemoteError naming the peer. Above two ranks a rank waiting on one peer
  /// (a due step, a line to reuse) may not yet have compared the window it shares with another,
  /// while a third rank did and threw. Only steps that every peer has published are compared,
  /// without waiting (the rank that aborted publishes nothing more), each peer's line read only
  /// while it holds that step (a line is not rewritten while this rank has the step unchecked:
  /// ensure_free).
  void desync_behind_abort() {
    for (const Unchecked& u : unchecked_) {
      bool all = true, differ = false;
      for (int p = 0; p < step_size_ && all; ++p) {
        if (p == step_rank_) continue;
        all = slot(p, u.step)->step.load(std::memory_order_acquire) == u.step;
        differ = differ || (all && !same(*header_fp(p, u.step), u.fp));
      }
      if (all && differ)
        mismatch_found(u, "found in a later operation of this rank, while it waited for a peer after another rank had "
                          "aborted the communicator");
    }
  }

  [[noreturn]] void mismatch_found(Unchecked u,
                                   const char* where = "found at the start of a later operation of this rank, before "
                                                       "it published anything") {
    const std::uint64_t s = u.step;
    verified_cap_ = std::min(verified_cap_, s - 1);
    unchecked_.clear();  // the error reports them all: the next operation starts clean
    for (int p = 0; p < step_size_; ++p)
      std::memcpy(&table_[static_cast<std::size_t>(p)], p == step_rank_ ? &u.fp : header_fp(p, s), sizeof(Fingerprint));
    auto msg = desync_message(table_);
    if (msg.empty()) msg = "a peer ran a different step";
    throw DesyncError(op_name_, step_rank_,
                      std::string("desync (always checked on shm; ") + where + "): " + msg +
                          "; every rank must issue the same collectives in the same order with matching sizes");
  }

  [[nodiscard]] const Fingerprint* header_fp(int p, std::uint64_t s) const noexcept {
    return reinterpret_cast<const Fingerprint*>(reinterpret_cast<const std::byte*>(slot(p, s)) + kFpAt);
  }

  /// Waits until `p`'s slot of step s holds step s or later.
  void wait_published(int p, std::uint64_t s) {
    auto& seen = seen_[static_cast<std::size_t>(p)];
    if (seen >= s) return;
    const auto& w = slot(p, s)->step;
    if (w.load(std::memory_order_acquire) >= s) {
      seen = s;
      return;
    }
    for (int i = 0; i < spin_now_; ++i) {
      cpu_relax();
      if (w.load(std::memory_order_acquire) >= s) {
        seen = s;
        return;
      }
    }
    spin_ran_out(p);
    wait_slow(p, s, w);
    seen = s;
  }

  /// Where this rank runs, for a peer whose spin on it runs out (spin_ran_out); ~4 ns (vDSO).
  void note_cpu() noexcept { ctl(step_rank_).cpu.store(::sched_getcpu(), std::memory_order_relaxed); }

  /// A spin on peer `p` ran out: sets the next spin. How long to spin depends on where the peer
  /// runs, not on how this wait went. A peer on another CPU is running, or was preempted there,
  /// which giving up this CPU does not fix (yielding it to other load only adds that load's time
  /// slice to every step): the full spin stays, as an MPI's polling does. A peer that last
  /// published from this very CPU runs only when this rank gives the CPU up: the spin drops to
  /// its minimum, and where the host has a CPU for every rank the pair is moved apart (spread()).
  /// Halving the spin after every wait that outlasted it, as before, left two ranks that the
  /// scheduler had put on one CPU yielding to each other for good (the halved spin never caught a
  /// wait again to grow back): a 2-rank 8-byte all_reduce took 7.2 us where it takes 0.4 apart,
  /// and 12 ms beside two busy processes (RESULTS.md, "Where a rank waits").
  void spin_ran_out(int p) {
    const int mine = ::sched_getcpu();
    const bool shared = mine >= 0 && ctl(p).cpu.load(std::memory_order_relaxed) == mine;
    spin_now_ = shared ? std::min(spin_, 16) : spin_;
    if (!shared) {
      shared_waits_ = 0;
    } else if (spread_ && spin_ > 16 && p < step_rank_ && ++shared_waits_ >= kSharedWaits) {
      shared_waits_ = 0;
      spread(mine);
    }
  }

  /// Moves this rank off CPU `mine`, which it shares with a peer although the host has a CPU for
  /// every rank (spin_ is long only then). The scheduler's balancer judges by load: two ranks that
  /// hand one CPU back and forth look like one busy task, so it leaves them together while another
  /// CPU runs unrelated work, and every step costs two context switches (~7 us here). Narrowing
  /// the affinity mask to exclude `mine` migrates the rank at once; the caller's mask is restored
  /// right after (the rank stays where it went). At most once per kSpreadEvery; the higher rank
  /// of the pair moves, so the two do not swap places. COMM_SHM_SPREAD=0 turns it off.
  void spread(int mine) {
    const auto now = Clock::now();
    if (now - last_spread_ < kSpreadEvery) return;
    last_spread_ = now;
    cpu_set_t allowed;
    if (mine >= CPU_SETSIZE || ::sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2 ||
        !CPU_ISSET(mine, &allowed))
      return;
    cpu_set_t elsewhere = allowed;
    CPU_CLR(mine, &elsewhere);
    if (::sched_setaffinity(0, sizeof elsewhere, &elsewhere) == 0) (void)::sched_setaffinity(0, sizeof allowed, &allowed);
  }

  void wait_slow(int p, std::uint64_t s, const std::atomic<std::uint64_t>& w) {
    const auto deadline = Clock::now() + wait_limit_;
    auto ready = [&] { return w.load(std::memory_order_acquire) >= s; };
    // Then yield for a while: a peer that shares this core (the scheduler does not always spread
    // the ranks) runs at once, and one on another core costs a system call per check. Only a peer
    // that is really busy or stopped sends this rank to sleep.
    const auto yield_until = Clock::now() + kYieldPhase;
    for (int i = 0;; ++i) {
      if (ready()) return;
      std::this_thread::yield();
      if (i % 64 == 63) {
        if (!check_peers(p, s, deadline, false, w)) return;
        if (Clock::now() >= yield_until) break;
      }
    }
    RankCtl& c = ctl(p);
    for (;;) {
      c.sleepers.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t bell = c.bell.load(std::memory_order_seq_cst);
      if (peer_fence_) fence_peers();  // publish() did not fence its store: order it now
      if (ready()) {
        c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        return;
      }
      const auto left = deadline - Clock::now();
      futex_wait(&c.bell, bell, std::min<std::chrono::nanoseconds>(kSlice, std::max<Clock::duration>(left, {})));
      c.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (ready() || !check_peers(p, s, deadline, true, w)) return;
    }
  }

  /// Ends a wait on peer `p` that cannot succeed: a rank found dead, the communicator aborted by a
  /// rank, `p` gone, or the deadline passed. Returns false when the step arrived after all: a peer
  /// may publish its last step and then exit or destroy its communicator at once.
  bool check_peers(int p, std::uint64_t s, Clock::time_point deadline, bool probe,
                   const std::atomic<std::uint64_t>& w) {
    return check_peer(
        p, deadline, probe, [&] { return w.load(std::memory_order_acquire) >= s; },
        [&] { return " (op #" + std::to_string(op_seq_) + ", step " + std::to_string(s) + ")"; });
  }

  /// check_peers for any wait on peer `p`: `ready()` re-checks the awaited condition, `at()` says
  /// where this rank waited.
  template <class Ready, class At>
  bool check_peer(int p, Clock::time_point deadline, bool probe, Ready ready, At at) {
    const bool gone = header_->dead.load(std::memory_order_acquire) != 0 ||
                      header_->abort.load(std::memory_order_acquire) != 0 ||
                      ctl(p).left.load(std::memory_order_acquire) != 0 ||
                      (probe && watch_[static_cast<std::size_t>(p)].exited()) || Clock::now() >= deadline;
    if (!gone) return true;
    if (ready()) return false;
    if (const auto d = header_->dead.load(std::memory_order_acquire); d != 0) {
      const int r = static_cast<int>(d) - 1;
      throw RemoteError(op_name_, step_rank_,
                        "rank " + std::to_string(r) + " (pid " + std::to_string(ctl(r).pid) +
                            ") died during the operation" + at(),
                        "rank " + std::to_string(r));
    }
    if (const auto a = header_->abort.load(std::memory_order_acquire); a != 0 && static_cast<int>(a) - 1 != step_rank_) {
      desync_behind_abort();
      const int r = static_cast<int>(a) - 1;
      throw RemoteError(op_name_, step_rank_,
                        "rank " + std::to_string(r) + " failed and aborted the communicator" + at(),
                        "rank " + std::to_string(r));
    }
    if (ctl(p).left.load(std::memory_order_acquire) != 0)
      throw RemoteError(op_name_, step_rank_,
                        "rank " + std::to_string(p) + " destroyed its communicator while this rank waited for it" + at(),
                        "rank " + std::to_string(p));
    if (probe && watch_[static_cast<std::size_t>(p)].exited()) {
      declare_dead(p);
      throw RemoteError(op_name_, step_rank_,
                        "rank " + std::to_string(p) + " (pid " + std::to_string(ctl(p).pid) +
                            ") died during the operation" + at(),
                        "rank " + std::to_string(p));
    }
    if (Clock::now() < deadline)  // this rank's own abort (Work::wait gave up): end the wait now
      throw Timeout(op_name_, step_rank_, "the communicator was aborted while this rank waited for rank " +
                                          std::to_string(p) + at(), "rank " + std::to_string(p));
    throw Timeout(op_name_, step_rank_,
                  "rank " + std::to_string(p) + " (pid " + std::to_string(ctl(p).pid) + ") did not arrive within " +
                      std::to_string(wait_limit_.count()) + " ms" + at() + ": stopped, hung, or in another operation",
                  "rank " + std::to_string(p));
  }

  static int default_spin(int size) {
    // Spinning helps only while every rank has a core of its own.
    if (auto v = env_nonneg_int("COMM_SHM_SPIN")) return *v;
    return core_per_rank(size) ? 2000 : 16;
  }

  static constexpr std::chrono::microseconds kYieldPhase{2000};
  static constexpr std::chrono::milliseconds kSlice{10};
  static constexpr int kSharedWaits = 8;                        // before spread() moves this rank
  static constexpr std::chrono::milliseconds kSpreadEvery{50};

  Layout layout_;
  Mapping map_;
  Header* header_ = nullptr;
  int spin_ = 64;
  int spin_now_ = 64;  // wait_published's current spin, in [min(16, spin_), spin_]
  int shared_waits_ = 0;              // consecutive waits whose peer shared this rank's CPU
  bool spread_ = env_nonneg_int("COMM_SHM_SPREAD").value_or(1) != 0;
  Clock::time_point last_spread_{};
  bool peer_fence_ = false;  // every rank registered for its peers' fences: publish() needs none
  std::uint64_t step_ = 0;
  std::vector<std::uint64_t> seen_;  // per peer: the last step known published
  std::vector<ProcessWatch> watch_;
  std::vector<Fingerprint> table_;   // a desync's fingerprints
  Fingerprint fp_;                   // the current operation's
  std::uint64_t op_seq_ = 0;
  const char* op_name_ = "shm";
  std::vector<Unchecked> unchecked_;  // settle(): steps not compared with every peer, oldest first
  std::uint64_t verified_cap_ = ~std::uint64_t{0};  // below the first mismatch this rank found
  // Above two ranks: the sum of window_terms_, the terms of this rank's last kRing steps.
  std::uint64_t window_ = 0;
  std::array<std::uint64_t, kRing> window_terms_{};
  std::vector<std::uint64_t> window_matched_;  // per peer: the window sums agreed up to this step

 private:
  int step_rank_;
  int step_size_;
  std::chrono::milliseconds wait_limit_;
};

}  // namespace comm::detail::shm
