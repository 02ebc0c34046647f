#pragma once
// The one place where gloo's exceptions become comm errors (the engine's checking point).
//   gloo::IoException mentioning a timeout   -> comm::Timeout
//   other gloo::IoException (peer closed...)  -> comm::RemoteError
//   gloo::EnforceNotMet, gloo::Exception, std::exception -> comm::BackendError
// comm::Error passes through unchanged. The text of the original exception is kept verbatim,
// except that a peer address gloo names ("[127.0.0.1]:41234") is followed by the rank it belongs
// to when the communicator knows it (PeerNames, learnt at connect), and the error's peer() is
// then "rank R".

#include <cctype>
#include <exception>
#include <map>
#include <string>
#include <string_view>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/transport/tcp/address.h>

#include <comm/detail/engine/failure.hpp>
#include <comm/error.hpp>

namespace comm::detail::gloo {

[[nodiscard]] inline bool mentions_timeout(std::string_view s) {
  for (std::size_t i = 0; i + 4 <= s.size(); ++i) {
    // case-insensitive "time" followed by "out" or "d out": "timeout", "Timed out", "time out"
    auto lower = [&](std::size_t k) { return static_cast<char>(std::tolower(static_cast<unsigned char>(s[k]))); };
    if (lower(i) == 't' && lower(i + 1) == 'i' && lower(i + 2) == 'm' && lower(i + 3) == 'e') {
      std::string_view rest = s.substr(i + 4);
      if (rest.starts_with("out") || rest.starts_with("d out") || rest.starts_with(" out")) return true;
    }
  }
  return false;
}

/// The peer address gloo names in a message ("... by peer [127.0.0.1]:41234"), or "".
[[nodiscard]] inline std::string peer_in(std::string_view s) {
  // gloo prefixes messages with "[file:line] "; peers are the later "[addr]:port" groups.
  std::size_t from = 0;
  if (s.starts_with('[')) from = s.find("] ");
  if (from == std::string_view::npos) return {};
  const auto open = s.find('[', from == 0 ? 0 : from + 1);
  if (open == std::string_view::npos) return {};
  const auto close = s.find(']', open);
  if (close == std::string_view::npos || close + 1 >= s.size() || s[close + 1] != ':') return {};
  auto end = close + 2;
  while (end < s.size() && std::isdigit(static_cast<unsigned char>(s[end]))) ++end;
  return std::string(s.substr(open, end - open));
}

/// Which rank of one communicator listens at which address, as gloo prints addresses in its
/// messages ("[127.0.0.1]:41234"). Filled while connecting (StoreAdapter), read-only afterwards.
class PeerNames {
 public:
  void learn(std::string address, int rank) { by_address_[std::move(address)] = rank; }
  /// This rank listens at `address` for its pair with `rank` (gloo accepts that rank's connection
  /// there; learn_accepted() then learns the remote end of it).
  void listening(std::string address, int rank) { listeners_[std::move(address)] = rank; }

  /// gloo names the peer of a pair it accepted by the peer's ephemeral address, which no store
  /// holds: learn those from the kernel's socket table (our listeners' established connections).
  void learn_accepted() {
    if (listeners_.empty()) return;
    for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
      std::ifstream in(table);
      std::string line;
      std::getline(in, line);  // header
      while (std::getline(in, line)) {
        char local[64] = {}, remote[64] = {};
        unsigned state = 0;
        if (std::sscanf(line.c_str(), "%*s %63s %63s %x", local, remote, &state) != 3 || state != 1) continue;
        const auto l = address_of(local), r = address_of(remote);
        if (l.empty() || r.empty()) continue;
        if (const auto it = listeners_.find(l); it != listeners_.end()) learn(r, it->second);
      }
    }
  }

