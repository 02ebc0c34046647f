#pragma once
/// \file
/// The exception hierarchy. Every error a user can cause or observe is a `comm::Error`;
/// the message always names the operation and the rank, and the peer where one is known.

#include <exception>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace comm {

/// Base of every error thrown by comm. `op()` is the operation ("all_reduce", "store.get",
/// "init"...), `rank()` the calling rank (-1 where none is known yet), `peer()` the remote
/// rank or address involved where known, `detail()` the bare cause without the prefix.
class Error : public std::runtime_error {
 public:
  /// An error of operation `op` on rank `rank` (-1: unknown) involving `peer` (may be empty):
  /// what() is "comm: <op> on rank <rank> (peer <peer>): <detail>".
  Error(std::string op, int rank, std::string detail, std::string peer = {})
      : std::runtime_error(format(op, rank, detail, peer)),
        op_(std::move(op)),
        rank_(rank),
        peer_(std::move(peer)),
        detail_(std::move(detail)) {}

  /// The operation that failed ("all_reduce", "store.get", "init", ...).
  [[nodiscard]] const std::string& op() const noexcept { return op_; }
  /// The calling rank; -1 where none was known yet.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The remote rank or address involved; empty where none is known.
  [[nodiscard]] const std::string& peer() const noexcept { return peer_; }
  [[nodiscard]] const std::string& detail() const noexcept { return detail_; }

 private:
  static std::string format(const std::string& op, int rank, const std::string& detail,
                            const std::string& peer) {
    std::string s = "comm: " + op;
    if (rank >= 0) s += " on rank " + std::to_string(rank);
    if (!peer.empty()) s += " (peer " + peer + ")";
    s += ": " + detail;
    return s;
  }

  std::string op_;
  int rank_;
  std::string peer_;
  std::string detail_;
};

/// A caller mistake detected before anything was sent: wrong sizes, bad root, bad env values.
class InvalidArgument : public Error {
 public:
  /// Same constructor as comm::Error.
  using Error::Error;
};

/// A blocking call reached its deadline. The operation may still be running elsewhere.
class Timeout : public Error {
 public:
  /// Same constructor as comm::Error.
  using Error::Error;
};

/// Ranks called different collectives (operation, element type, count, root or reduction) at the
/// same point of a communicator's sequence, found by the desync check (backend option
/// `desync_check`, on by default with COMM_DEBUG=DETAIL). Thrown on every rank, before the
/// operation sends anything, with a message naming both sides ("rank 1 called broadcast(float x4,
/// root 0) while rank 0 called all_reduce(float x4, sum) at op #17"); the communicator stays usable.
class DesyncError : public InvalidArgument {
 public:
  using InvalidArgument::InvalidArgument;
};

/// A peer failed, closed its connection, or reported an error of its own.
class RemoteError : public Error {
 public:
  /// Same constructor as comm::Error.
  using Error::Error;
};

/// The engine (libgloo, libnccl, CUDA, the OS) reported a failure; the text keeps its own message.
class BackendError : public Error {
 public:
  /// Same constructor as comm::Error.
  using Error::Error;
};

namespace detail {

/// The text of exception `e`: what() of a std::exception, else `unknown`. May throw bad_alloc.
[[nodiscard]] inline std::string exception_text(const std::exception_ptr& e, const char* unknown) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return unknown;
}

/// In a catch block: comm::Error and std::bad_alloc go on as they are, any other std::exception
/// becomes BackendError from `op` on `rank` with its text, anything else goes on as it is or, with
/// `unknown`, becomes BackendError(`unknown`).
[[noreturn]] inline void rethrow_as_error(const char* op, int rank, const char* unknown = nullptr) {
  try {
    throw;
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::exception& e) {
    throw BackendError(op, rank, e.what());
  } catch (...) {
    if (unknown == nullptr) throw;
    throw BackendError(op, rank, unknown);
  }
}

}  // namespace detail

}  // namespace comm
