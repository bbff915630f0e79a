# The tool works from an install prefix, outside the build and source trees: it finds the routing
# data relative to its own location (<prefix>/bin/../share/moe-ep/real-routing).
# -D: BUILD_DIR, PREFIX, MPIEXEC.
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX}
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "cmake --install failed: '${rc}'")
endif()
execute_process(COMMAND ${MPIEXEC} -n 2 --oversubscribe ${PREFIX}/bin/moe-ep run
                        --preset mixtral-8x7b --tokens 4 --ffn 16
                WORKING_DIRECTORY ${PREFIX} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err TIMEOUT 120)
message(STATUS "${out}${err}")
string(FIND "${out}" "${PREFIX}/share/moe-ep/real-routing/expert_counts.csv" pos)
if(NOT rc STREQUAL "0" OR pos EQUAL -1)
  message(FATAL_ERROR "the installed moe-ep did not run from its prefix: '${rc}'")
endif()
