#pragma once
// The one checking point for MPI calls: a failing call becomes a comm::BackendError that keeps the
// native code (MPI error code and class, see comm::mpi::error_code_of) and MPI's own text
// (MPI_Error_string). comm's communicators set MPI_ERRORS_RETURN on their own MPI communicators,
// so failures come back here instead of aborting the job.
//
//   COMM_MPI_CHECK(expr, op, rank)   evaluates `expr`; anything but MPI_SUCCESS throws.

#include <mpi.h>

#include <exception>
#include <optional>
#include <string>

#include <comm/error.hpp>

namespace comm::detail::mpi {

/// A comm::BackendError from a failing MPI call, with the code MPI returned.
class EngineError final : public BackendError {
 public:
  EngineError(int code, std::string op, int rank, std::string detail)
      : BackendError(std::move(op), rank, std::move(detail)), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// "MPI_ERR_TRUNCATE: message truncated (code 15, class 15)": MPI's text for `code`.
[[nodiscard]] inline std::string error_text(int code) {
  char buf[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  std::string text;
  if (MPI_Error_string(code, buf, &len) == MPI_SUCCESS && len > 0)
    text.assign(buf, static_cast<std::size_t>(len));
  else
    text = "unknown MPI error";
  int cls = -1;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) cls = -1;
  return text + " (code " + std::to_string(code) + ", class " + std::to_string(cls) + ")";
}

/// `call` is the failing expression's text; its function name is kept ("MPI_Iallreduce").
[[noreturn]] inline void throw_mpi_error(int code, const char* call, const char* op, int rank) {
  std::string name(call);
  name = name.substr(0, name.find('('));
  throw EngineError(code, op, rank, name + " failed: " + error_text(code));
}

}  // namespace comm::detail::mpi

/// Throws comm::detail::mpi::EngineError (a comm::BackendError) naming `op`, `rank` and the MPI
/// call when `expr` does not return MPI_SUCCESS.
#define COMM_MPI_CHECK(expr, op, rank)                                                 \
  do {                                                                                 \
    const int comm_mpi_rc_ = (expr);                                                   \
    if (comm_mpi_rc_ != MPI_SUCCESS)                                                   \
      ::comm::detail::mpi::throw_mpi_error(comm_mpi_rc_, #expr, (op), (rank));         \
  } while (false)

namespace comm::mpi {

/// The MPI error code behind a comm error thrown for a failing MPI call, else nullopt.
[[nodiscard]] inline std::optional<int> error_code_of(const std::exception& e) noexcept {
  if (const auto* m = dynamic_cast<const detail::mpi::EngineError*>(&e)) return m->code();
  return std::nullopt;
}

}  // namespace comm::mpi
