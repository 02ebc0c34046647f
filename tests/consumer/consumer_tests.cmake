# Consumer tests: build and run tests/consumer against this checkout in three ways.
set(_src ${PROJECT_SOURCE_DIR})
set(_work ${CMAKE_CURRENT_BINARY_DIR}/consumer)
set(_prefix ${_work}/prefix)
set(_gen -G ${CMAKE_GENERATOR})
set(_cxx -DCMAKE_CXX_COMPILER=${CMAKE_CXX_COMPILER})

add_test(NAME consumer.install
  COMMAND ${CMAKE_COMMAND} --install ${PROJECT_BINARY_DIR} --prefix ${_prefix})
set_tests_properties(consumer.install PROPERTIES FIXTURES_SETUP comm_installed)

function(_comm_consumer name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "" "ARGS")
  set(dir ${_work}/${name})
  add_test(NAME consumer.${name}
    COMMAND ${CMAKE_COMMAND} -E env --unset=CMAKE_PREFIX_PATH
      ${CMAKE_COMMAND} -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/consumer -DBIN=${dir}
        "-DARGS=${_gen};${_cxx};${arg_ARGS}" -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/run_consumer.cmake)
  set_tests_properties(consumer.${name} PROPERTIES TIMEOUT 600)
endfunction()

_comm_consumer(find_package ARGS -DCOMM_CONSUME=package -DCMAKE_PREFIX_PATH=${_prefix})
set_tests_properties(consumer.find_package PROPERTIES FIXTURES_REQUIRED comm_installed)
_comm_consumer(build_tree ARGS -DCOMM_CONSUME=package -Dcomm_DIR=${PROJECT_BINARY_DIR})
_comm_consumer(add_subdirectory ARGS -DCOMM_CONSUME=subdirectory -DCOMM_SOURCE_DIR=${_src})
_comm_consumer(fetch_content ARGS -DCOMM_CONSUME=fetch -DCOMM_SOURCE_DIR=${_src})
# Without CLI11, a subproject still configures and builds; only comm-run is skipped.
_comm_consumer(add_subdirectory_no_cli11 ARGS -DCOMM_CONSUME=subdirectory -DCOMM_SOURCE_DIR=${_src}
  -DCMAKE_DISABLE_FIND_PACKAGE_CLI11=ON -DCOMM_EXPECT_RUN=OFF)

# comm::mpi from the install, in a C++-only project (tests/consumer/mpi).
if(COMM_HAS_MPI)
  add_test(NAME consumer.find_package_mpi
    COMMAND ${CMAKE_COMMAND} -E env --unset=CMAKE_PREFIX_PATH
      ${CMAKE_COMMAND} -DSRC=${CMAKE_CURRENT_SOURCE_DIR}/consumer/mpi -DBIN=${_work}/find_package_mpi
        "-DARGS=${_gen};${_cxx};-DCMAKE_PREFIX_PATH=${_prefix}" -P ${CMAKE_CURRENT_SOURCE_DIR}/consumer/run_consumer.cmake)
  set_tests_properties(consumer.find_package_mpi PROPERTIES TIMEOUT 600 FIXTURES_REQUIRED comm_installed LABELS mpi)
endif()
