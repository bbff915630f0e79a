# Save/load round trip of `moe-ep run`, run with cmake -P:
#   1. SAVE_NP ranks generate the batch: --save-routing routing.safetensors --save-output out.
#   2. For each LOAD_NPS entry: --load-routing the file at that world size, --save-output; the
#      output must be byte-for-byte identical (SPEC §2.3 makes it independent of W).
#   3. With EXPERTS set (--expert-fn scale): stcheck.py recomputes SPEC §2.3 independently from
#      the routing file and checks every output bit for bit.
# -D: MPIEXEC, EXE, WORK, ARGS (space-separated), SAVE_ARGS (optional: flags of the saving run
#     only, e.g. another --shared-expert-ranks), SAVE_NP, LOAD_NPS (space-separated),
#     PYTHON and STCHECK (with EXPERTS).
separate_arguments(args UNIX_COMMAND "${ARGS}")
separate_arguments(load_nps UNIX_COMMAND "${LOAD_NPS}")
separate_arguments(save_args UNIX_COMMAND "${SAVE_ARGS}")
# The loading runs drop what the file fixes (--load-routing rejects these flags).
set(load_args "")
set(skip_value FALSE)
foreach(a IN LISTS args)
  if(skip_value)
    set(skip_value FALSE)
  elseif(a MATCHES "^--(tokens|routing|routing-model|domain|layer|routing-file|mask)$")
    set(skip_value TRUE)
  else()
    list(APPEND load_args "${a}")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(routing "${WORK}/routing.safetensors")

function(run_tool np args)
  execute_process(COMMAND ${MPIEXEC} -n ${np} --oversubscribe ${EXE} run ${args} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
  message(STATUS "np ${np}:\n${out}${err}")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "moe-ep run at ${np} ranks exited with '${rc}'")
  endif()
endfunction()

function(check_scale output)
  if(EXPERTS)
    execute_process(COMMAND ${PYTHON} ${STCHECK} check-scale ${routing} ${output}
                            --experts ${EXPERTS}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
    message(STATUS "${out}${err}")
    if(NOT rc STREQUAL "0")
      message(FATAL_ERROR "independent SPEC 2.3 check of ${output} failed")
    endif()
  endif()
endfunction()

set(saved "${WORK}/out_np${SAVE_NP}.safetensors")
run_tool(${SAVE_NP} "${args}" ${save_args} --save-routing ${routing} --save-output ${saved})
check_scale(${saved})
foreach(np IN LISTS load_nps)
  set(loaded "${WORK}/out_load_np${np}.safetensors")
  run_tool(${np} "${load_args}" --load-routing ${routing} --save-output ${loaded})
  execute_process(COMMAND ${CMAKE_COMMAND} -E compare_files ${saved} ${loaded} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "output at ${np} ranks from the loaded routing differs from the output at "
                        "${SAVE_NP} ranks")
  endif()
  check_scale(${loaded})
endforeach()