  /// gloo's text for a socket address ("[ip]:port", without a "$seq" suffix).
  [[nodiscard]] static std::string gloo_text(const sockaddr_storage& ss) {
    try {
      std::string a = ::gloo::transport::tcp::Address(ss).str();
      if (const auto seq = a.rfind('$'); seq != std::string::npos) a.resize(seq);
      return a;
    } catch (...) {
      return {};
    }
  }
  [[nodiscard]] bool empty() const noexcept { return by_address_.empty(); }
  /// The rank at `address`, or -1.
  [[nodiscard]] int rank_of(const std::string& address) const {
    const auto it = by_address_.find(address);
    return it == by_address_.end() ? -1 : it->second;
  }
  /// `text` with " (rank R)" after every address of a known rank.
  [[nodiscard]] std::string annotate(std::string text) const {
    for (const auto& [addr, r] : by_address_) {
      const std::string tag = " (rank " + std::to_string(r) + ")";
      for (auto at = text.find(addr); at != std::string::npos; at = text.find(addr, at)) {
        auto end = at + addr.size();
        if (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) {  // a longer port
          at = end;
          continue;
        }
        while (end < text.size() && text[end] == '$') {  // gloo's "$seq" suffix
          ++end;
          while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end]))) ++end;
        }
        text.insert(end, tag);
        at = end + tag.size();
      }
    }
    return text;
  }

 private:
  // "0100007F:8189" (IPv4) or 32 hex digits + ":PORT" (IPv6), as /proc/net/tcp* print them.
  [[nodiscard]] static std::string address_of(std::string_view hex) {
    const auto colon = hex.find(':');
    if (colon == std::string_view::npos) return {};
    const std::string addr(hex.substr(0, colon));
    const auto port = static_cast<std::uint16_t>(std::strtoul(std::string(hex.substr(colon + 1)).c_str(), nullptr, 16));
    sockaddr_storage ss{};
    if (addr.size() == 8) {
      auto* a = reinterpret_cast<sockaddr_in*>(&ss);
      a->sin_family = AF_INET;
      a->sin_port = htons(port);
      a->sin_addr.s_addr = static_cast<std::uint32_t>(std::strtoul(addr.c_str(), nullptr, 16));  // as stored
    } else if (addr.size() == 32) {
      auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
      a->sin6_family = AF_INET6;
      a->sin6_port = htons(port);
      for (int w = 0; w < 4; ++w) {
        const auto v = static_cast<std::uint32_t>(std::strtoul(addr.substr(static_cast<std::size_t>(w) * 8, 8).c_str(), nullptr, 16));
        std::memcpy(a->sin6_addr.s6_addr + 4 * w, &v, 4);
      }
    } else {
      return {};
    }
    return gloo_text(ss);
  }

  std::map<std::string, int> by_address_;
  std::map<std::string, int> listeners_;
};

/// Call inside a catch block: rethrows the active exception as a comm::Error for `op` on `rank`;
/// with `peers`, addresses in the text are named by rank and peer() is "rank R".
[[noreturn]] inline void rethrow_translated(const std::string& op, int rank, const PeerNames* peers = nullptr) {
  auto name = [&](std::string text) { return peers != nullptr ? peers->annotate(std::move(text)) : text; };
  auto peer_of = [&](const std::string& text) {
    std::string addr = peer_in(text);
    if (peers != nullptr && !addr.empty()) {
      if (const int r = peers->rank_of(addr); r >= 0) return "rank " + std::to_string(r);
    }
    return addr;
  };
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const ::gloo::IoException& e) {
    const std::string text = e.what();
    throw_as(mentions_timeout(text) ? FailureKind::timeout : FailureKind::remote, op, rank, "gloo: " + name(text),
             peer_of(text));
  } catch (const ::gloo::EnforceNotMet& e) {
    throw BackendError(op, rank, "gloo: " + name(e.what()), peer_of(e.what()));
  } catch (const ::gloo::Exception& e) {
    throw BackendError(op, rank, "gloo: " + name(e.what()), peer_of(e.what()));
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    throw BackendError(op, rank, e.what());
  } catch (...) {
    throw BackendError(op, rank, "unknown exception");
  }
}

}  // namespace comm::detail::gloo
