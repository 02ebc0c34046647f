# The backend list (include/comm/backends/list.hpp), read the way the C++ side expands it: one
# COMM_BACKEND(name, has, target, Policy...) line per backend.
#
# comm_read_backend_list(<names_var> <file>...)
#   sets <names_var> to the backends' names in list order, and comm_backend_target_<name> (the
#   CMake target that brings the backend in) in the caller's scope. A backend is available where
#   its target exists (if(TARGET ${comm_backend_target_<name>})).
function(comm_read_backend_list out)
  set(names)
  foreach(file IN LISTS ARGN)
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${file})
    file(STRINGS ${file} lines REGEX "^COMM_BACKEND\\(")
    foreach(line IN LISTS lines)
      if(NOT line MATCHES "^COMM_BACKEND\\( *([A-Za-z0-9_]+) *, *([A-Za-z0-9_]+) *, *([A-Za-z0-9_:]+) *,")
        message(FATAL_ERROR "comm: ${file}: cannot read the backend entry '${line}'")
      endif()
      list(APPEND names ${CMAKE_MATCH_1})
      set(comm_backend_target_${CMAKE_MATCH_1} ${CMAKE_MATCH_3} PARENT_SCOPE)
    endforeach()
  endforeach()
  set(${out} ${names} PARENT_SCOPE)
endfunction()

set(COMM_BACKEND_LIST_FILE ${CMAKE_CURRENT_LIST_DIR}/../include/comm/backends/list.hpp)
