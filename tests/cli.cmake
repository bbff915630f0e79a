# Tests of the moe-ep command-line tool (included by tests/CMakeLists.txt when the tools are
# built). Scripts under cli/ use only CMake and the Python standard library.
find_package(Python3 REQUIRED COMPONENTS Interpreter)

set(_cli ${CMAKE_CURRENT_SOURCE_DIR}/cli)
set(_work ${CMAKE_CURRENT_BINARY_DIR}/cli)
set(_exe $<TARGET_FILE:moe-ep>)
set(_mpi ${MPIEXEC_EXECUTABLE})

# The tool's pure parts (safetensors, batch files, routing, presets).
add_executable(moe_ep_cli_tests ${_cli}/test_tool.cc)
target_link_libraries(moe_ep_cli_tests PRIVATE moe_ep_tool moe_ep_flags GTest::gtest
                                               GTest::gtest_main)
target_compile_definitions(moe_ep_cli_tests PRIVATE
                           MOE_EP_TEST_ROUTING_CSV="${MOE_EP_ROUTING_CSV}"
                           MOE_EP_TEST_VERSION="${PROJECT_VERSION}")
gtest_discover_tests(moe_ep_cli_tests TEST_PREFIX cli. DISCOVERY_MODE PRE_TEST
                     PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 120 LABELS paths)

# The main job on real routing, every preset, dtype, routing and expert function; each run
# checks itself against the dense reference and exits non-zero on FAIL.
moe_ep_add_mpi_test(NAME cli.run.default COMMAND ${_exe} run NPROCS 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.mixtral_real
                    COMMAND ${_exe} run --preset mixtral-8x7b --tokens 16 --ffn 64
                    NPROCS 1 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.olmoe_real COMMAND ${_exe} run --preset olmoe --tokens 8 --ffn 32
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.olmoe_sft_tulu_layer15
                    COMMAND ${_exe} run --routing-model olmoe-sft --domain tulu --layer 15
                            --tokens 8 --ffn 32
                    NPROCS 2 TIMEOUT 120)
# No --domain: olmoe-dpo's only domain, tulu (c4 would fail: not in the data for this model).
moe_ep_add_mpi_test(NAME cli.run.olmoe_dpo_default_domain
                    COMMAND ${_exe} run --routing-model olmoe-dpo --tokens 8 --ffn 32
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.qwen3_real_split
                    COMMAND ${_exe} run --preset qwen3-30b-a3b --tokens 8 --ffn 16
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.deepseek_gate
                    COMMAND ${_exe} run --preset deepseek-v3 --routing gate --tokens 2 --ffn 8
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.mixtral_gate_fp32
                    COMMAND ${_exe} run --preset mixtral-8x7b --routing gate --dtype fp32
                            --tokens 8 --ffn 32
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.olmoe_uniform_fp16
                    COMMAND ${_exe} run --routing uniform --dtype fp16 --tokens 8 --ffn 32
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.olmoe_scale_exact
                    COMMAND ${_exe} run --expert-fn scale --tokens 16 NPROCS 1 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.identity_exact
                    COMMAND ${_exe} run --preset mixtral-8x7b --expert-fn identity --tokens 16
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.zero_tokens
                    COMMAND ${_exe} run --preset mixtral-8x7b --tokens 0 --ffn 16
                    NPROCS 2 TIMEOUT 120)

# Save/load round trips: the output at another W is byte-for-byte the saved one; with
# --expert-fn scale every output is also recomputed independently by stcheck.py (SPEC §2.3).
# An optional sixth argument holds flags of the saving run only.
function(cli_roundtrip name save_np load_nps experts args)
  add_test(NAME cli.roundtrip.${name}
           COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${_mpi} -DEXE=${_exe} -DWORK=${_work}/${name}
                   "-DARGS=${args}" "-DSAVE_ARGS=${ARGV5}" -DSAVE_NP=${save_np}
                   "-DLOAD_NPS=${load_nps}"
                   -DEXPERTS=${experts} -DPYTHON=${Python3_EXECUTABLE}
                   -DSTCHECK=${_cli}/stcheck.py -P ${_cli}/roundtrip.cmake)
  set_tests_properties(cli.roundtrip.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}"
                                                        TIMEOUT 300 PROCESSORS 4)
endfunction()
cli_roundtrip(mixtral_swiglu 2 "1 4" "" "--preset mixtral-8x7b --tokens 7 --ffn 32")
# 2 x 5 tokens reloaded at 4 ranks: an uneven 3,3,2,2 split (global_bs = W x max BS).
cli_roundtrip(olmoe_scale_uneven 2 "4 1" 64 "--expert-fn scale --hidden 64 --tokens 5")
cli_roundtrip(mixtral_scale_fp16 2 "1" 8 "--preset mixtral-8x7b --expert-fn scale --dtype fp16 --tokens 6")
cli_roundtrip(olmoe_scale_fp32_gate 4 "2" 64
              "--expert-fn scale --dtype fp32 --routing gate --hidden 128 --tokens 3")
# --exact-size (EpConfig::exact_size) when saving: the default mode at 4 and 1 ranks reproduces
# its output byte for byte.
cli_roundtrip(olmoe_scale_exact_size 2 "4 1" 64 "--expert-fn scale --hidden 64 --tokens 5"
              "--exact-size")

# Bad expert_ids reach dispatch_v2 unvalidated by the tool; it must fail fast on every rank with
# its message naming expert_ids, the value and the bound.
add_test(NAME cli.bad_ids.setup
         COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${_mpi} -DEXE=${_exe} -DWORK=${_work}/bad_ids
                 "-DARGS=--preset mixtral-8x7b --tokens 4 --expert-fn scale" -DEXPERTS=8
                 -DPYTHON=${Python3_EXECUTABLE} -DSTCHECK=${_cli}/stcheck.py
                 -P ${_cli}/make_bad_routing.cmake)
set_tests_properties(cli.bad_ids.setup PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 120
                                                  FIXTURES_SETUP cli_bad_ids)
# A command line given as one string (CMD of cli/expect_error.cmake and cli/expect_output.cmake)
# is split there as a shell would split it (separate_arguments(UNIX_COMMAND)), so cli_command
# double-quotes every path in it of the tool, mpiexec, the build tree and the checkout: a checkout
# path with spaces stays one argument (.ci/run runs the tests from such a path). Each path is
# quoted once, the longest first, through a temporary token that no path holds (the build tree
# may lie in the checkout).
function(cli_command out cmd)
  set(paths "${_exe}" "${_mpi}" "${PROJECT_BINARY_DIR}" "${PROJECT_SOURCE_DIR}")
  string(LENGTH "${PROJECT_BINARY_DIR}" b)
  string(LENGTH "${PROJECT_SOURCE_DIR}" s)
  if(s GREATER b)
    set(paths "${_exe}" "${_mpi}" "${PROJECT_SOURCE_DIR}" "${PROJECT_BINARY_DIR}")
  endif()
  string(ASCII 1 mark)
  set(i 0)
  foreach(path IN LISTS paths)
    string(REPLACE "${path}" "${mark}${i}${mark}" cmd "${cmd}")
    math(EXPR i "${i} + 1")
  endforeach()
  set(i 0)
  foreach(path IN LISTS paths)
    string(REPLACE "${mark}${i}${mark}" "\"${path}\"" cmd "${cmd}")
    math(EXPR i "${i} + 1")
  endforeach()
  set(${out} "${cmd}" PARENT_SCOPE)
