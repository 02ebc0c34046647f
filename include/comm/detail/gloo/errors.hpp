#pragma once
// The one place where gloo's exceptions become comm errors (the engine's checking point).
//   gloo::IoException mentioning a timeout   -> comm::Timeout
//   other gloo::IoException (peer closed...)  -> comm::RemoteError
//   gloo::EnforceNotMet, gloo::Exception, std::exception -> comm::BackendError
// comm::Error passes through unchanged. The text of the original exception is kept verbatim.

#include <cctype>
#include <exception>
#include <string>
#include <string_view>

#include <gloo/common/error.h>
#include <gloo/common/logging.h>

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

/// Call inside a catch block: rethrows the active exception as a comm::Error for `op` on `rank`.
[[noreturn]] inline void rethrow_translated(const std::string& op, int rank) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const ::gloo::IoException& e) {
    const std::string text = e.what();
    throw_as(mentions_timeout(text) ? FailureKind::timeout : FailureKind::remote, op, rank, "gloo: " + text,
             peer_in(text));
  } catch (const ::gloo::EnforceNotMet& e) {
    throw BackendError(op, rank, std::string("gloo: ") + e.what());
  } catch (const ::gloo::Exception& e) {
    throw BackendError(op, rank, std::string("gloo: ") + e.what());
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    throw BackendError(op, rank, e.what());
  } catch (...) {
    throw BackendError(op, rank, "unknown exception");
  }
}

}  // namespace comm::detail::gloo
