#pragma once
// Where a size_t count or offset of comm's API becomes an engine's narrower integer (MPI's and
// gloo's `int` counts and displacements): gsl::narrow checks that the value survives the
// conversion, and a value that does not is the user's mistake, reported as comm::InvalidArgument
// naming the operation, the rank and the value, before anything is sent.

#include <limits>
#include <string>
#include <string_view>

#include <gsl/narrow>

#include <comm/error.hpp>

namespace comm::detail {

/// `value` as a `To` (default `int`); `what` names it in the error ("count", "displacement").
template <class To = int, class From>
[[nodiscard]] To narrow_count(std::string_view op, int rank, From value, std::string_view what = "count") {
  try {
    return gsl::narrow<To>(value);
  } catch (const gsl::narrowing_error&) {
    throw InvalidArgument(std::string(op), rank,
                          std::string(what) + " " + std::to_string(value) + " is out of the engine's range [" +
                              std::to_string(std::numeric_limits<To>::min()) + ", " +
                              std::to_string(std::numeric_limits<To>::max()) + "]");
  }
}

}  // namespace comm::detail
