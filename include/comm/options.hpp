#pragma once
/// \file
/// `comm::CommonOptions`: the options every host backend takes (Gloo, Shm, Mpi, Hierarchical).
/// Each backend's `Options` derives from it and adds its own fields, so `o.timeout` reads the same
/// on every backend and code that sets these fields can be written once for all of them.

#include <chrono>
#include <cstddef>
#include <string>

#include <comm/detail/diagnostics/desync.hpp>
#include <comm/detail/base/env.hpp>
#include <comm/detail/diagnostics/flight_recorder.hpp>

namespace comm {

/// The options common to the host backends; a backend's own options derive from it.
struct CommonOptions {
  /// Deadline of every operation and of rendezvous (default: COMM_TIMEOUT, else 30 minutes).
  std::chrono::milliseconds timeout = detail::default_timeout();
  /// Before each operation, compare (sequence number, operation, element type, count, root,
  /// reduction) across ranks and throw comm::DesyncError on every rank when they differ (one small
  /// exchange per operation; the backend's header says which). Must be the same on every rank.
  /// Default: on with COMM_DEBUG=DETAIL.
  bool desync_check = detail::desync_check_default();
  /// How many operations the flight recorder keeps (0: none). Default: COMM_FLIGHT_RECORDER_SIZE,
  /// else 256.
  std::size_t flight_recorder_size = detail::flight_recorder_size_default();
  /// For a communicator that is a member of another (Hierarchical's): the rank in its flight-record
  /// dump file names (-1: its own) and its name in records and file names. Users leave them.
  int record_file_rank = -1;
  /// The member's name in records and file names (Hierarchical sets it; users leave it empty).
  std::string record_name;
};

}  // namespace comm
