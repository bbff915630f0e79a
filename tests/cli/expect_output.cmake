# Runs CMD (one string, split as a shell would: cli.cmake's cli_command quotes its paths) and
# passes when it exits with EXIT (default 0) within TIMEOUT seconds and its stdout matches REGEX;
# with NOT_REGEX set, stdout and stderr must not match it; with ONCE set, REGEX must match exactly
# once in stdout. Unlike a test's PASS_REGULAR_EXPRESSION (a list: CMake splits it at each ';' and
# passes on any piece, and the exit status is ignored), the whole regex applies, ';' included.
separate_arguments(cmd UNIX_COMMAND "${CMD}")
if(NOT TIMEOUT)
  set(TIMEOUT 120)
endif()
if(NOT DEFINED EXIT)
  set(EXIT 0)
endif()
execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err
                TIMEOUT ${TIMEOUT})
message(STATUS "exit '${rc}'\nstdout:\n${out}\nstderr:\n${err}")
if(NOT rc STREQUAL "${EXIT}")
  message(FATAL_ERROR "expected exit status ${EXIT}, got '${rc}'")
endif()
if(NOT out MATCHES "${REGEX}")
  message(FATAL_ERROR "stdout does not match '${REGEX}'")
endif()
if(NOT_REGEX AND "${out}${err}" MATCHES "${NOT_REGEX}")
  message(FATAL_ERROR "the output matches '${NOT_REGEX}'")
endif()
if(ONCE)
  string(REGEX MATCHALL "${REGEX}" hits "${out}")
  list(LENGTH hits n)
  if(NOT n EQUAL 1)
    message(FATAL_ERROR "expected '${REGEX}' once in stdout, found it ${n} times")
  endif()
endif()
