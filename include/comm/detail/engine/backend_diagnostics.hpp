#pragma once
// The diagnostics capabilities (concepts.hpp, optional capabilities 9 and 10) of a backend policy
// whose engine records its operations and runs monitored barriers itself: every such policy
// forwards them the same way, so they are written once here and inherited.
//
// The policy derives from BackendDiagnostics<Policy>, befriends it, and has `engine_` (a pointer
// to an engine with monitored_barrier(timeout, wait_all_ranks), timeout(), flight_record(),
// desync_check()) and `options_`.

#include <chrono>
#include <string>

#include <comm/detail/diagnostics/flight_recorder.hpp>
#include <comm/diagnostics.hpp>

namespace comm::detail {

template <class Policy>
class BackendDiagnostics {
 public:
  /// See Communicator::monitored_barrier; a zero timeout means this communicator's timeout. Ordered
  /// after the operations issued so far.
  void monitored_barrier(std::chrono::milliseconds timeout, bool wait_all_ranks) {
    auto& e = *self().engine_;
    e.monitored_barrier(timeout.count() > 0 ? timeout : e.timeout(), wait_all_ranks);
  }
  /// The flight recorder's contents (see <comm/diagnostics.hpp>).
  [[nodiscard]] FlightRecord flight_record() const { return self().engine_->flight_record(); }
  /// Writes the flight record to `path` ("-": stderr); comm::BackendError when it cannot.
  void dump_flight_record(const std::string& path) const {
    write_text_file(path, to_string(self().engine_->flight_record()), self().rank());
  }
  /// Whether the desync check runs before each operation.
  [[nodiscard]] bool desync_check() const noexcept { return self().engine_->desync_check(); }
  /// The options this communicator was made with (subgroups inherit them).
  [[nodiscard]] const auto& options() const noexcept { return self().options_; }

 private:
  [[nodiscard]] Policy& self() noexcept { return static_cast<Policy&>(*this); }
  [[nodiscard]] const Policy& self() const noexcept { return static_cast<const Policy&>(*this); }
};

}  // namespace comm::detail
