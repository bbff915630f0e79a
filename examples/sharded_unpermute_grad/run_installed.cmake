# ctest driver (tests/CMakeLists.txt: sharded_unpermute_grad_example): installs the build tree's
# moe_ep into BUILD_DIR/_install_sharded, builds this example against the installed package with
# find_package(moe_ep) and runs it on 3 ranks. The program prints PASS or FAIL and exits non-zero
# on FAIL.
set(prefix ${BUILD_DIR}/_install_sharded)
set(ebuild ${BUILD_DIR}/_sharded_unpermute_grad)
file(REMOVE_RECURSE ${prefix} ${ebuild})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/examples/sharded_unpermute_grad;-B;${ebuild};-DCMAKE_PREFIX_PATH=${prefix};-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${ebuild}"
    "${MPIEXEC};-n;3;--oversubscribe;${ebuild}/sharded_unpermute_grad")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "sharded_unpermute_grad_example: step failed (${rc}): ${step}")
  endif()
endforeach()
