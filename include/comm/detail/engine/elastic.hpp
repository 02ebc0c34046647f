#pragma once
// shrink(), grow(), revoke() and joining (concepts.hpp, optional capability; DESIGN.md
// "Fault-tolerant communicators") for a policy over an engine core. The agreement runs through the
// store, never through the engine's transport, which a failure has broken; a new communicator is
// then made with the policy's own create(), so every engine that can be created can shrink and
// grow, and a Hierarchical one re-derives its topology.
//
// The policy derives from Elastic<Policy>, befriends it, and has `engine_` (a pointer to an
// EngineCore-derived engine), `options_` and `static Policy create(store, rank, size, options)`.
//
// Keys (on the lineage's base store, under room = "<first communicator's prefix>elastic/"):
//   e<epoch>/shrink<a>/in/<r>   member r (old rank) takes part in shrink attempt a; the value is
//                               its grow count
//   e<epoch>/shrink<a>/seal     the outcome, written once (compare_set): "0,2,3;21" (the members,
//                               old ranks in order; the highest grow count among them) or "!1" (by
//                               the deadline, rank 1 neither took part nor was known dead)
//   e<epoch>/shrink<a>/comm/... the new communicator's own keys
//   g/<n>                       the n-th grow() of the lineage: "j<k>:<nonce>" while k newcomers
//                               wait, "c<k>" once the members closed it with k newcomers
//   g/<n>/admit, g/<n>/comm/... "<new size>|<members>|<epoch>" for the newcomers; the keys of the
//                               grown communicator
//   gmark                       a grow number at or below the next one (where newcomers start)
//
// Who is dead: the store server keeps every member's death under its communicator's liveness key
// (liveness.hpp, Liveness::death_key), as the liveness watch's will fires. A member is accounted
// for when it took part or is dead; the first member to see every member accounted for seals the
// outcome, and every member reads the same seal, so members never get different memberships.

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <comm/detail/base/random.hpp>
#include <comm/detail/engine/comm_core.hpp>
#include <comm/detail/engine/liveness.hpp>
#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

namespace elastic {

[[nodiscard]] inline std::span<const std::uint8_t> bytes(std::string_view s) noexcept {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}
[[nodiscard]] inline std::string text(const Store::Bytes& b) { return std::string(b.begin(), b.end()); }

[[nodiscard]] inline std::string cas(Store& s, const std::string& key, std::string_view expected,
                                     std::string_view desired) {
  return text(s.compare_set(key, bytes(expected), bytes(desired)));
}

/// A non-negative decimal that fills `s`, else -1 (values read from the store are checked, never trusted).
[[nodiscard]] inline std::int64_t number(std::string_view s) {
  std::int64_t v = -1;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && end == s.data() + s.size() && v >= 0 ? v : -1;
}

[[nodiscard]] inline std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ",") + std::to_string(r);
  return out;
}

/// "0,2,3" -> ranks; each in [0, size), increasing; else empty (malformed).
[[nodiscard]] inline std::vector<int> parse_ranks(std::string_view s, int size) {
  std::vector<int> out;
  while (!s.empty()) {
    const auto comma = s.find(',');
    const auto v = number(s.substr(0, comma));
    if (v < 0 || v >= size || (!out.empty() && v <= out.back())) return {};
    out.push_back(static_cast<int>(v));
    if (comma == std::string_view::npos) break;
    s.remove_prefix(comma + 1);
  }
  return out;
}

[[nodiscard]] inline std::string named(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

inline constexpr std::uint64_t kMarkEvery = 256;  // grows between two gmark writes (by rank 0)

}  // namespace elastic

template <class Policy>
class Elastic {
  /// How long shrink() lets the old communicator's operations end after the agreement, before it
  /// connects the new one regardless (an operation the transport's close does not reach ends by
  /// its own deadline; its buffers stay in use until then, as Work's contract says).
  static constexpr std::chrono::milliseconds kRetireGrace{500};