endfunction()
function(cli_expect_error name regex cmd)
  cli_command(cmd "${cmd}")
  add_test(NAME cli.error.${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" "-DREGEX=${regex}" -DTIMEOUT=45
                   -P ${_cli}/expect_error.cmake)
  set_tests_properties(cli.error.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60
                                                    ${ARGN})
endfunction()
# The same, and stderr holds one "moe-ep: error:" line: ranks whose error is Remote stay quiet.
function(cli_expect_error_once name regex cmd)
  cli_command(cmd "${cmd}")
  add_test(NAME cli.error.${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" "-DREGEX=${regex}" -DTIMEOUT=45 -DONCE=1
                   -P ${_cli}/expect_error.cmake)
  set_tests_properties(cli.error.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60
                                                    ${ARGN})
endfunction()
# A run that must succeed (exit 0) with stdout matching the whole regex, ';' included (a
# PASS_REGULAR_EXPRESSION property would be split at each ';' and pass on any piece); optional
# NOT_REGEX <regex> (not in stdout or stderr) and test properties after it.
function(cli_expect_output name regex cmd)
  cmake_parse_arguments(O "" "NOT_REGEX" "" ${ARGN})
  cli_command(cmd "${cmd}")
  add_test(NAME cli.${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" "-DREGEX=${regex}" "-DNOT_REGEX=${O_NOT_REGEX}"
                   -DTIMEOUT=200 -P ${_cli}/expect_output.cmake)
  set_tests_properties(cli.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 240
                                              ${O_UNPARSED_ARGUMENTS})
endfunction()
set(_run2 "${_mpi} -n 2 --oversubscribe ${_exe} run --preset mixtral-8x7b --expert-fn scale")
cli_expect_error(repeated_id "moe-ep: error: [A-Za-z]+: dispatch_v2: expert_ids\\[0,[^\n]*repeat"
                 "${_run2} --load-routing ${_work}/bad_ids/repeat.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(id_out_of_range "moe-ep: error: [A-Za-z]+: dispatch_v2: expert_ids\\[3,1\\][^\n]*11[^\n]*8"
                 "${_run2} --load-routing ${_work}/bad_ids/range.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
# An error every rank raises (here: one rank's bad expert id, the others learn it through the
# header agreement) ends the job with status 2 through MPI_Finalize, not MPI_Abort's banner.
cli_command(_cmd "${_run2} --load-routing ${_work}/bad_ids/repeat.safetensors")
add_test(NAME cli.error.agreed_error_finalizes
         COMMAND ${CMAKE_COMMAND} "-DCMD=${_cmd}"
                 "-DREGEX=moe-ep: error: [A-Za-z]+: dispatch_v2: expert_ids" -DEXIT=2
                 -DNOT_REGEX=MPI_ABORT -DONCE=1 -DTIMEOUT=45 -P ${_cli}/expect_error.cmake)
set_tests_properties(cli.error.agreed_error_finalizes PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}"
                     TIMEOUT 60 FIXTURES_REQUIRED cli_bad_ids)
# A routing file of another shape is rejected before any communication.
cli_expect_error(load_wrong_preset "InvalidArgument: --load-routing.*H = 4096.*H = 2048"
                 "${_mpi} -n 2 --oversubscribe ${_exe} run --preset olmoe --load-routing ${_work}/bad_ids/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(load_wrong_dtype "InvalidArgument: --load-routing.*bf16.*fp16"
                 "${_mpi} -n 1 ${_exe} run --preset mixtral-8x7b --dtype fp16 --load-routing ${_work}/bad_ids/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)

# Command-line mistakes (parse errors included) print one "moe-ep: error: InvalidArgument: ..."
# line for all ranks, and exit with status 2 through MPI_Finalize (no MPI_ABORT banner, no
# CLI11 "Run with --help"); an unknown option names the closest known one.
function(cli_expect_usage_error name regex args)
  cli_command(cmd "${_mpi} -n 2 --oversubscribe ${_exe} ${args}")
  add_test(NAME cli.usage.${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}"
                   "-DREGEX=(^|\n)moe-ep: error: InvalidArgument: ${regex}" -DEXIT=2 -DONCE=1
                   "-DNOT_REGEX=MPI_ABORT|Run with --help" -DTIMEOUT=45
                   -P ${_cli}/expect_error.cmake)
  set_tests_properties(cli.usage.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60
                                                    PROCESSORS 2)
endfunction()
cli_expect_usage_error(unknown_option_did_you_mean
                       "moe-ep run: unknown option --token; did you mean --tokens\\? \\(moe-ep run --help lists them\\)\n"
                       "run --token 16")
cli_expect_usage_error(unknown_option_with_value
                       "moe-ep run: unknown option --hiden; did you mean --hidden\\?"
                       "run --tokens=8 --hiden=64")
cli_expect_usage_error(bench_unknown_option_did_you_mean
                       "moe-ep bench: unknown option --iter; did you mean --iters\\?"
                       "bench --iter 3")
cli_expect_usage_error(option_of_the_other_subcommand
                       "moe-ep run: unknown option --compare: it is an option of moe-ep bench"
                       "run --compare")
cli_expect_usage_error(unknown_option_no_suggestion
                       "moe-ep run: unknown option --frobnicate \\(moe-ep run --help lists them\\)"
                       "run --frobnicate")
cli_expect_usage_error(missing_value
                       "--tokens: a value is missing \\(expected INT:\\[0, 2147483647\\]\\)"
                       "run --tokens")
cli_expect_usage_error(bad_value "--dtype: int8 not in \\{bf16,fp16,fp32\\}" "run --dtype int8")
cli_expect_usage_error(bad_number
                       "--tokens: must be an integer in \\[0, 2147483647\\], got abc \\(not an integer\\)"
                       "run --tokens abc")
cli_expect_usage_error(unexpected_positional
                       "moe-ep run: unexpected argument '16': moe-ep run takes only options"
                       "run 16")
cli_expect_usage_error(option_before_subcommand
                       "moe-ep: unexpected argument '--tokens' before the subcommand"
                       "--tokens 8 run")
cli_expect_usage_error(subcommand_did_you_mean
                       "unknown subcommand 'rnu' \\(expected run, bench or plan\\); did you mean run\\?"
                       "rnu")
cli_expect_usage_error(no_subcommand_exit_2 "a subcommand is required: moe-ep run, moe-ep bench or moe-ep plan" "")
cli_expect_usage_error(combination "--comm-quant int8 cannot be combined with --tp 2"
                       "run --tp 2 --comm-quant int8")
cli_expect_usage_error(hierarchy_tp "--comm-alg hierarchy cannot be combined with --tp 2"
                       "run --tp 2 --comm-alg hierarchy")
cli_expect_usage_error(exact_size_tp "--exact-size cannot be combined with --tp 2"
                       "run --tp 2 --exact-size")
# --exact-size with shared-expert ranks, a 2-D mask and int8 rows: checked against the dense
# reference like the default, and named in the header.
cli_expect_output(run.exact_size
                  "moe-ep run: .*quant int8.*exact-size.*\nPASS: "
                  "${_mpi} -n 3 --oversubscribe ${_exe} run --exact-size --expert-fn scale --tokens 12 --hidden 64 --shared-experts 1 --shared-expert-ranks 1 --mask entries --quant int8"
                  PROCESSORS 3)
# --version and --help print once (rank 0) and exit 0.
cli_expect_output(version "^moe-ep ${PROJECT_VERSION}\n$"
                  "${_mpi} -n 2 --oversubscribe ${_exe} --version" PROCESSORS 2)
cli_expect_output(help "Usage: [^\n]*moe-ep run \\[OPTIONS\\].*--warm-repeats.*--progress"
                  "${_mpi} -n 2 --oversubscribe ${_exe} run --help" NOT_REGEX "error" PROCESSORS 2)
cli_command(_cmd "${_mpi} -n 2 --oversubscribe ${_exe} --help")
add_test(NAME cli.help_once
         COMMAND ${CMAKE_COMMAND} "-DCMD=${_cmd}"
                 "-DREGEX=Usage: " -DONCE=1 -P ${_cli}/expect_output.cmake)
set_tests_properties(cli.help_once PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60)

# The report of `moe-ep run` (tests/cli/run_report.py; no timing is asserted): lines of at most
# 100 columns, cold and warm times labelled, the last line a PASS: summary that agrees with the
# header, the times above and the kind of check; progress lines on stderr with --progress on,
# none with off.
function(cli_report name np expect args)
  separate_arguments(a UNIX_COMMAND "${args}")
  add_test(NAME cli.report.${name}
           COMMAND ${Python3_EXECUTABLE} ${_cli}/run_report.py ${_mpi} ${np} ${expect} -- ${_exe}
                   run ${a})
  set_tests_properties(cli.report.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}"
                                                     TIMEOUT 240 PROCESSORS ${np})
endfunction()
cli_report(warm_progress_on 2 exact
           "--preset mixtral-8x7b --tokens 8 --hidden 64 --expert-fn scale --warm-repeats 3 --progress on")
cli_report(cold_only_progress_off 2 exact
           "--preset mixtral-8x7b --tokens 8 --hidden 64 --expert-fn scale --warm-repeats 0 --progress off")
cli_report(swiglu_tolerance 1 tolerance "--preset mixtral-8x7b --tokens 4 --hidden 64 --ffn 16")
# The longest header and placement: shared-expert rank, redundant slots, special experts, mask.
cli_report(everything_scale 4 exact
           "--preset deepseek-v3 --hidden 128 --tokens 6 --expert-fn scale --zero-experts 1 --copy-experts 1 --const-experts 2 --mask entries --shared-expert-ranks 1")
cli_report(tp_int8_bound 4 bound
           "--tp 2 --experts 2 --top-k 2 --quant int8 --comm-quant none --hidden 64 --tokens 4 --expert-fn scale --mask entries --routing uniform")

# Bad flags: CLI11 errors, non-zero exit.
cli_expect_error(negative_tokens "--tokens" "${_mpi} -n 2 ${_exe} run --tokens -3")
cli_expect_error(unknown_preset "--preset" "${_mpi} -n 1 ${_exe} run --preset gpt-5")
# CLI11's own words replaced where they do not say what is wrong.
cli_expect_error(unknown_subcommand "unknown subcommand 'frob' \\(expected run, bench or plan\\)"
                 "${_mpi} -n 1 ${_exe} frob")
cli_expect_error(repeated_option "--tokens: given 2 times; it takes one value"
                 "${_mpi} -n 1 ${_exe} run --tokens 4 --tokens 8")
# bench's --tokens list: an empty entry is an error, not dropped; each entry is range-checked.
cli_expect_error(bench_tokens_empty_entry "--tokens: must be a comma-separated list of integers in \\[1, [0-9]+\\], got 8,,16 \\(an empty entry\\)"
                 "${_mpi} -n 1 ${_exe} bench --tokens 8,,16 --hidden 64 --iters 2")
cli_expect_error(bench_tokens_trailing_comma "got 8,16, \\(an empty entry\\)"
                 "${_mpi} -n 1 ${_exe} bench --tokens 8,16, --hidden 64 --iters 2")
cli_expect_error(bench_tokens_bad_entry "--tokens: each entry of 8,0 must be an integer in \\[1, [0-9]+\\], got 0"
                 "${_mpi} -n 1 ${_exe} bench --tokens 8,0 --hidden 64 --iters 2")
cli_expect_error(top_k_above_experts "K = 9 exceeds the number of experts E = 8"
                 "${_mpi} -n 1 ${_exe} run --preset mixtral-8x7b --top-k 9")
cli_expect_error(bad_dtype "--dtype" "${_mpi} -n 1 ${_exe} run --dtype int8")
cli_expect_error(no_subcommand "subcommand" "${_mpi} -n 1 ${_exe}")
cli_expect_error(experts_not_divisible
                 "--redundant-experts 0: E \\+ R = 8 \\+ 0 = 8 expert slots cannot be split evenly over W = 3 ranks"
                 "${_mpi} -n 3 --oversubscribe ${_exe} run --preset mixtral-8x7b --tokens 2 --ffn 8 --redundant-experts 0")
cli_expect_error(missing_routing_file "InvalidArgument: real routing: cannot open '/nonexistent/x.csv'"
                 "${_mpi} -n 2 ${_exe} run --routing-file /nonexistent/x.csv")
# Routing files with bad values are rejected with the line and the value (they ran before:
# negative, fractional and out-of-range counts, and a repeated expert).
set(_hdr "model,domain,selection,layer,expert,count\n")
file(WRITE ${_work}/routing/negative.csv "${_hdr}olmoe,c4,topk,7,0,-100\r\n")
file(WRITE ${_work}/routing/fraction.csv "${_hdr}olmoe,c4,topk,7,0,10\nolmoe,c4,topk,7,1,3.5\n")
file(WRITE ${_work}/routing/huge.csv "${_hdr}olmoe,c4,topk,7,0,99999999999999999999999\n")
file(WRITE ${_work}/routing/repeat.csv "${_hdr}olmoe,c4,topk,7,0,10\nolmoe,c4,topk,7,0,12\n")
file(WRITE ${_work}/routing/empty.csv "${_hdr}")
cli_expect_error(routing_negative_count "negative.csv:2: count = '-100' is not an integer in \\[0, 2\\^63 - 1\\]"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${_work}/routing/negative.csv")
cli_expect_error(routing_fractional_count "fraction.csv:3: count = '3.5' is not an integer"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${_work}/routing/fraction.csv")
cli_expect_error(routing_huge_count "huge.csv:2: count = '99999999999999999999999' is not an integer"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${_work}/routing/huge.csv")
cli_expect_error(routing_repeated_expert "repeat.csv:3 lists expert 0 of olmoe/c4/layer 7 again"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${_work}/routing/repeat.csv")
cli_expect_error(routing_no_rows "model 'olmoe' is not in [^\n]*empty.csv \\(it has no topk rows\\)"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${_work}/routing/empty.csv")
cli_expect_error(unknown_domain "domain 'poetry' is not in .*\\(has arxiv, book, c4"
                 "${_mpi} -n 1 ${_exe} run --domain poetry")
cli_expect_error(unknown_layer "layer 3 is not in .* for olmoe/c4 \\(has 0, 7, 15\\)"
                 "${_mpi} -n 1 ${_exe} run --layer 3")
cli_expect_error(routing_file_directory "real routing: '[^']*' is a directory, not a file"
                 "${_mpi} -n 1 ${_exe} run --routing-file ${CMAKE_CURRENT_BINARY_DIR}")
# The real-routing flags with another routing would be ignored: refused.
cli_expect_error(run_layer_without_real_routing
                 "--layer applies to --routing real only, got --routing uniform"
                 "${_mpi} -n 1 ${_exe} run --routing uniform --layer 15")
cli_expect_error(bench_domain_without_real_routing
                 "--domain applies to --routing real only, got --routing gate"
                 "${_mpi} -n 1 ${_exe} bench --routing gate --domain c4")

# Huge sizes: each flag has a bound (named in the message), products are overflow-checked and
# the memory a rank needs is estimated against the machine's before anything is allocated.
cli_expect_error(tokens_huge "--tokens: must be an integer in \\[0, 2147483647\\], got 4611686018427387904"
                 "${_mpi} -n 2 --oversubscribe ${_exe} run --tokens 4611686018427387904")
cli_expect_error(tokens_int64_max "--tokens: must be an integer in \\[0, 2147483647\\], got 9223372036854775807"
                 "${_mpi} -n 1 ${_exe} run --tokens 9223372036854775807")
cli_expect_error(tokens_beyond_int64 "--tokens: must be an integer in \\[0, 2147483647\\], got 99999999999999999999"
                 "${_mpi} -n 1 ${_exe} run --tokens 99999999999999999999")
cli_expect_error(hidden_huge "--hidden: must be an integer in \\[1, 2147483647\\], got 4611686018427387904"
                 "${_mpi} -n 1 ${_exe} run --hidden 4611686018427387904")
cli_expect_error(experts_huge "--experts: must be an integer in \\[1, 2147483646\\] \\(expert ids are int32\\), got 4611686018427387904"
                 "${_mpi} -n 1 ${_exe} run --experts 4611686018427387904")
cli_expect_error(experts_above_int32 "--experts: must be an integer in \\[1, 2147483646\\][^\n]*got 2147483648"
                 "${_mpi} -n 1 ${_exe} run --experts 2147483648 --tokens 4")
cli_expect_error(ffn_huge "--ffn: must be an integer in \\[1, 2147483647\\], got 9223372036854775807"
                 "${_mpi} -n 1 ${_exe} run --ffn 9223372036854775807")
cli_expect_error_once(size_overflow
                      "InvalidArgument: moe-ep run: the global batch x in bytes = N 2147483647 \\(--tokens 2147483647 x W 1\\) x --hidden 2147483647 x 4 B \\(fp32\\) overflows a 64-bit integer \\(bound 2\\^63 - 1"
                      "${_mpi} -n 1 ${_exe} run --tokens 2147483647 --hidden 2147483647 --dtype fp32 --expert-fn scale")
cli_expect_error_once(memory_tokens
                      "InvalidArgument: moe-ep run: --tokens 2147483647 with H 2048 [^\n]* needs about [0-9.]+ GiB on rank 0 \\(more than this machine's [0-9.]+ GiB[^\n]*; use fewer --tokens"
                      "${_mpi} -n 2 --oversubscribe ${_exe} run --tokens 2147483647 --expert-fn scale")
cli_expect_error_once(memory_experts
                      "InvalidArgument: moe-ep run: --tokens 4 with --hidden 1048576 \\(--experts 2147483584,[^\n]* needs about [0-9.]+ GiB on rank 0 [^\n]*; use fewer --experts or a smaller --hidden"
                      "${_mpi} -n 1 ${_exe} run --experts 2147483584 --routing gate --hidden 1048576 --expert-fn scale --tokens 4")
cli_expect_error_once(swiglu_weights_too_large
                      "moe-ep run: swiglu expert: W1 and W3 = 2 x --ffn 1048576 x H 2048 = 4294967296 weights exceed 2\\^31 - 1"
                      "${_mpi} -n 1 ${_exe} run --ffn 1048576 --tokens 1")

# Flags that are not numbers, or not in range, get a readable message.
cli_expect_error(timeout_zero "--timeout: must be a finite number of seconds > 0, got 0"
                 "${_mpi} -n 1 ${_exe} run --timeout 0")
cli_expect_error(timeout_negative "--timeout: must be a finite number of seconds > 0, got -3"
                 "${_mpi} -n 1 ${_exe} run --timeout -3")
cli_expect_error(timeout_inf "--timeout: must be a finite number of seconds > 0, got inf"
                 "${_mpi} -n 1 ${_exe} run --timeout inf")
cli_expect_error(tokens_not_integer "--tokens: must be an integer [^\n]*got abc \\(not an integer\\)"
                 "${_mpi} -n 1 ${_exe} run --tokens abc")
cli_expect_error(seed_negative "--seed: must be an integer in \\[0, 18446744073709551615\\] \\(the seed is unsigned\\), got -1"
                 "${_mpi} -n 1 ${_exe} run --seed -1")

# Bad routing files: named file, field, index and value; one message for all ranks.
set(_bad ${_work}/bad_ids)
cli_expect_error_once(load_bad_seed
                      "InvalidArgument: routing file '[^']*seed.safetensors': metadata seed = 'xyz' is not an unsigned integer"
                      "${_run2} --load-routing ${_bad}/seed.safetensors"
                      FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error_once(load_bad_expert_count
                      "InvalidArgument: --load-routing '[^']*experts.safetensors': metadata moe_expert_num = 'abc' is not a decimal integer"
                      "${_run2} --load-routing ${_bad}/experts.safetensors"
                      FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error_once(load_nan_scale
                      "InvalidArgument: routing file '[^']*nan.safetensors': expert_scales\\[3,0\\] = nan is not finite"
                      "${_run2} --load-routing ${_bad}/nan.safetensors"
                      FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error_once(load_inf_x
                      "InvalidArgument: routing file '[^']*inf.safetensors': x\\[5,17\\] = inf is not finite"
                      "${_run2} --load-routing ${_bad}/inf.safetensors"
                      FIXTURES_REQUIRED cli_bad_ids)
# dispatch_v2 names rank 1's token 3; the tool adds the file's row (4 tokens per rank: row 7).
cli_expect_error_once(id_out_of_range_file_row
                      "InvalidArgument: dispatch_v2: expert_ids\\[3,1\\][^\n]*\\(rank 1 holds rows \\[4, 8\\) of routing file '[^']*range.safetensors': expert_ids\\[3,\\*\\] is file row 7\\)"
                      "${_run2} --load-routing ${_bad}/range.safetensors"
                      FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error_once(experts_not_divisible_once
                      "--redundant-experts 0: E \\+ R = 8 \\+ 0 = 8 expert slots cannot be split evenly over W = 3 ranks \\(SPEC §1.3: moe_expert_num % ep_world_size == 0 with moe_expert_num = E \\+ R\\); use --redundant-experts 1 \\(the default: the smallest R with \\(E \\+ R\\) % 3 == 0\\); or 4 ranks"
                      "${_mpi} -n 3 --oversubscribe ${_exe} run --preset mixtral-8x7b --tokens 2 --ffn 8 --redundant-experts 0")

# Flags a loaded batch would silently ignore are errors.
cli_expect_error(load_with_tokens
                 "--tokens cannot be combined with --load-routing: the file fixes the tokens per rank"
                 "${_run2} --tokens 8 --load-routing ${_bad}/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(load_with_routing
                 "--routing cannot be combined with --load-routing: the file fixes the routing"
                 "${_run2} --routing gate --load-routing ${_bad}/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(load_with_domain
                 "--domain cannot be combined with --load-routing: the file fixes the routing"
                 "${_run2} --domain arxiv --load-routing ${_bad}/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
# --seed with a loaded batch sets only the swiglu weights; the header says so and shows no router.
cli_expect_output(load.seed_header
                  "tokens/rank 4 \\(N 8, from the file\\)\n  seed 5 \\(--seed; expert weights only: x and routing come from the file, saved with seed 0\\)\n.*\nPASS: "
                  "${_mpi} -n 2 --oversubscribe ${_exe} run --preset mixtral-8x7b --ffn 16 --seed 5 --load-routing ${_bad}/good.safetensors"
                  NOT_REGEX "router scores" FIXTURES_REQUIRED cli_bad_ids)
cli_expect_output(load.seed_unused
                  "seed not used \\(x and routing come from the file; expert-fn identity has no weights\\)\n.*\nPASS: "
                  "${_mpi} -n 1 ${_exe} run --preset mixtral-8x7b --expert-fn identity --load-routing ${_bad}/good.safetensors"
                  NOT_REGEX "router scores" FIXTURES_REQUIRED cli_bad_ids)

# Outputs never overwrite the input or each other (./F and F are the same file), and an output
# path that cannot be written fails before the run.
cli_expect_error(save_output_is_input
                 "--save-output '[^']*/\\./good.safetensors' and --load-routing '[^']*/good.safetensors' are the same file \\(the run would overwrite its input\\)"
                 "${_run2} --load-routing ${_bad}/good.safetensors --save-output ${_bad}/./good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(save_routing_is_input
                 "--save-routing '[^']*' and --load-routing '[^']*' are the same file"
                 "${_run2} --load-routing ${_bad}/good.safetensors --save-routing ${_bad}/../bad_ids/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(save_output_is_save_routing
                 "--save-output '[^']*' and --save-routing '[^']*' are the same file \\(one output would overwrite the other\\)"
                 "${_run2} --tokens 2 --save-routing ${_work}/same.safetensors --save-output ${_work}/x/../same.safetensors")
cli_expect_error_once(save_output_unwritable
                      "InvalidArgument: moe-ep run: --save-output '/nonexistent/dir/out.safetensors': cannot create a file in directory '/nonexistent/dir': No such file or directory"
                      "${_run2} --tokens 2 --save-output /nonexistent/dir/out.safetensors")
cli_expect_error_once(save_routing_is_directory
                      "InvalidArgument: moe-ep run: --save-routing '[^']*': is a directory, not a file name"
                      "${_run2} --tokens 2 --save-routing ${_cli}")

# ---- Shared experts, special experts, x_active_mask, global_bs (issue 3) ----------------------
# Each run checks itself against the dense reference: bitwise for scale/identity (SPEC §2.2, §2.3:
# shared outputs added without weight after the K terms; inactive tokens 0), a tolerance for swiglu.
# deepseek-v3's shared expert on every rank, entering combine_v2 as shared_expert_x (S = 0).
moe_ep_add_mpi_test(NAME cli.run.deepseek_shared_local_scale
                    COMMAND ${_exe} run --preset deepseek-v3 --hidden 256 --tokens 8
                            --expert-fn scale
                    NPROCS 1 2 4 TIMEOUT 120)
# The issue's run with one shared-expert rank: 256 experts cannot be split over the 3 MoE ranks
# (SPEC §1.3), so by default the tool adds R = 2 redundant expert slots (DeepSeek's EPLB) holding
# replicas of the two busiest experts (by the real data's p_e): 258 slots, 86 per MoE rank. The
# routing stays over the 256 experts; even tokens use an expert's own slot, odd ones its replica.
# The header names the replicas and the run shows both copies of each receive rows.
cli_expect_output(run.deepseek_shared_rank_acceptance
                  "E 256 \\(\\+2 redundant slots: replicas of experts [0-9]+, [0-9]+\\)[ \n]+K 8[ \n].*moe_expert_num = E \\+ R = 258;[ \n]+slot p on rank 1 \\+ p / 86;.*redundant slots used \\(rows per slot, original first\\):[ \n]+expert [0-9]+ on slots [0-9]+/25[67]: [1-9][0-9]*/[1-9][0-9]* rows;[ \n]+expert [0-9]+ on slots [0-9]+/25[67]: [1-9][0-9]*/[1-9][0-9]* rows\n.*\nPASS: "
                  "${_mpi} -n 4 --oversubscribe ${_exe} run --preset deepseek-v3 --ffn 128 --tokens 16 --shared-experts 1 --shared-expert-ranks 1 --routing real"
                  NOT_REGEX "FAIL" PROCESSORS 4)
# With --experts 192 (a multiple of 3 the real data's 64 experts map onto) no slot is redundant.
moe_ep_add_mpi_test(NAME cli.run.deepseek_shared_rank_real
                    COMMAND ${_exe} run --preset deepseek-v3 --ffn 128 --tokens 16
                            --shared-experts 1 --shared-expert-ranks 1 --routing real
                            --experts 192
                    NPROCS 4 TIMEOUT 180)
moe_ep_add_mpi_test(NAME cli.run.shared_ranks_scale
                    COMMAND ${_exe} run --preset deepseek-v3 --hidden 256 --tokens 8
                            --shared-expert-ranks 2 --expert-fn scale
                    NPROCS 3 4 TIMEOUT 120)
# Two shared experts, each replicated on S/Ns ranks; uneven traffic to them (odd tokens).
moe_ep_add_mpi_test(NAME cli.run.two_shared_experts_identity
                    COMMAND ${_exe} run --shared-experts 2 --shared-expert-ranks 2 --experts 2
                            --top-k 2 --hidden 128 --tokens 5 --expert-fn identity
                    NPROCS 3 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.shared_rank_swiglu_fp32
                    COMMAND ${_exe} run --preset mixtral-8x7b --shared-experts 1
                            --shared-expert-ranks 1 --hidden 128 --ffn 32 --tokens 6
                            --routing gate --dtype fp32
                    NPROCS 2 3 TIMEOUT 120)
# Zero, copy and const experts (ori_x = x; alpha_1, alpha_2, v from the seed).
moe_ep_add_mpi_test(NAME cli.run.special_experts_scale
                    COMMAND ${_exe} run --zero-experts 1 --copy-experts 1 --const-experts 1
                            --hidden 256 --tokens 8 --expert-fn scale
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.special_experts_swiglu_fp16
                    COMMAND ${_exe} run --preset mixtral-8x7b --zero-experts 2 --copy-experts 1
                            --const-experts 2 --hidden 128 --ffn 16 --tokens 8 --dtype fp16
                            --routing uniform
                    NPROCS 2 TIMEOUT 120)
# Only special experts for some tokens: K = 3 over E 2 + Z 1 + C 1 + Q 1.
moe_ep_add_mpi_test(NAME cli.run.special_experts_many_identity
                    COMMAND ${_exe} run --experts 2 --top-k 3 --zero-experts 1 --copy-experts 1
                            --const-experts 1 --hidden 64 --tokens 9 --routing uniform
                            --expert-fn identity
                    NPROCS 1 2 TIMEOUT 120)
# comm_alg "hierarchy" (SPEC §3) on 2 and 3 emulated nodes of 2 ranks, with shared and special
# experts, a 2-D mask and int8 both ways, against the dense reference.
# Exit status 0 and the PASS line (cli_expect_output: a PASS_REGULAR_EXPRESSION alone would
# ignore the exit status, so a run that printed PASS and then failed would pass).
foreach(n 4 6)
  cli_expect_output(run.hierarchy.np${n} "comm_alg hierarchy.*PASS"
                    "${_mpi} -n ${n} --oversubscribe ${_exe} run --comm-alg hierarchy --hidden 128 --tokens 12 --experts 16 --top-k 4 --shared-experts 1 --shared-expert-ranks 2 --zero-experts 1 --copy-experts 1 --mask entries --expert-fn scale"
                    PROCESSORS ${n})
  set_tests_properties(cli.run.hierarchy.np${n} PROPERTIES
                       ENVIRONMENT "${MOE_EP_TEST_ENV};MOE_EP_SHM_NODE_RANKS=2")
  cli_expect_output(run.hierarchy_int8.np${n} "comm_alg hierarchy.*PASS"
                    "${_mpi} -n ${n} --oversubscribe ${_exe} run --comm-alg hierarchy --hidden 128 --tokens 12 --experts 16 --top-k 4 --quant int8 --comm-quant int8 --expert-fn scale"
                    PROCESSORS ${n})
  set_tests_properties(cli.run.hierarchy_int8.np${n} PROPERTIES
                       ENVIRONMENT "${MOE_EP_TEST_ENV};MOE_EP_SHM_NODE_RANKS=2")
  # EpConfig::partials in the token dtype: within the bound with the partials' rounding.
  cli_expect_output(run.hierarchy_bf16_partials.np${n} "each remote node's partial rounded.*PASS"
                    "${_mpi} -n ${n} --oversubscribe ${_exe} run --comm-alg hierarchy --partials bf16 --hidden 128 --tokens 12 --experts 16 --top-k 4 --shared-experts 1 --shared-expert-ranks 2 --expert-fn scale"
                    PROCESSORS ${n})
  set_tests_properties(cli.run.hierarchy_bf16_partials.np${n} PROPERTIES
                       ENVIRONMENT "${MOE_EP_TEST_ENV};MOE_EP_SHM_NODE_RANKS=2")
endforeach()
cli_expect_usage_error(partials_other_dtype "--partials bf16 must be fp32, or bf16 with bf16 tokens \\(--dtype fp16\\)"
                       "run --comm-alg hierarchy --partials bf16 --dtype fp16")
cli_expect_usage_error(partials_fullmesh "--partials bf16 applies to --comm-alg hierarchy only"
                       "run --partials bf16")
cli_expect_usage_error(bench_partials_fullmesh "--partials bf16 applies to --comm-alg hierarchy only"
                       "bench --partials bf16")
# x_active_mask: 1-D prefix and 2-D entries; inactive tokens give 0.
moe_ep_add_mpi_test(NAME cli.run.mask_prefix_identity
                    COMMAND ${_exe} run --mask prefix --hidden 128 --tokens 7 --expert-fn identity
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.mask_entries_scale
                    COMMAND ${_exe} run --mask entries --hidden 128 --tokens 9 --expert-fn scale
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.mask_entries_swiglu
                    COMMAND ${_exe} run --preset mixtral-8x7b --mask entries --hidden 128
                            --ffn 16 --tokens 8
                    NPROCS 2 TIMEOUT 120)
# Everything at once: shared-expert rank, special experts and a 2-D mask.
moe_ep_add_mpi_test(NAME cli.run.shared_special_mask_scale
                    COMMAND ${_exe} run --preset deepseek-v3 --experts 192 --hidden 128
                            --shared-expert-ranks 1 --zero-experts 1 --copy-experts 1
                            --const-experts 2 --mask entries --tokens 6 --expert-fn scale
                    NPROCS 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.global_bs_scale
                    COMMAND ${_exe} run --global-bs 64 --hidden 128 --tokens 8 --expert-fn scale
                    NPROCS 4 TIMEOUT 120)
# The mask and the special-expert counts travel with a saved batch; reloaded at other W the
# output is byte-for-byte the same (a 2-D mask needs BS equal on all ranks: SPEC §1.3). A 1-D
# prefix mask is a prefix only for the W it was made at: replayed at the same W, the inactive
# tokens stay 0.
cli_roundtrip(mask_special_scale 2 "1 4" ""
              "--expert-fn scale --hidden 64 --tokens 4 --mask entries --zero-experts 1 --copy-experts 1 --const-experts 2")
# A 1-D prefix mask replays at another W whose split keeps each rank's rows a prefix: 2 x 8
# tokens (T T T T T T F F each) at 4 ranks of 4.
cli_roundtrip(mask_prefix_replay 2 "4" "" "--expert-fn scale --hidden 64 --tokens 8 --mask prefix")
cli_roundtrip(mask_prefix_shared 2 "2" ""
              "--preset deepseek-v3 --hidden 64 --ffn 16 --tokens 4 --mask prefix")

# ---- Redundant expert slots (DeepSeek's EPLB): --redundant-experts ---------------------------
# Saved at 4 ranks with one shared-expert rank (R = 2: replicas of the two busiest experts, even
# tokens to the original slot, odd ones to the replica; special ids shifted by R), reloaded at 2
# ranks with S = 0 (R = 0) and at 3 ranks (R = 2, replicas chosen from the file's counts): the
# outputs are byte-for-byte the same (a replica computes exactly its logical expert).
cli_roundtrip(redundant_shared_special_scale 4 "2 3" ""
              "--preset deepseek-v3 --hidden 128 --tokens 6 --expert-fn scale --zero-experts 1 --copy-experts 1 --const-experts 2 --mask entries"
              "--shared-expert-ranks 1")
# More redundant slots than experts: E 4 + R 5 = 9 slots over 3 ranks; uniform routing replicates
# experts 0, 1, 2, 3, 0 (expert 0 has three copies: token index mod 3).
cli_expect_output(run.redundant_cycle_uniform
                  "E 4 \\(\\+5 redundant slots: replicas of experts 0, 1, 2, 3, 0\\).*expert 0 on slots 0/4/8: [1-9][0-9]*/[1-9][0-9]*/[1-9][0-9]* rows;[ \n]+expert 1 on slots 1/5: .*\nPASS: "
                  "${_mpi} -n 3 --oversubscribe ${_exe} run --preset mixtral-8x7b --experts 4 --routing uniform --redundant-experts 5 --hidden 64 --tokens 12 --expert-fn scale"
                  NOT_REGEX "FAIL" PROCESSORS 3)
# 8 experts at 3 ranks (R = 1, gate routing: a replica of expert 0), swiglu.
moe_ep_add_mpi_test(NAME cli.run.redundant_mixtral_gate_swiglu
                    COMMAND ${_exe} run --preset mixtral-8x7b --routing gate --hidden 128 --ffn 16
                            --tokens 8
                    NPROCS 3 TIMEOUT 120)

# Errors of the new flags: non-zero exit, a message naming the parameter.
cli_expect_error(mask_not_prefix
                 "dispatch_v2: x_active_mask\\[2\\] = true follows x_active_mask\\[1\\] = false"
                 "${_mpi} -n 2 --oversubscribe ${_exe} run --mask bad-prefix --tokens 4 --hidden 64 --expert-fn scale")
# A 1-D prefix mask saved at 2 ranks is no prefix for 1 rank.
add_test(NAME cli.mask_file.setup
         COMMAND ${_mpi} -n 2 --oversubscribe ${_exe} run --mask prefix --tokens 4 --hidden 64
                 --expert-fn scale --save-routing ${CMAKE_CURRENT_BINARY_DIR}/cli_mask_prefix.safetensors)
set_tests_properties(cli.mask_file.setup PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 120
                                                    FIXTURES_SETUP cli_mask_file)
cli_expect_error_once(mask_file_not_prefix
                      "--load-routing '[^']*cli_mask_prefix.safetensors': on 1 rank, rank 0 takes file rows \\[0, 8\\), where its 1-D x_active_mask has a True after a False \\(SPEC §1.3: all Trues before all Falses on each rank\\); it was saved on 2 ranks, where it fits"
                      "${_mpi} -n 1 ${_exe} run --expert-fn scale --hidden 64 --load-routing ${CMAKE_CURRENT_BINARY_DIR}/cli_mask_prefix.safetensors"
                      FIXTURES_REQUIRED cli_mask_file)
# A 1-D mask with inactive tokens saved at 2 ranks of 5 tokens: 4 ranks split them 3, 3, 2, 2.
# (A 2-D mask whose rows each keep a True leaves every token active: no error.)
add_test(NAME cli.mask_file.setup_entries
         COMMAND ${_mpi} -n 2 --oversubscribe ${_exe} run --mask prefix --tokens 5 --hidden 64
                 --expert-fn scale --save-routing ${CMAKE_CURRENT_BINARY_DIR}/cli_mask_entries.safetensors)
set_tests_properties(cli.mask_file.setup_entries PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}"
                                                            TIMEOUT 120 FIXTURES_SETUP cli_mask_file)
cli_expect_error_once(mask_file_uneven
                      "--load-routing '[^']*cli_mask_entries.safetensors': on 4 ranks the 10 tokens split unevenly \\(3, 3, 2, 2\\), and rank [0-3]'s file rows \\[[0-9]+, [0-9]+\\) have a token that x_active_mask leaves inactive \\(SPEC §1.3: when BS differs across ranks every token must be active\\); it was saved on 2 ranks, where it fits"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --expert-fn scale --hidden 64 --load-routing ${CMAKE_CURRENT_BINARY_DIR}/cli_mask_entries.safetensors"
                      FIXTURES_REQUIRED cli_mask_file)
cli_expect_error(load_with_mask
                 "--mask cannot be combined with --load-routing: the file fixes x_active_mask"
                 "${_mpi} -n 1 ${_exe} run --expert-fn scale --hidden 64 --mask entries --load-routing ${CMAKE_CURRENT_BINARY_DIR}/cli_mask_prefix.safetensors"
                 FIXTURES_REQUIRED cli_mask_file)
cli_expect_error_once(load_other_special_counts
                      "InvalidArgument: --load-routing '[^']*': saved with zero_expert_num = 0, this run has --zero-experts 1"
                      "${_run2} --load-routing ${_bad}/good.safetensors --zero-experts 1"
                      FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(copy_without_ori_x "combine_v2: ori_x is required when copy_expert_num = 1"
                 "${_mpi} -n 2 --oversubscribe ${_exe} run --copy-experts 1 --debug-omit-ori-x --tokens 4 --hidden 64 --expert-fn scale")
cli_expect_error(const_without_ori_x "combine_v2: ori_x is required when const_expert_num = 2"
                 "${_mpi} -n 1 ${_exe} run --const-experts 2 --debug-omit-ori-x --tokens 4 --hidden 64 --expert-fn scale")
cli_expect_error(shared_ranks_not_multiple
                 "--shared-expert-ranks 3 \\(shared_expert_rank_num\\) is not a multiple of --shared-experts 2 \\(shared_expert_num\\)"
                 "${_mpi} -n 1 ${_exe} run --shared-experts 2 --shared-expert-ranks 3")
cli_expect_error(shared_ranks_without_shared
                 "--shared-expert-ranks 1 \\(shared_expert_rank_num\\) needs shared experts, but --shared-experts 0 \\(shared_expert_num, the preset's\\) is 0"
                 "${_mpi} -n 2 ${_exe} run --shared-expert-ranks 1")
cli_expect_error(two_shared_without_ranks
                 "--shared-experts 2 \\(shared_expert_num\\) needs --shared-expert-ranks > 0"
                 "${_mpi} -n 1 ${_exe} run --shared-experts 2")
cli_expect_error_once(shared_ranks_all
                      "--shared-expert-ranks 2 \\(shared_expert_rank_num\\) must be below the 2 EP ranks"
                      "${_mpi} -n 2 --oversubscribe ${_exe} run --preset deepseek-v3 --shared-expert-ranks 2")
# The issue's command without redundant slots: 256 experts over W - S = 3 MoE ranks is impossible
# (SPEC §1.3); the message names the default R and the other ways out.
cli_expect_error_once(deepseek_shared_rank_w4
                      "InvalidArgument: moe-ep run: --redundant-experts 0: E \\+ R = 256 \\+ 0 = 256 expert slots cannot be split evenly over the W_ep - S = 4 - 1 = 3 MoE ranks \\(SPEC §1.3: moe_expert_num % \\(ep_world_size - shared_expert_rank_num\\) == 0 with moe_expert_num = E \\+ R[^\n]*; use --redundant-experts 2 \\(the default: the smallest R with \\(E \\+ R\\) % 3 == 0\\); or --experts 192, --shared-expert-ranks 2 or 5 ranks \\(with --routing real, E must also map onto the data's 64 experts\\)"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --preset deepseek-v3 --ffn 128 --tokens 16 --shared-experts 1 --shared-expert-ranks 1 --routing real --redundant-experts 0")
# An explicit R must fill the MoE ranks evenly.
cli_expect_error_once(redundant_not_multiple
                      "InvalidArgument: moe-ep run: --redundant-experts 1: E \\+ R = 256 \\+ 1 = 257 expert slots cannot be split evenly over the W_ep - S = 4 - 1 = 3 MoE ranks \\(SPEC §1.3: moe_expert_num % \\(ep_world_size - shared_expert_rank_num\\) == 0 with moe_expert_num = E \\+ R[^\n]*; use --redundant-experts 2 \\(the default"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --preset deepseek-v3 --ffn 16 --hidden 64 --tokens 2 --shared-expert-ranks 1 --redundant-experts 1")
cli_expect_error(redundant_negative "--redundant-experts: must be an integer in \\[0, 2147483646\\], got -1"
                 "${_mpi} -n 1 ${_exe} run --redundant-experts -1")
cli_expect_error_once(redundant_tp_not_one_per_rank
                      "--tp 2 needs one expert per MoE rank [^\n]*but E = 2 \\+ R = 2 redundant over W_ep = 2 ranks gives 2 per rank; use --redundant-experts 0 \\(E \\+ R = W_ep - S\\)"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --tp 2 --experts 2 --top-k 2 --hidden 64 --tokens 2 --expert-fn scale --redundant-experts 2")
cli_expect_error(top_k_above_all_experts "K = 5 exceeds the number of experts E = 2 \\+ Z \\+ C \\+ Q = 4"
                 "${_mpi} -n 1 ${_exe} run --experts 2 --top-k 5 --zero-experts 1 --copy-experts 1")
cli_expect_error(bad_mask "--mask: half not in \\{none, prefix, entries\\}"
                 "${_mpi} -n 1 ${_exe} run --mask half")
cli_expect_error(bad_quant "--quant" "${_mpi} -n 1 ${_exe} run --quant int4")
cli_expect_error_once(global_bs_too_small
                      "moe-ep run: --global-bs 16 is less than W_ep x max tokens per rank = 4 x 8 = 32 \\(SPEC §1.3\\)"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --global-bs 16 --tokens 8 --hidden 64 --expert-fn scale")
cli_expect_error_once(global_bs_not_multiple
                      "moe-ep run: --global-bs 34 is not a multiple of W_ep = 4 \\(SPEC §1.3\\)"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --global-bs 34 --tokens 8 --hidden 64 --expert-fn scale")
# TP: an even world, one expert per MoE rank, no combine quantisation.
cli_expect_error_once(tp_odd_world "--tp 2 needs a multiple of 2 ranks \\(W_ep x T\\), got 3"
                      "${_mpi} -n 3 --oversubscribe ${_exe} run --tp 2")
cli_expect_error_once(tp_many_experts_per_rank
                      "--tp 2 needs one expert per MoE rank \\(SPEC §1.3: with tp_world_size 2, local_expert_num must be 1\\), but E = 64 over W_ep = 2 ranks gives 32 per rank; use --experts 2 --top-k 2"
                      "${_mpi} -n 4 --oversubscribe ${_exe} run --tp 2")
cli_expect_error(tp_comm_quant "--comm-quant int8 cannot be combined with --tp 2"
                 "${_mpi} -n 1 ${_exe} run --tp 2 --comm-quant int8")

# Installed, the tool finds its data relative to itself.
add_test(NAME cli.installed
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DPREFIX=${_work}/prefix
                 -DMPIEXEC=${_mpi} -P ${_cli}/installed.cmake)
set_tests_properties(cli.installed PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 300)

# int8 (SPEC §1.5): scale/identity against the unquantised reference within the per-element bound
# derived from amax/254; swiglu against a reference that quantises like the run.
moe_ep_add_mpi_test(NAME cli.run.quant_int8_scale
                    COMMAND ${_exe} run --quant int8 --comm-quant int8 --hidden 128 --tokens 8
                            --expert-fn scale
                    NPROCS 1 2 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.quant_dispatch_identity_fp16
                    COMMAND ${_exe} run --quant int8 --preset mixtral-8x7b --hidden 128
                            --tokens 8 --dtype fp16 --expert-fn identity
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.comm_quant_scale_fp32
                    COMMAND ${_exe} run --comm-quant int8 --hidden 128 --tokens 8 --dtype fp32
                            --expert-fn scale
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.quant_int8_swiglu
                    COMMAND ${_exe} run --quant int8 --comm-quant int8 --preset mixtral-8x7b
                            --hidden 128 --ffn 32 --tokens 8
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.quant_shared_special_mask_scale
                    COMMAND ${_exe} run --quant int8 --comm-quant int8 --preset deepseek-v3
                            --experts 192 --hidden 128 --shared-expert-ranks 1 --zero-experts 1
                            --copy-experts 1 --const-experts 1 --mask entries --tokens 6
                            --expert-fn scale
                    NPROCS 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.quant_deepseek_local_shared
                    COMMAND ${_exe} run --quant int8 --comm-quant int8 --preset deepseek-v3
                            --hidden 128 --tokens 6 --expert-fn scale
                    NPROCS 2 TIMEOUT 120)

# Tensor parallelism (--tp 2, SPEC §1.1 step 3, §2): world = W_ep x 2, one expert per MoE rank;
# scale/identity bitwise (TP rank 1 adds zeros), swiglu within the tolerance (FFN halves).
moe_ep_add_mpi_test(NAME cli.run.tp2_scale
                    COMMAND ${_exe} run --tp 2 --experts 2 --top-k 2 --hidden 128 --tokens 8
                            --routing uniform --expert-fn scale
                    NPROCS 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.tp2_identity_one_ep_rank
                    COMMAND ${_exe} run --tp 2 --experts 1 --top-k 1 --hidden 64 --tokens 5
                            --expert-fn identity
                    NPROCS 2 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.tp2_swiglu
                    COMMAND ${_exe} run --tp 2 --preset mixtral-8x7b --experts 2 --top-k 2
                            --hidden 128 --ffn 33 --tokens 6
                    NPROCS 4 TIMEOUT 120)
moe_ep_add_mpi_test(NAME cli.run.tp2_shared_rank_special_mask
                    COMMAND ${_exe} run --tp 2 --experts 2 --top-k 2 --shared-experts 1
                            --shared-expert-ranks 1 --zero-experts 1 --copy-experts 1
                            --mask entries --hidden 64 --tokens 4 --routing uniform
                            --expert-fn scale
                    NPROCS 6 TIMEOUT 120)

# moe-ep bench (issue 6): --compare at small sizes runs, verifies, prints the table, ratios and
# targets, and writes CSV, JSON and (with gnuplot) a PNG, all consistent with each other. Not a
# timing check.
add_test(NAME cli.bench.compare
         COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${_mpi} -DEXE=${_exe} -DWORK=${_work}/bench
                 -DPYTHON=${Python3_EXECUTABLE} -DCHECK=${_cli}/bench_check.py
                 -P ${_cli}/bench.cmake)
set_tests_properties(cli.bench.compare PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 180
                                                  PROCESSORS 2)
# On two nodes ($MOE_EP_SHM_NODE_RANKS=2, 4 ranks): fullmesh and hierarchy side by side (issue
# 21), with their inter-node and intra-node bytes. Across machines of their own: multihost.bench.
add_test(NAME cli.bench.compare_nodes
         COMMAND ${CMAKE_COMMAND} "-DLAUNCH=${_mpi};-n;4;--oversubscribe" -DEXE=${_exe}
                 -DWORK=${_work}/bench_nodes -DPYTHON=${Python3_EXECUTABLE}
                 -DCHECK=${_cli}/bench_check.py -P ${_cli}/bench_nodes.cmake)
set_tests_properties(cli.bench.compare_nodes PROPERTIES
                     ENVIRONMENT "${MOE_EP_TEST_ENV};MOE_EP_SHM_NODE_RANKS=2" TIMEOUT 300
                     PROCESSORS 4)
# --transport mpi: moe-ep's ops on plain MPI, verified like the shm default, and named in the
# header line.
cli_expect_output(bench.transport_mpi "seed 0  transport mpi  comm_alg fullmesh  --compare  --quant int8\n.*verified\n.*verified\n"
  "${_mpi} -n 2 --oversubscribe ${_exe} bench --transport mpi --tokens 8,16 --hidden 64 --iters 2 --warmup 0 --compare"
  NOT_REGEX "error|FAILED|abort|verification failed" PROCESSORS 2)
# --exact-size: moe-ep's outputs sized to the rows received, verified like the default, named
# in the header line; the peak RSS line follows.
cli_expect_output(bench.exact_size "transport shm  comm_alg fullmesh  --exact-size  --quant int8\n.*verified\n.*verified\n.*peak RSS per rank \\(VmHWM, whole run\\): min"
  "${_mpi} -n 2 --oversubscribe ${_exe} bench --exact-size --tokens 8,16 --hidden 64 --iters 2 --warmup 0 --quant int8"
  NOT_REGEX "error|FAILED|abort|verification failed" PROCESSORS 2)
# --overlap (moe_ep/async.h): the two-micro-batch layer, sequential and overlapped, bitwise equal
# outputs, on 3 ranks with the last holding twice the tokens; --ffn out of range is refused.
cli_expect_output(bench.overlap "tokens/rank 8 \\(last rank 16\\).*ffn 16 \\(--ffn\\).*sequential .* overlapped .* ratio .*; outputs bitwise equal\n.*whole dispatch .* per source"
  "${_mpi} -n 3 --oversubscribe ${_exe} bench --overlap --experts 12 --top-k 4 --routing uniform --tokens 8 --hidden 64 --iters 2 --warmup 1 --ffn 16 --skew 2"
  NOT_REGEX "error|FAIL|abort" PROCESSORS 3)
cli_expect_usage_error(bench_overlap_ffn_range "--ffn: .*16" "bench --overlap --ffn 8")
cli_expect_usage_error(bench_overlap_skew_nan "--skew: must be a number in \\[1, 1024\\], got nan"
                       "bench --overlap --skew nan")
cli_expect_usage_error(bench_skew_needs_overlap "--skew requires --overlap" "bench --skew 2")
cli_expect_usage_error(bench_overlap_excludes_compare "--compare excludes --overlap"
                       "bench --overlap --compare")
# --compare times int8 dispatch too unless --quant none: the issue's targets include it.
cli_expect_output(bench.compare_times_int8 "--compare  --quant int8\n.*dispatch int8/bf16 time"
  "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 8 --hidden 64 --iters 2 --warmup 0 --compare"
  NOT_REGEX "error|FAILED|abort|verification failed" PROCESSORS 2)
cli_expect_output(bench.compare_quant_none "combine moe-ep/textbook"
  "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 8 --hidden 64 --iters 2 --warmup 0 --compare --quant none"
  NOT_REGEX "--quant int8|dispatch-int8|int8/bf16|error|FAILED|abort|verification failed"
  PROCESSORS 2)
# A write that fails after the run (a full device) ends the job at once with the flag named, on
# every rank: rank 0 no longer unwinds while the others wait for it until the deadline.
if(EXISTS /dev/full)
  cli_expect_error_once(bench_csv_write_fails "System: moe-ep bench: --csv '/dev/full': write failed"
                        "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 4 --hidden 32 --iters 1 --csv /dev/full")
  cli_expect_error_once(bench_json_write_fails "System: moe-ep bench: --json '/dev/full': write failed"
                        "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 4 --hidden 32 --iters 1 --json /dev/full")
  cli_expect_error_once(run_save_output_write_fails
                        "System: moe-ep run: --save-output: writing '/dev/full' failed"
                        "${_mpi} -n 2 --oversubscribe ${_exe} run --tokens 4 --hidden 32 --ffn 16 --save-output /dev/full")
  cli_expect_error_once(run_save_routing_write_fails
                        "System: moe-ep run: --save-routing: writing '/dev/full' failed"
                        "${_mpi} -n 2 --oversubscribe ${_exe} run --tokens 4 --hidden 32 --ffn 16 --save-routing /dev/full")
endif()
# A write that fails names the option, the path and the cause (strerror: /proc/version opens for
# root and takes no data, EIO; for others it is not writable, refused up front), printed once, and
# every rank ends with status 2 through MPI_Finalize: no MPI_ABORT banner.
if(EXISTS /proc/version)
  foreach(case "run;--save-routing" "run;--save-output" "bench;--json" "bench;--csv")
    list(GET case 0 sub)
    list(GET case 1 flag)
    string(REPLACE "-" "_" name "${sub}${flag}")
    if(sub STREQUAL "run")
      set(args "--tokens 4 --hidden 32 --ffn 16")
    else()
      set(args "--tokens 4 --hidden 32 --iters 1")
    endif()
    cli_command(_cmd "${_mpi} -n 2 --oversubscribe ${_exe} ${sub} ${args} ${flag} /proc/version")
    add_test(NAME cli.error.write_errno_${name}
             COMMAND ${CMAKE_COMMAND} "-DCMD=${_cmd}"
                     "-DREGEX=moe-ep: error: [A-Za-z]+: moe-ep ${sub}: ${flag}[^\n]*'/proc/version'[^\n]*: (Input/output error|Permission denied)\n"
                     -DEXIT=2 -DNOT_REGEX=MPI_ABORT -DONCE=1 -DTIMEOUT=45
                     -P ${_cli}/expect_error.cmake)
    set_tests_properties(cli.error.write_errno_${name} PROPERTIES
                         ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60 PROCESSORS 2)
  endforeach()
endif()
# One rank has no other rank to wait for: a deadline shorter than any MPI call (1 ns) fails
# neither the Communicator's creation (which blamed "another rank") nor the run.
cli_expect_output(run.one_rank_tiny_timeout "PASS"
                  "${_mpi} -n 1 ${_exe} run --tokens 4 --hidden 64 --progress off"
                  NOT_REGEX "moe-ep: error|Timeout|another rank")
set_tests_properties(cli.run.one_rank_tiny_timeout PROPERTIES
                     ENVIRONMENT "${MOE_EP_TEST_ENV};MOE_EP_TIMEOUT_S=1e-9")
cli_expect_error(bench_bad_transport "--transport: tcp not in \\{mpi,shm\\}"
                 "${_mpi} -n 1 ${_exe} bench --transport tcp")
# The verification can fail: a corrupted baseline row stops the run before timing, exit 1.
cli_expect_error(bench_verification_fails
                 "verification failed: 1 rows of the textbook pipeline's regrouped rows differ"
                 "${_mpi} -n 2 --oversubscribe ${_exe} bench --compare --tokens 8 --hidden 64 --iters 1 --debug-corrupt-baseline")
cli_expect_error_once(bench_experts_not_divisible
                      "InvalidArgument: moe-ep bench: E = 64 experts cannot be split evenly over 3 ranks"
                      "${_mpi} -n 3 --oversubscribe ${_exe} bench --tokens 4 --hidden 64")
# A malformed $MOE_EP_* is found before the first collective and reported once.
cli_expect_error_once(env_transport_once
                      "check_environment: MOE_EP_TRANSPORT = .foo. \\(used because transport is ..\\) is not one of"
                      "env MOE_EP_TRANSPORT=foo ${_mpi} -n 4 --oversubscribe ${_exe} run --tokens 4 --expert-fn scale")
cli_expect_error_once(env_timeout_once
                      "check_environment: MOE_EP_TIMEOUT_S = .abc. is not a finite number of seconds > 0"
                      "env MOE_EP_TIMEOUT_S=abc ${_mpi} -n 4 --oversubscribe ${_exe} run --tokens 4 --expert-fn scale")
cli_expect_error_once(bench_env_stream_min_once
                      "check_environment: MOE_EP_STREAM_MIN_BYTES = .xyz. is not a byte count"
                      "env MOE_EP_STREAM_MIN_BYTES=xyz ${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 4 --hidden 64")
# Memory is estimated before anything is allocated; per-expert tables count too.
cli_expect_error_once(bench_memory_experts
                      "moe-ep bench: --tokens 1 with H 7168 and E 2147483646 needs about [0-9.]+ GiB per rank x 2 ranks on this machine \\(more than its [0-9.]+ GiB; mostly per-expert tables\\); use fewer --experts"
                      "${_mpi} -n 2 --oversubscribe ${_exe} bench --experts 2147483646 --tokens 1 --routing uniform")
cli_expect_error_once(bench_memory_tokens
                      "needs about [0-9.]+ GiB per rank x 2 ranks on this machine \\(more than its [0-9.]+ GiB; mostly rows\\); use fewer --tokens or a smaller --hidden"
                      "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 1000000")
cli_expect_error(bench_bad_tokens "--tokens: each entry of 64,0 must be an integer in \\[1, 2147483647\\], got 0"
                 "${_mpi} -n 1 ${_exe} bench --tokens 64,0")
cli_expect_error_once(bench_csv_unwritable
                      "InvalidArgument: moe-ep bench: --csv '/nonexistent/dir/b.csv': cannot create a file in directory '/nonexistent/dir'"
                      "${_mpi} -n 2 --oversubscribe ${_exe} bench --tokens 4 --hidden 32 --csv /nonexistent/dir/b.csv")
# moe-ep plan: its model of a cluster must match the bytes moe-ep run measures on 2 emulated
# nodes (within 10 %), or nobody can trust it for clusters we do not have; its layout checks.
add_test(NAME cli.plan.matches_measured_bytes
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/cli/plan_check.py ${_mpi} ${_exe})
set_tests_properties(cli.plan.matches_measured_bytes PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}"
                                                                 TIMEOUT 300 PROCESSORS 4)
cli_expect_output(plan_deepseek "inter-node byte ratio hierarchy/fullmesh: dispatch [0-9.]+, combine [0-9.]+"
                  "${_exe} plan --preset deepseek-v3 --ranks 256 --ranks-per-node 16")
# DeepSeek-V3's node-limited routing: its 8 groups of 32 experts on 8 nodes, each token in 4.
cli_expect_output(plan_node_limited "group-limited: 8 groups of 32 experts, each token in 4 .*a group is a node's experts"
                  "${_exe} plan --preset deepseek-v3 --ranks 64 --ranks-per-node 8 --tokens 64")
# Issue 33's bar: node-limited routing and bf16 partials take both ops below 0.6x fullmesh's
# inter-node bytes at 64 = 8 x 8.
cli_expect_output(plan_node_limited_bf16 "partials bf16.*inter-node byte ratio hierarchy/fullmesh: dispatch 0\\.[0-5][0-9]*, combine 0\\.[0-5][0-9]*\n"
                  "${_exe} plan --preset deepseek-v3 --ranks 64 --ranks-per-node 8 --tokens 128 --partials bf16")
cli_expect_error(plan_partials_other_dtype "moe-ep plan: --partials bf16 must be fp32, or bf16 with bf16 tokens \\(--dtype fp32\\)"
                 "${_exe} plan --partials bf16 --dtype fp32 --ranks 4 --ranks-per-node 2")
# Special experts belong to no routing group: the preset's groups are dropped, and said; asked
# for, they are refused. A node-limited gate run passes its reference.
cli_expect_output(run.groups_dropped_for_special "not group-limited: special experts.*PASS"
                  "${_mpi} -n 2 --oversubscribe ${_exe} run --preset deepseek-v3 --zero-experts 1 --hidden 64 --ffn 8 --tokens 4"
                  PROCESSORS 2)
cli_expect_error(run_groups_with_special "--n-group / --topk-group cannot be combined with --zero-experts"
                 "${_mpi} -n 1 ${_exe} run --preset deepseek-v3 --zero-experts 1 --n-group 8 --hidden 64 --ffn 8 --tokens 4")
cli_expect_output(run.node_limited_gate "group-limited: 8 groups of 32 experts.*PASS"
                  "${_mpi} -n 2 --oversubscribe ${_exe} run --preset deepseek-v3 --routing gate --n-group 8 --topk-group 2 --hidden 64 --ffn 8 --tokens 8"
                  PROCESSORS 2)
cli_expect_error(plan_groups_misfit "moe-ep plan: --n-group 3: n_group 3 does not divide E = 256 experts"
                 "${_exe} plan --n-group 3 --ranks 64 --ranks-per-node 8")
# Ranks given other options (each would compute other data, or take other steps) are named at
# once, on every rank.
cli_expect_error(options_differ
                 "moe-ep: rank\\(s\\) 1 were given another command line than rank 0; every rank must be given the same options"
                 "${_mpi} -n 1 ${_exe} run --tokens 8 --seed 1 : -n 1 ${_exe} run --tokens 8 --seed 2")
cli_expect_error(plan_link_nan "--link-gbit: must be a finite number of Gbit/s > 0, got nan"
                 "${_exe} plan --link-gbit nan --ranks 4 --ranks-per-node 2")
cli_expect_error(plan_link_zero "--link-gbit: must be a finite number of Gbit/s > 0, got 0"
                 "${_exe} plan --link-gbit 0")
cli_expect_usage_error(plan_uneven_nodes "moe-ep plan: --ranks 10 is not a multiple of --ranks-per-node 4"
                       "plan --ranks 10 --ranks-per-node 4")

# Faults (issue 23): a rank that exits early, calls an extra op, is SIGSTOPped or SIGKILLed
# (mpirun --enable-recovery) under moe-ep bench with --timeout 5: every survivor names it within
# the deadline + 1 s and every process exits within the deadline + 5 s. Alone: the bounds are
# times (the Python cases: python/tests/test_faults.py).
add_test(NAME faults.cli
         COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tests/faults/faults.py cli ${_exe})
set_tests_properties(faults.cli PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 300
                                           RUN_SERIAL TRUE)

# Label `paths` (with the tool's unit tests above and a few in tests/CMakeLists.txt): some tests
# of each kind that prints a path or passes one on; scripts/path-test.sh (.ci/run) runs them from
# a checkout at a long path with spaces in it. The run report names the routing file beside the
# tool (cli.report.*, cli.run.*, cli.installed); command strings (cli_command) of each helper and
# of the tests that call the scripts directly; the cmake -P scripts and the Python checkers.
set_property(TEST cli.report.warm_progress_on cli.report.cold_only_progress_off
             cli.report.swiglu_tolerance cli.report.everything_scale cli.run.olmoe_real.np1
             cli.installed cli.roundtrip.mixtral_scale_fp16 cli.error.routing_negative_count
             cli.error.routing_file_directory cli.error.load_bad_seed
             cli.error.agreed_error_finalizes cli.error.save_output_is_input
             cli.usage.missing_value cli.help_once cli.version cli.load.seed_header
             cli.plan_deepseek cli.plan.matches_measured_bytes cli.bench.compare
             cli.bench.compare_nodes
             APPEND PROPERTY LABELS paths)
