# `moe-ep bench --compare` on two nodes (emulated by $MOE_EP_SHM_NODE_RANKS, or machines of
# their own): both comm_algs are verified (hierarchy's expand_x == fullmesh's, its combine
# within SPEC §3's bound) and timed on the same batch, each op's inter-node and intra-node bytes
# printed, and the hierarchy/fullmesh targets are the ratios of what the JSON says (CHECK,
# bench_check.py). No timing is asserted.
# -D: LAUNCH (the command line up to the executable, a list), EXE, WORK, PYTHON, CHECK, ALG
# (--comm-alg: the other is the one timed without ratios to the baselines).
if(ALG STREQUAL "hierarchy")
  set(other fullmesh)
else()
  set(ALG fullmesh)
  set(other hierarchy)
endif()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(
  COMMAND ${LAUNCH} ${EXE} bench --compare --comm-alg ${ALG} --tokens 16,32 --hidden 256 --iters 3
          --warmup 1
          --csv ${WORK}/bench.csv --json ${WORK}/bench.json --plot ${WORK}/bench.png
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 250)
message(STATUS "exit '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe-ep bench exited with '${rc}'")
endif()
foreach(
  re
  "comm_alg hierarchy: expand_x == fullmesh's \\(rows\\), combine within SPEC §3's bound \\(elements\\): [1-9][0-9]* checked, 0 bad\n  verified"
  "comm_alg ${ALG}  --compare"
  "\n  dispatch      moe-ep/${ALG} +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+x +[0-9.]+x\n"
  "\n  dispatch      moe-ep/${other} +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +- +-\n"
  "\n  combine       moe-ep/fullmesh +bytes per rank, MB: inter-node [0-9.]+, intra-node [0-9.]+\n"
  "hierarchy / fullmesh \\(same run, same batch\\): inter-node bytes dispatch 0\\.[0-9]+, combine 0\\.[0-9]+"
  "tokens/rank    32  combine hierarchy/fullmesh inter-node bytes +[0-9.]+ <= 0.6  (PASS|FAIL)\n")
  if(NOT out MATCHES "${re}")
    message(FATAL_ERROR "stdout does not match '${re}'")
  endif()
endforeach()
file(WRITE ${WORK}/stdout.txt "${out}")
set(gp ${WORK}/bench.gp)
if(NOT EXISTS ${gp})
  set(gp "")
endif()
execute_process(COMMAND ${PYTHON} ${CHECK} ${WORK}/stdout.txt ${WORK}/bench.csv ${WORK}/bench.json ${gp}
                RESULT_VARIABLE rc OUTPUT_VARIABLE cout ERROR_VARIABLE cerr)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench_check.py: ${cout}${cerr}")
endif()
message(STATUS "${cout}")