 public:
  /// The live members' new communicator (see the file comment). The old one stays failed: its
  /// queued and running operations end with their error before the agreement starts.
  [[nodiscard]] Policy shrink() {
    auto& e = engine();
    Lineage& lin = lineage("shrink");
    e.retire("the communicator was shrunk (rank " + std::to_string(e.rank()) + " called shrink())");
    // The operations still queued or running end with their error while the members agree; they
    // have until the agreement is made (at most kRetireGrace more) to be gone. NCCL's, whose
    // kernels must be stopped first, have up to the timeout (detail/nccl/shrink.hpp).
    const auto retired_by = std::chrono::steady_clock::now() + kRetireGrace;
    const std::string k = lin.room + "e" + std::to_string(lin.epoch) + "/shrink" + std::to_string(lin.shrinks++) + "/";
    Store& base = *lin.base;
    const int n = e.size(), me = e.rank();
    std::vector<int> members;
    std::int64_t grows = -1;
    try {
      // Taking part carries this member's grow count: members that saw the failure on either side
      // of a step boundary's grow() differ by one, and the new communicator takes the highest.
      base.set(k + "in/" + std::to_string(me), elastic::bytes(std::to_string(lin.next_grow)));
      const auto deadline = std::chrono::steady_clock::now() + e.timeout();
      std::vector<char> in(static_cast<std::size_t>(n)), dead(static_cast<std::size_t>(n));
      std::string seal;
      for (auto pause = std::chrono::microseconds(200);; pause = std::min(pause * 2, std::chrono::microseconds(5000))) {
        if (base.check(k + "seal")) {
          seal = elastic::text(base.get(k + "seal"));
          break;
        }
        std::vector<int> live, missing;
        for (int j = 0; j < n; ++j) {
          const auto uj = static_cast<std::size_t>(j);
          if (!in[uj]) in[uj] = j == me || base.check(k + "in/" + std::to_string(j));
          // Dead after taking part is dead too: the new communicator could not connect it.
          if (!dead[uj] && j != me) dead[uj] = e.store()->check(Liveness::death_key(e.key_prefix(), j));
          if (in[uj] && !dead[uj]) live.push_back(j);
          if (!in[uj] && !dead[uj]) missing.push_back(j);
        }
        if (missing.empty()) {
          std::int64_t grows = 0;
          for (int j : live) grows = std::max(grows, elastic::number(elastic::text(base.get(k + "in/" + std::to_string(j)))));
          seal = elastic::cas(base, k + "seal", {}, elastic::rank_list(live) + ";" + std::to_string(grows));
          break;
        }
        if (std::chrono::steady_clock::now() >= deadline) {
          seal = elastic::cas(base, k + "seal", {}, "!" + elastic::rank_list(missing));
          break;
        }
        std::this_thread::sleep_for(pause);
      }
      if (seal.starts_with('!')) {
        const auto missing = elastic::parse_ranks(std::string_view(seal).substr(1), n);
        throw Timeout("shrink", me,
                      (missing.empty() ? std::string("some ranks") : elastic::named(missing)) +
                          " neither called shrink() nor were known dead by the deadline (" +
                          std::to_string(e.timeout().count()) + " ms); no new communicator was formed",
                      missing.empty() ? std::string() : "rank " + std::to_string(missing.front()));
      }
      const auto semi = seal.find(';');
      grows = semi == std::string::npos ? -1 : elastic::number(std::string_view(seal).substr(semi + 1));
      members = elastic::parse_ranks(std::string_view(seal).substr(0, semi), n);
      if (members.empty() || grows < 0)
        throw BackendError("shrink", me, "the store holds a malformed outcome '" + seal + "'");
    } catch (const InvalidArgument&) {
      throw;
    } catch (const Timeout& t) {
      if (std::string_view(t.op()) == "shrink") throw;
      store_lost("shrink", t);
    } catch (const Error& err) {
      store_lost("shrink", err);
    }
    const auto pos = std::find(members.begin(), members.end(), me);
    if (pos == members.end())
      throw RemoteError("shrink", me,
                        "the other members formed the new communicator without this rank (they agreed before it took "
                        "part, or took it for dead)");
    Lineage next{lin.base, lin.room, lin.epoch + 1, static_cast<std::uint64_t>(grows), 0};
    // A policy that makes the new communicator from the old one (NCCL: ncclCommShrink) does it here.
    if constexpr (requires(Policy& p, const std::vector<int>& m, std::shared_ptr<Store> s,
                           std::chrono::steady_clock::time_point t) { p.shrink_from_members(m, s, 0, 1, t); }) {
      Policy p = self().shrink_from_members(members, std::make_shared<PrefixStore>(k + "comm", lin.base),
                                            static_cast<int>(pos - members.begin()), static_cast<int>(members.size()),
                                            retired_by);
      p.engine_->continue_lineage(std::move(next));
      return p;
    } else {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(retired_by - std::chrono::steady_clock::now());
      if (!e.wait_retired(std::max(left, std::chrono::milliseconds(0))))
        log(LogLevel::warn, "comm: shrink on rank " + std::to_string(me) +
                                ": an operation of the old communicator still runs (it ends by its own deadline)");
      return connect(std::make_shared<PrefixStore>(k + "comm", lin.base), static_cast<int>(pos - members.begin()),
                     static_cast<int>(members.size()), self().options_, std::move(next));
    }
  }

