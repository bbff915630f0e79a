# Installs the build tree's moe_ep into BUILD_DIR/_install_<EXAMPLE>, builds examples/<EXAMPLE>
# against the installed package with find_package(moe_ep), and runs its program <EXE> on <NP>
# ranks; the program exits non-zero on FAIL.
#   cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DMPIEXEC=... -DEXAMPLE=consumer -DEXE=moe_ep_consumer
#         -DNP=2 -P install_and_consume.cmake
set(prefix ${BUILD_DIR}/_install_${EXAMPLE})
set(ebuild ${BUILD_DIR}/_example_${EXAMPLE})
file(REMOVE_RECURSE ${prefix} ${ebuild})
foreach(step
    "${CMAKE_COMMAND};--install;${BUILD_DIR};--prefix;${prefix}"
    "${CMAKE_COMMAND};-S;${SOURCE_DIR}/examples/${EXAMPLE};-B;${ebuild};-DCMAKE_PREFIX_PATH=${prefix};-DCMAKE_BUILD_TYPE=Release"
    "${CMAKE_COMMAND};--build;${ebuild}"
    "${MPIEXEC};-n;${NP};--oversubscribe;${ebuild}/${EXE}")
  execute_process(COMMAND ${step} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install_and_consume (${EXAMPLE}): step failed (${rc}): ${step}")
  endif()
endforeach()
