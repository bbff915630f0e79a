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
                           MOE_EP_TEST_ROUTING_CSV="${MOE_EP_ROUTING_CSV}")
gtest_discover_tests(moe_ep_cli_tests TEST_PREFIX cli. DISCOVERY_MODE PRE_TEST
                     PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 120)

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
function(cli_roundtrip name save_np load_nps experts args)
  add_test(NAME cli.roundtrip.${name}
           COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${_mpi} -DEXE=${_exe} -DWORK=${_work}/${name}
                   "-DARGS=${args}" -DSAVE_NP=${save_np} "-DLOAD_NPS=${load_nps}"
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

# Bad expert_ids reach dispatch_v2 unvalidated by the tool; it must fail fast on every rank with
# its message naming expert_ids, the value and the bound.
add_test(NAME cli.bad_ids.setup
         COMMAND ${CMAKE_COMMAND} -DMPIEXEC=${_mpi} -DEXE=${_exe} -DWORK=${_work}/bad_ids
                 "-DARGS=--preset mixtral-8x7b --tokens 4 --expert-fn scale" -DEXPERTS=8
                 -DPYTHON=${Python3_EXECUTABLE} -DSTCHECK=${_cli}/stcheck.py
                 -P ${_cli}/make_bad_routing.cmake)
set_tests_properties(cli.bad_ids.setup PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 120
                                                  FIXTURES_SETUP cli_bad_ids)
function(cli_expect_error name regex cmd)
  add_test(NAME cli.error.${name}
           COMMAND ${CMAKE_COMMAND} "-DCMD=${cmd}" "-DREGEX=${regex}" -DTIMEOUT=45
                   -P ${_cli}/expect_error.cmake)
  set_tests_properties(cli.error.${name} PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 60
                                                    ${ARGN})
endfunction()
set(_run2 "${_mpi} -n 2 --oversubscribe ${_exe} run --preset mixtral-8x7b --expert-fn scale")
cli_expect_error(repeated_id "moe-ep: error: [A-Za-z]+: dispatch_v2: expert_ids\\[0,[^\n]*repeat"
                 "${_run2} --load-routing ${_work}/bad_ids/repeat.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(id_out_of_range "moe-ep: error: [A-Za-z]+: dispatch_v2: expert_ids\\[3,1\\][^\n]*11[^\n]*8"
                 "${_run2} --load-routing ${_work}/bad_ids/range.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
# A routing file of another shape is rejected before any communication.
cli_expect_error(load_wrong_preset "InvalidArgument: --load-routing.*H = 4096.*H = 2048"
                 "${_mpi} -n 2 --oversubscribe ${_exe} run --preset olmoe --load-routing ${_work}/bad_ids/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)
cli_expect_error(load_wrong_dtype "InvalidArgument: --load-routing.*bf16.*fp16"
                 "${_mpi} -n 1 ${_exe} run --preset mixtral-8x7b --dtype fp16 --load-routing ${_work}/bad_ids/good.safetensors"
                 FIXTURES_REQUIRED cli_bad_ids)

# Bad flags: CLI11 errors, non-zero exit.
cli_expect_error(negative_tokens "--tokens" "${_mpi} -n 2 ${_exe} run --tokens -3")
cli_expect_error(unknown_preset "--preset" "${_mpi} -n 1 ${_exe} run --preset gpt-5")
cli_expect_error(top_k_above_experts "K = 9 exceeds the number of experts E = 8"
                 "${_mpi} -n 1 ${_exe} run --preset mixtral-8x7b --top-k 9")
cli_expect_error(bad_dtype "--dtype" "${_mpi} -n 1 ${_exe} run --dtype int8")
cli_expect_error(no_subcommand "subcommand" "${_mpi} -n 1 ${_exe}")
cli_expect_error(experts_not_divisible "E = 8 experts cannot be split evenly over W = 3"
                 "${_mpi} -n 3 --oversubscribe ${_exe} run --preset mixtral-8x7b --tokens 2 --ffn 8")
cli_expect_error(missing_routing_file "InvalidArgument: real routing: cannot open '/nonexistent/x.csv'"
                 "${_mpi} -n 2 ${_exe} run --routing-file /nonexistent/x.csv")
cli_expect_error(unknown_domain "domain 'poetry' is not in .*\\(has arxiv, book, c4"
                 "${_mpi} -n 1 ${_exe} run --domain poetry")

# Installed, the tool finds its data relative to itself.
add_test(NAME cli.installed
         COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${PROJECT_BINARY_DIR} -DPREFIX=${_work}/prefix
                 -DMPIEXEC=${_mpi} -P ${_cli}/installed.cmake)
set_tests_properties(cli.installed PROPERTIES ENVIRONMENT "${MOE_EP_TEST_ENV}" TIMEOUT 300)