  /// The members and every process waiting to join (see the file comment). With nobody waiting
  /// this communicator itself, for one store round trip: use the returned one (`c = c.grow();`),
  /// this one may then only be destroyed or assigned to.
  [[nodiscard]] Policy grow() {
    auto& e = engine();
    Lineage& lin = lineage("grow");
    if (e.has_failed())
      throw InvalidArgument("grow", e.rank(),
                            "the communicator has failed (" + e.failure_text() + "); shrink() it first, then grow()");
    const std::uint64_t g = lin.next_grow++;
    const std::string key = lin.room + "g/" + std::to_string(g);
    Store& base = *lin.base;
    std::int64_t joined = -1;
    try {
      std::string v = elastic::cas(base, key, {}, "c0");
      for (int guard = 0; joined < 0; ++guard) {
        if (v.starts_with('c')) {
          joined = elastic::number(std::string_view(v).substr(1));
          if (joined < 0) break;
        } else if (v.starts_with('j') && guard < 1 << 20) {
          const auto colon = v.find(':');
          const auto k = elastic::number(std::string_view(v).substr(1, colon == std::string::npos ? 0 : colon - 1));
          if (k < 1) break;
          v = elastic::cas(base, key, v, "c" + std::to_string(k));  // close it: later newcomers wait for the next
        } else {
          break;
        }
      }
      if (joined < 0 || joined > (1 << 20)) throw BackendError("grow", e.rank(), "the store holds a malformed grow record");
      if (e.rank() == 0 && (g + 1) % elastic::kMarkEvery == 0) base.set(lin.room + "gmark", elastic::bytes(std::to_string(g + 1)));
      if (joined == 0) return Policy(std::move(self()));
      const int size = e.size() + static_cast<int>(joined);
      if (e.rank() == 0)
        base.set(key + "/admit", elastic::bytes(std::to_string(size) + "|" + std::to_string(e.size()) + "|" +
                                                std::to_string(lin.epoch + 1)));
    } catch (const InvalidArgument&) {
      throw;
    } catch (const Error& err) {
      store_lost("grow", err);
    }
    log(LogLevel::info, "comm: grow(): " + std::to_string(joined) + " process(es) join " + std::to_string(e.size()) +
                            " member(s) on rank " + std::to_string(e.rank()));
    Lineage next{lin.base, lin.room, lin.epoch + 1, g + 1, 0};
    return connect(std::make_shared<PrefixStore>(key + "/comm", lin.base), e.rank(),
                   e.size() + static_cast<int>(joined), self().options_, std::move(next));
  }

  /// Ends every member's pending and future operations on this communicator at once (RemoteError
  /// naming this rank); `reason` is added to their error.
  void revoke(std::string_view reason = {}) { engine().revoke(std::string(reason)); }

  /// No process joins this lineage any more: those waiting in join() and any that come later get
  /// comm::InvalidArgument ("join: the job has finished"). One store call; any member may make it.
  void close_joins() {
    Lineage& lin = lineage("close_joins");
    lin.base->set(lin.room + "closed", elastic::bytes("1"));
  }

