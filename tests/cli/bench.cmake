# `moe-ep bench --compare` at small sizes, run with cmake -P: it must exit 0, print the
# verification ("verified"), a table row for each (op, impl) at each swept tokens value, the
# ratios, the targets and the peak RSS per rank, and write the CSV, the JSON and, when gnuplot is
# installed, a PNG whose series have distinct colours. No timing is asserted (a target may PASS or FAIL); CHECK
# (bench_check.py) asserts that what is printed and written is consistent: every check 0 bad,
# well-formed rows, p50 <= p99, GB/s and ratios computed from the p50s, each verdict agreeing
# with its value and bound.
# -D: MPIEXEC, EXE, WORK, PYTHON, CHECK.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(
  COMMAND ${MPIEXEC} -n 2 --oversubscribe ${EXE} bench --compare --quant int8 --tokens 16,32
          --hidden 256 --iters 3 --warmup 1 --csv ${WORK}/bench.csv --json ${WORK}/bench.json
          --plot ${WORK}/bench.png
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 150)
message(STATUS "exit '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "moe-ep bench exited with '${rc}'")
endif()
foreach(
  re
  "moe-ep bench: preset olmoe  H 256  E 64  K 8  dtype bf16  W 2  tokens/rank 16,32"
  "bytes counted per rank = rows it sends to OTHER ranks \\(self-traffic excluded\\)"
  "verify tokens/rank 16:\n[^\n]*expand_x == SPEC §1.4 layout \\(rows\\): [1-9][0-9]* checked, 0 bad"
  "combine_v2 of scale experts == SPEC §2.3 reference, bitwise \\(elements\\): 8192 checked, 0 bad"
  "textbook combine == combine_v2[^\n]*: 8192 checked, 0 bad"
  "alltoallv brought them back unchanged \\(rows\\): 256 checked, 0 bad"
  "quant_mode 2 int8 rows[^\n]*: [1-9][0-9]* checked, 0 bad\n  verified\n"
  "\n  dispatch      moe-ep +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+x +[0-9.]+x\n"
  "\n  combine       textbook +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +- +-\n"
  "int8 dispatch \\(quant_mode 2\\): bytes moved 0.508 of bf16's[^\n]*; memory traffic 0.562 of bf16's \\(each token read once"
  # The format only: CHECK checks each verdict against its value and bound.
  "tokens/rank    32  combine moe-ep/textbook +[0-9.]+ >= 2.0  (PASS|FAIL)\n"
  "tokens/rank    32  dispatch int8/bf16 time +[0-9.]+ <= 0.6  (PASS|FAIL)\n"
  "THIS RUN'S CONFIGURATION DIFFERS"
  "\npeak RSS per rank \\(VmHWM, whole run\\): min [1-9][0-9]*\\.[0-9] MB, max [1-9][0-9]*\\.[0-9] MB\n")
  if(NOT out MATCHES "${re}")
    message(FATAL_ERROR "stdout does not match '${re}'")
  endif()
endforeach()

file(STRINGS ${WORK}/bench.csv csv)
list(LENGTH csv n)
# Header + 2 tokens values x 9 (op, impl) rows (dispatch, combine, dispatch-int8 for moe-ep and
# alltoallv; dispatch, combine for textbook; memcpy).
if(NOT n EQUAL 19)
  message(FATAL_ERROR "bench.csv has ${n} lines, expected 19:\n${csv}")
endif()
list(GET csv 0 header)
if(NOT header STREQUAL
   "tokens_per_rank,op,impl,bytes_per_rank,p50_ms,p99_ms,gbps,ratio_vs_alltoallv,ratio_vs_textbook")
  message(FATAL_ERROR "bench.csv header: ${header}")
endif()

execute_process(
  COMMAND
    ${PYTHON} -c
    "import json, math, sys
j = json.load(open(sys.argv[1]))
assert j['verified'] is True
assert j['config']['hidden'] == 256 and j['config']['world'] == 2
r = j['results']
assert len(r) == 18, len(r)
assert {x['tokens_per_rank'] for x in r} == {16, 32}
for x in r:
    assert x['p50_ms'] > 0 and x['p99_ms'] >= x['p50_ms'], x
    assert x['bytes_per_rank'] > 0, x
moe = [x for x in r if x['impl'] == 'moe-ep' and x['op'] in ('dispatch', 'combine')]
assert len(moe) == 4 and all(x['ratio_vs_alltoallv'] > 0 and x['ratio_vs_textbook'] > 0 for x in moe)
d = {(x['tokens_per_rank'], x['op'], x['impl']): x['bytes_per_rank'] for x in r}
for t in (16, 32):
    # The baselines move exactly the bytes moe-ep moves.
    assert d[(t, 'dispatch', 'moe-ep')] == d[(t, 'dispatch', 'alltoallv')] == d[(t, 'dispatch', 'textbook')]
    assert abs(d[(t, 'dispatch-int8', 'moe-ep')] / d[(t, 'dispatch', 'moe-ep')] - 260 / 512) < 1e-9
assert len(j['targets']) == 10 and all(isinstance(t['pass'], bool) for t in j['targets'])
assert [x['tokens_per_rank'] for x in j['int8']] == [16, 32]
"
    ${WORK}/bench.json
  RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench.json check failed: ${err}")
endif()

# What is printed and written agrees with itself (see the top).
file(WRITE ${WORK}/stdout.txt "${out}")
find_program(GNUPLOT gnuplot)
set(gp "")
if(GNUPLOT)
  set(gp ${WORK}/bench.gp)
endif()
execute_process(COMMAND ${PYTHON} ${CHECK} ${WORK}/stdout.txt ${WORK}/bench.csv ${WORK}/bench.json
                        ${gp}
                RESULT_VARIABLE rc OUTPUT_VARIABLE check_out ERROR_VARIABLE err)
message(STATUS "${check_out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench outputs are not consistent: ${err}")
endif()

if(GNUPLOT)
  string(FIND "${out}" "plot written to ${WORK}/bench.png" at)  # a path is no regex
  if(at EQUAL -1)
    message(FATAL_ERROR "gnuplot is installed but no plot was reported")
  endif()
  file(READ ${WORK}/bench.png magic LIMIT 8 HEX)
  if(NOT magic STREQUAL "89504e470d0a1a0a")
    message(FATAL_ERROR "bench.png is not a PNG (starts with ${magic})")
  endif()
else()
  if(NOT out MATCHES "plot skipped: gnuplot is not installed")
    message(FATAL_ERROR "without gnuplot the bench must say the plot was skipped")
  endif()
endif()
