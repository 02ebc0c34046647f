#pragma once
// The one checking point for NCCL and one for CUDA: every failing call becomes a comm::Error that
// keeps the native code (ncclResult_t / cudaError_t, see comm::nccl::nccl_result_of and
// cuda_error_of) and the engine's own text (ncclGetErrorString + ncclGetLastError, or
// cudaGetErrorString).
//
//   ncclInvalidArgument, ncclInvalidUsage -> comm::InvalidArgument (the call had no effect)
//   ncclRemoteError                       -> comm::RemoteError
//   anything else, every CUDA error       -> comm::BackendError
//
// COMM_NCCL_CHECK(expr, op, rank, handle) evaluates to the ncclResult_t, which is ncclSuccess or,
// for a non-blocking communicator, ncclInProgress; any other result throws.
// COMM_CUDA_CHECK(expr, op, rank) throws on anything but cudaSuccess.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include <comm/error.hpp>

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 21400
#error "comm: the NCCL backend needs NCCL 2.14 or newer (non-blocking communicators, ncclGetLastError)"
#endif

namespace comm::detail::nccl {

/// Which engine produced a native error code.
enum class NativeEngine { nccl, cuda };

/// Mixed into every comm::Error this backend throws for a failing NCCL or CUDA call.
class NativeCode {
 public:
  NativeCode(NativeEngine e, int code) noexcept : engine_(e), code_(code) {}
  virtual ~NativeCode() = default;
  [[nodiscard]] NativeEngine engine() const noexcept { return engine_; }
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  NativeEngine engine_;
  int code_;
};

/// A comm error of kind `Base` (InvalidArgument, Timeout, RemoteError, BackendError) that also
/// carries the native code.
template <class Base>
class EngineError final : public Base, public NativeCode {
 public:
  EngineError(NativeEngine e, int code, std::string op, int rank, std::string detail, std::string peer = {})
      : Base(std::move(op), rank, std::move(detail), std::move(peer)), NativeCode(e, code) {}
};

[[nodiscard]] constexpr std::string_view result_name(ncclResult_t r) noexcept {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: break;
  }
  return "ncclResult_t";
}

/// "ncclAllReduce" from "ncclAllReduce(a, b, ...)": the call's name, for messages.
[[nodiscard]] inline std::string call_name(std::string_view expr) {
  const auto paren = expr.find('(');
  std::string_view name = expr.substr(0, paren);
  while (!name.empty() && (name.back() == ' ' || name.back() == '\t')) name.remove_suffix(1);
  const auto colons = name.rfind("::");
  if (colons != std::string_view::npos) name.remove_prefix(colons + 2);
  return std::string(name);
}

/// "<text> [<name> = <code>]; NCCL: <last error>" for a failed NCCL result.
[[nodiscard]] inline std::string describe(ncclResult_t r, ncclComm_t comm) {
  const char* text = ncclGetErrorString(r);
  std::string s = text != nullptr ? text : "unknown NCCL error";
  s += " [" + std::string(result_name(r)) + " = " + std::to_string(static_cast<int>(r)) + "]";
  // ncclGetLastError is per-thread in NCCL; it may describe an earlier failure, so it is labelled.
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += "; NCCL last error: " + std::string(last);
  return s;
}

/// "<text> [<name> = <code>]" for a CUDA error.
[[nodiscard]] inline std::string describe(cudaError_t e) {
  const char* text = cudaGetErrorString(e);
  const char* name = cudaGetErrorName(e);
  return std::string(text != nullptr ? text : "unknown CUDA error") + " [" + (name != nullptr ? name : "cudaError_t") +
         " = " + std::to_string(static_cast<int>(e)) + "]";
}

/// Throws the comm error for a failed NCCL result `r` of `call` during `op` on `rank`.
[[noreturn]] inline void throw_nccl(ncclResult_t r, const std::string& call, const std::string& op, int rank,
                                    ncclComm_t comm, const std::string& hint = {}) {
  std::string detail = call + " failed: " + describe(r, comm);
  if (!hint.empty()) detail += " (" + hint + ")";
  const int code = static_cast<int>(r);
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: throw EngineError<InvalidArgument>(NativeEngine::nccl, code, op, rank, std::move(detail));
    case ncclRemoteError: throw EngineError<RemoteError>(NativeEngine::nccl, code, op, rank, std::move(detail));
    default: break;
  }
  throw EngineError<BackendError>(NativeEngine::nccl, code, op, rank, std::move(detail));
}

/// Throws the comm error for a failed CUDA call.
[[noreturn]] inline void throw_cuda(cudaError_t e, const std::string& call, const std::string& op, int rank,
                                    const std::string& prefix = {}) {
  throw EngineError<BackendError>(NativeEngine::cuda, static_cast<int>(e), op, rank, prefix + call + " failed: " + describe(e));
}

/// The body of COMM_NCCL_CHECK: ncclSuccess and ncclInProgress pass through, the rest throws.
inline ncclResult_t check_nccl(ncclResult_t r, std::string_view expr, std::string_view op, int rank,
                               ncclComm_t comm) {
  if (r == ncclSuccess || r == ncclInProgress) [[likely]]
    return r;
  throw_nccl(r, call_name(expr), std::string(op), rank, comm);
}

/// The body of COMM_CUDA_CHECK.
inline void check_cuda(cudaError_t e, std::string_view expr, std::string_view op, int rank) {
  if (e == cudaSuccess) [[likely]]
    return;
  // Clear a non-sticky error so that the next, unrelated call does not report it again.
  (void)cudaGetLastError();
  throw_cuda(e, call_name(expr), std::string(op), rank);
}

}  // namespace comm::detail::nccl

/// Checks an NCCL call: evaluates to ncclSuccess or ncclInProgress, throws a comm::Error otherwise
/// (naming `op` and `rank`, with the native code and NCCL's text).
#define COMM_NCCL_CHECK(expr, op, rank, handle) ::comm::detail::nccl::check_nccl((expr), #expr, (op), (rank), (handle))

/// Checks a CUDA runtime call: throws comm::BackendError (with the native code) on failure.
#define COMM_CUDA_CHECK(expr, op, rank) ::comm::detail::nccl::check_cuda((expr), #expr, (op), (rank))

namespace comm::nccl {

/// The ncclResult_t behind an error this backend threw for a failing NCCL call, if it was one.
[[nodiscard]] inline std::optional<ncclResult_t> nccl_result_of(const std::exception& e) noexcept {
  const auto* n = dynamic_cast<const detail::nccl::NativeCode*>(&e);
  if (n == nullptr || n->engine() != detail::nccl::NativeEngine::nccl) return std::nullopt;
  return static_cast<ncclResult_t>(n->code());
}

/// The cudaError_t behind an error this backend threw for a failing CUDA call, if it was one.
[[nodiscard]] inline std::optional<cudaError_t> cuda_error_of(const std::exception& e) noexcept {
  const auto* n = dynamic_cast<const detail::nccl::NativeCode*>(&e);
  if (n == nullptr || n->engine() != detail::nccl::NativeEngine::cuda) return std::nullopt;
  return static_cast<cudaError_t>(n->code());
}

}  // namespace comm::nccl