  /// A replacement process: waits (to `timeout`) until the members of the job's first `Policy`
  /// communicator on `store` call grow(), and returns its place in the grown communicator.
  /// (`Options`: the policy's, a template only because the policy is incomplete here.)
  template <class Options>
  [[nodiscard]] static Policy join(std::shared_ptr<Store> store, const Options& options,
                                   std::chrono::milliseconds timeout) {
    const std::string room = "comm/" + std::string(Policy::name) + "/1/elastic/";
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (store->check(room + "closed")) throw_closed();
    std::uint64_t g = 0;
    if (store->check(room + "gmark")) {
      const auto m = elastic::number(elastic::text(store->get(room + "gmark")));
      if (m > 0) g = static_cast<std::uint64_t>(m);
    }
    // A nonce, so that two newcomers' claims never look alike.
    const std::string nonce = std::to_string(random_u64());
    std::int64_t index = 0;
    std::string key;
    for (;; ++g) {
      key = room + "g/" + std::to_string(g);
      std::string want = "j1:" + nonce;
      std::string v = elastic::cas(*store, key, {}, want);
      while (v != want && v.starts_with('j')) {  // others wait here too: take the next place
        const auto colon = v.find(':');
        const auto k = elastic::number(std::string_view(v).substr(1, colon == std::string::npos ? 0 : colon - 1));
        if (k < 1) throw BackendError("join", -1, "the store holds a malformed grow record at " + key);
        want = "j" + std::to_string(k + 1) + ":" + nonce;
        v = elastic::cas(*store, key, v, want);
      }
      if (v == want) {
        index = elastic::number(std::string_view(v).substr(1, v.find(':') - 1));
        break;
      }
      if (!v.starts_with('c')) throw BackendError("join", -1, "the store holds a malformed grow record at " + key);
      // Closed: those members have grown already; wait at the next one.
    }
    // Wait for the admission, in slices, so that a job that finishes meanwhile (close_joins) is
    // seen within one.
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0)
        throw Timeout("join", -1,
                      "no member of the job's " + std::string(Policy::name) + " communicator called grow() within " +
                          std::to_string(timeout.count()) + " ms (this process waits to replace a rank)");
      try {
        store->wait({key + "/admit"}, std::min(left, std::chrono::milliseconds(100)));
        break;
      } catch (const Timeout&) {
      }
      if (store->check(room + "closed")) throw_closed();
    }
    const std::string admit = elastic::text(store->get(key + "/admit"));
    const auto b1 = admit.find('|'), b2 = admit.rfind('|');
    const auto size = elastic::number(std::string_view(admit).substr(0, b1));
    const auto members = b1 == std::string::npos ? -1 : elastic::number(std::string_view(admit).substr(b1 + 1, b2 - b1 - 1));
    const auto epoch = b2 == b1 ? -1 : elastic::number(std::string_view(admit).substr(b2 + 1));
    if (size < 1 || members < 1 || epoch < 1 || members + index > size || size > (1 << 24))
      throw BackendError("join", -1, "the store holds a malformed admission '" + admit + "' at " + key);
    const int rank = static_cast<int>(members + index - 1);
    log(LogLevel::info, "comm: joined as rank " + std::to_string(rank) + " of " + std::to_string(size));
    return connect(std::make_shared<PrefixStore>(key + "/comm", store), rank, static_cast<int>(size), options,
                   Lineage{store, room, static_cast<std::uint64_t>(epoch), g + 1, 0});
  }

 private:
  [[noreturn]] static void throw_closed() {
    throw InvalidArgument("join", -1,
                          "the job has finished: its members closed it to newcomers (close_joins); nothing to rejoin");
  }

  [[nodiscard]] Policy& self() noexcept { return static_cast<Policy&>(*this); }
  [[nodiscard]] auto& engine() {
    auto* e = self().engine_.get();
    if (e == nullptr) throw InvalidArgument("shrink/grow", -1, "this communicator was moved from (use the one grow() returned)");
    return *e;
  }

  Lineage& lineage(const char* op) {
    auto& e = engine();
    Lineage& lin = e.lineage();
    if (lin.room.empty() || !lin.base)
      throw InvalidArgument(op, e.rank(),
                            std::string(op) +
                                " needs a root communicator made with create() or from_env() (a subgroup or an adopted "
                                "communicator has no lineage: " +
                                op + " the communicator it came from)");
    return lin;
  }

  /// A store failure during shrink/grow: where the store lived in a rank of this communicator,
  /// that rank's death took it.
  [[noreturn]] void store_lost(const char* op, const Error& err) {
    auto& e = engine();
    const int host = e.store_host();
    if (host >= 0 && host != e.rank())
      throw RemoteError(op, e.rank(),
                        "the store is gone with rank " + std::to_string(host) +
                            ", which hosted it: reconfiguring needs a store that outlives every rank (comm-run hosts "
                            "it; COMM_AGENT_STORE=1); " +
                            err.what(),
                        "rank " + std::to_string(host));
    throw;
  }

  template <class Options>
  static Policy connect(std::shared_ptr<Store> store, int rank, int size, const Options& options, Lineage next) {
    Policy p = Policy::create(std::move(store), rank, size, options);
    p.engine_->continue_lineage(std::move(next));
    return p;
  }
};

}  // namespace comm::detail
