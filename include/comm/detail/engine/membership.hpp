#pragma once
// The membership check at rendezvous, before a backend connects (backend-neutral).
//
// Each rank publishes "<prefix>member/<rank>" = "size=<n> pid=<pid> host=<host>", then reads the
// records of every rank of its world. A rank whose record says another world size is a
// comm::InvalidArgument naming both processes, on both sides, in the time it takes the two to
// arrive (without the check Gloo failed later with "136 vs 272", or waited). Two processes with
// the same rank cannot meet under one prefix (the communicator number comes from a per-rank
// counter, so the second gets the next number); the one left waiting names, at its deadline, the
// process that holds its rank in the previous communicator when that is another process.

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <comm/error.hpp>
#include <comm/store.hpp>

namespace comm::detail {

struct MemberRecord {
  int size = -1;
  long pid = -1;
  std::string host;
};

[[nodiscard]] inline std::string this_host() {
  std::array<char, 256> buf{};
  if (::gethostname(buf.data(), buf.size() - 1) != 0) return "?";
  return buf.data();
}

[[nodiscard]] inline std::string encode(const MemberRecord& m) {
  return "size=" + std::to_string(m.size) + " pid=" + std::to_string(m.pid) + " host=" + m.host;
}

[[nodiscard]] inline std::optional<MemberRecord> decode_member(std::string_view s) {
  MemberRecord m;
  auto field = [&](std::string_view name) -> std::optional<std::string_view> {
    const auto at = s.find(name);
    if (at == std::string_view::npos) return std::nullopt;
    auto v = s.substr(at + name.size());
    return v.substr(0, v.find(' '));
  };
  const auto size = field("size=");
  const auto pid = field("pid=");
  const auto host = field("host=");
  if (!size || !pid || !host) return std::nullopt;
  try {
    m.size = std::stoi(std::string(*size));
    m.pid = std::stol(std::string(*pid));
  } catch (...) {
    return std::nullopt;
  }
  m.host = std::string(*host);
  return m;
}

[[nodiscard]] inline std::string describe(int rank, const MemberRecord& m) {
  return "rank " + std::to_string(rank) + " (pid " + std::to_string(m.pid) + " on " + m.host + ", world size " +
         std::to_string(m.size) + ")";
}

/// Publishes this rank's record under `prefix` and checks every other rank's; `seq` is this
/// communicator's number on the store (for the duplicate-rank hint); `op` names the init step in errors.
inline void check_membership(comm::Store& store, const std::string& prefix, std::uint64_t seq, int rank, int size,
                             std::chrono::milliseconds timeout, const std::string& op) {
  const MemberRecord me{size, static_cast<long>(::getpid()), this_host()};
  auto key_of = [&](int p) { return prefix + "member/" + std::to_string(p); };
  store.set(key_of(rank), encode(me));
  auto check_record = [&](int p, const Store::Bytes& bytes) {
    const auto other = decode_member(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
    if (!other)
      throw InvalidArgument(op, rank, "rank " + std::to_string(p) + "'s membership record " + key_of(p) +
                                          " is not comm's: another program uses this store's keys?");
    if (other->size != size)
      throw InvalidArgument(op, rank,
                            "world size mismatch: this process is " + describe(rank, me) + ", but " +
                                describe(p, *other) + "; every rank must be started with the same world size");
  };
  auto missing = [&](int p) {
    std::string hint;
    // A process that holds this rank in the previous communicator of this store, and is not
    // this process, is most likely a second process started with the same rank.
    if (seq > 1) {
      const std::string prev =
          prefix.substr(0, prefix.rfind('/', prefix.size() - 2) + 1) + std::to_string(seq - 1) + "/member/" +
          std::to_string(rank);
      try {
        if (store.check(prev)) {
          const auto bytes = store.get(prev);
          const auto other = decode_member(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
          if (other && (other->pid != me.pid || other->host != me.host))
            hint = "; " + describe(rank, *other) + " already joined communicator #" + std::to_string(seq - 1) +
                   " of this store as rank " + std::to_string(rank) + ", while this process " + describe(rank, me) +
                   " waits alone in communicator #" + std::to_string(seq) + ": is rank " + std::to_string(rank) +
                   " used by two processes?";
        }
      } catch (...) {  // the hint is best effort; the timeout is the error
      }
    }
    return Timeout(op, rank,
                   "rank " + std::to_string(p) + " of " + std::to_string(size) + " did not join within " +
                       std::to_string(timeout.count()) + " ms (no record " + key_of(p) + ")" + hint,
                   "rank " + std::to_string(p));
  };
  // Each wait gets the whole timeout, as in the engines' own address exchanges: the rank that hosts
  // the store (rank 0, which starts first) then waits for a missing rank longer than the others, so
  // they report the missing rank instead of losing the store when it gives up.
  // Rank 0's record first: a world size that differs from rank 0's is then an error at once.
  if (rank != 0) {
    try {
      store.wait({key_of(0)}, timeout);
    } catch (const Timeout&) {
      throw missing(0);
    }
    check_record(0, store.get(key_of(0)));
  }
  // Then every other record in one request (Store::multi_get: one round trip on a TcpStore, where
  // a wait and a get per rank made a rendezvous of N ranks cost 2N^2 requests). Highest rank
  // first: a parked request waits on its first missing key, and launchers start ranks in order,
  // so it waits on about the last to come instead of stepping on with every rank that joins (N^2
  // steps across the server for N ranks: benchmarks/RESULTS.md, "Control plane on a slower VM").
  std::vector<int> ranks;
  std::vector<std::string> keys;
  for (int p = size - 1; p >= 1; --p)
    if (p != rank) {
      ranks.push_back(p);
      keys.push_back(key_of(p));
    }
  if (keys.empty()) return;
  std::vector<Store::Bytes> records;
  try {
    records = store.multi_get(keys, timeout);
  } catch (const Timeout&) {
    // As one rank at a time would have found: a mismatch before the first missing rank wins.
    int first_missing = ranks.back();
    try {
      for (auto it = ranks.rbegin(); it != ranks.rend(); ++it) {  // lowest rank first
        const int p = *it;
        if (!store.check(key_of(p))) {
          first_missing = p;
          break;
        }
        check_record(p, store.get(key_of(p)));
      }
    } catch (const InvalidArgument&) {
      throw;
    } catch (...) {  // naming the first missing rank is best effort
    }
    throw missing(first_missing);
  }
  if (records.size() != keys.size())
    throw InvalidArgument(op, rank, "the store's multi_get returned " + std::to_string(records.size()) +
                                        " values for " + std::to_string(keys.size()) + " keys");
  for (std::size_t i = ranks.size(); i-- > 0;) check_record(ranks[i], records[i]);  // lowest rank first
}

}  // namespace comm::detail
