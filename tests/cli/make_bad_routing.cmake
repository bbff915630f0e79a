# Fixture of the bad-routing-file tests: a valid routing file from 2 ranks, then copies with a
# repeated id in token 0 (rank 0's), an id E + 3 in the last token (rank 1's), a NaN in
# expert_scales[3,0], an inf in x[5,17], the metadata seed 'xyz' and moe_expert_num 'abc'.
# -D: MPIEXEC, EXE, WORK, ARGS (space-separated), EXPERTS, PYTHON, STCHECK.
separate_arguments(args UNIX_COMMAND "${ARGS}")
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(COMMAND ${MPIEXEC} -n 2 --oversubscribe ${EXE} run ${args}
                        --save-routing ${WORK}/good.safetensors
                RESULT_VARIABLE rc TIMEOUT 120)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "saving the routing failed: '${rc}'")
endif()
foreach(mode repeat range nan inf seed experts)
  execute_process(COMMAND ${PYTHON} ${STCHECK} corrupt ${WORK}/good.safetensors
                          ${WORK}/${mode}.safetensors --mode ${mode} --experts ${EXPERTS}
                  RESULT_VARIABLE rc TIMEOUT 60)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "stcheck.py corrupt --mode ${mode} failed: '${rc}'")
  endif()
endforeach()
