# comm_add_multirank_test(<name> SOURCES <src>... RANKS <n>... [LIBS <lib>...] [TIMEOUT <s>])
#
# Builds one doctest executable from SOURCES plus the multi-rank harness main and registers one
# CTest per rank count, named <name>.np<n>, each running `comm-run -n <n> <exe>` as real
# processes. A failure on any rank fails the test (comm-run exits with the first failing code).
function(comm_add_multirank_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "SOURCES;RANKS;LIBS")
  if(NOT arg_RANKS)
    set(arg_RANKS 1)
  endif()
  if(NOT arg_TIMEOUT)
    set(arg_TIMEOUT 300)
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE comm_test_main ${arg_LIBS})
  foreach(n IN LISTS arg_RANKS)
    add_test(NAME ${name}.np${n} COMMAND $<TARGET_FILE:comm-run> -n ${n} $<TARGET_FILE:${name}>)
    # COMM_TIMEOUT bounds every blocking call so a broken test fails instead of waiting 30 min.
    set_tests_properties(${name}.np${n} PROPERTIES TIMEOUT ${arg_TIMEOUT} PROCESSORS ${n}
      ENVIRONMENT "COMM_TIMEOUT=60s")
  endforeach()
endfunction()
