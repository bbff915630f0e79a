# Installs the build tree's moe_ep into BUILD_DIR/_install, then builds examples/consumer against
# the installed package with find_package(moe_ep) and runs it on 2 ranks.
set(prefix ${BUILD_DIR}/_install)
set(cbuild ${BUILD_DIR}/_consumer)
file(REMOVE_RECURSE ${prefix} ${cbuild})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/examples/consumer;-B;${cbuild};-DCMAKE_PREFIX_PATH=${prefix}"
    "${CMAKE_COMMAND};--build;${cbuild}"
    "${MPIEXEC};-n;2;--oversubscribe;${cbuild}/moe_ep_consumer")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_and_consume: step failed (${rc}): ${step}")
  endif()
endforeach()
