// The test-only entries of the backend list (include/comm/backends/list.hpp expands this file where
// COMM_TEST_EXTRA_BACKENDS names it; the target comm_test_relay defines both macros). Same form.
#if defined(COMM_TEST_HAS_RELAY)
#include <relay_backend/relay.hpp>
#endif
COMM_BACKEND(relay, COMM_TEST_HAS_RELAY, comm_test_relay, ::comm::test::Relay)
