#pragma once
/// \file
/// The backends of this build, from the one list in <comm/backends/list.hpp>: their policy
/// headers (the compiled-in ones: COMM_HAS_GLOO, COMM_HAS_NCCL, COMM_HAS_MPI, set by the
/// comm::gloo, comm::nccl and comm::mpi targets; Shm always), a table of every known backend
/// (name, compiled in or not, the CMake target that brings it in), and a compile-time walk over
/// the compiled-in policies. cdb's selection by name and its error texts come from here.

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

// 1 when `x` expands to 1 (a backend's has-macro, defined by its CMake target), else 0.
#define COMM_PP_CAT(a, b) COMM_PP_CAT_I(a, b)
#define COMM_PP_CAT_I(a, b) a##b
#define COMM_PP_SECOND(...) COMM_PP_SECOND_I(__VA_ARGS__)
#define COMM_PP_SECOND_I(a, b, ...) b
#define COMM_PP_ONE_PROBE_1 ~, 1
#define COMM_PP_IS_ONE(x) COMM_PP_SECOND(COMM_PP_CAT(COMM_PP_ONE_PROBE_, x), 0, ~)
// COMM_PP_WHEN(c)(tokens...): the tokens (commas included) when c is 1, nothing when 0.
#define COMM_PP_WHEN(c) COMM_PP_CAT(COMM_PP_WHEN_, c)
#define COMM_PP_WHEN_1(...) __VA_ARGS__
#define COMM_PP_WHEN_0(...)

// First pass, at namespace scope: the compiled-in backends' headers (the later passes expand the
// entries only; the headers' #pragma once keeps them out).
#define COMM_BACKEND(...)
#include <comm/backends/list.hpp>
#undef COMM_BACKEND

namespace comm::backends {

/// One entry of the backend list.
struct KnownBackend {
  std::string_view name;    ///< cdb's name for it ("gloo")
  bool compiled_in;         ///< its CMake target was linked into this translation unit
  std::string_view target;  ///< that target ("comm::gloo")
};

/// Every backend comm knows, compiled in or not, in list order.
inline constexpr auto known_backends = std::to_array<KnownBackend>({
#define COMM_BACKEND(name, has, target, ...) KnownBackend{#name, COMM_PP_IS_ONE(has) == 1, #target},
#include <comm/backends/list.hpp>
#undef COMM_BACKEND
});

/// The entry named `name`, or null.
[[nodiscard]] constexpr const KnownBackend* find_backend(std::string_view name) noexcept {
  for (const auto& b : known_backends)
    if (b.name == name) return &b;
  return nullptr;
}

/// Calls `f(std::type_identity<Policy>{}, name)` for every compiled-in backend, in list order.
template <class F>
constexpr void for_each_backend(F&& f) {
#define COMM_BACKEND(name, has, target, ...) \
  COMM_PP_WHEN(COMM_PP_IS_ONE(has))(f(std::type_identity<__VA_ARGS__>{}, std::string_view(#name));)
#include <comm/backends/list.hpp>
#undef COMM_BACKEND
}

/// "a, b, c or d": the known names after `first` (cdb's "unknown backend" text).
[[nodiscard]] inline std::string backend_names(std::string_view first) {
  std::string s(first);
  for (std::size_t i = 0; i < known_backends.size(); ++i)
    s += std::string(i + 1 == known_backends.size() ? " or " : ", ") + std::string(known_backends[i].name);
  return s;
}

}  // namespace comm::backends
