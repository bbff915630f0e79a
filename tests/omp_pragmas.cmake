# Every OpenMP parallel region of the library sizes its team with num_threads(...) from
# detail::threads_if / op_threads (moe_ep/threads.h), never OpenMP's default: that default starts
# one thread per CPU in every rank and oversubscribes a machine the ranks share. Run as
#   cmake -DSOURCE_DIR=<repo> -P tests/omp_pragmas.cmake
file(GLOB_RECURSE sources "${SOURCE_DIR}/src/*.cc" "${SOURCE_DIR}/src/*.h"
     "${SOURCE_DIR}/tools/*.cc" "${SOURCE_DIR}/python/src/*.cc")
set(bad "")
set(count 0)
foreach(f IN LISTS sources)
  # A pragma continued over several lines (clang-format breaks long ones) is read as one line.
  file(READ "${f}" text)
  string(REGEX REPLACE "\\\\\n" " " text "${text}")
  string(REGEX MATCHALL "\n[ \t]*#[ \t]*pragma[ \t]+omp[ \t]+parallel[^\n]*" lines "${text}")
  foreach(line IN LISTS lines)
    string(STRIP "${line}" line)
    math(EXPR count "${count} + 1")
    if(NOT line MATCHES "num_threads\\(")
      string(APPEND bad "\n  ${f}: ${line}")
    endif()
  endforeach()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "no '#pragma omp parallel' found under ${SOURCE_DIR}/src: wrong SOURCE_DIR?")
endif()
if(NOT bad STREQUAL "")
  message(FATAL_ERROR "OpenMP parallel regions without num_threads(...) (use detail::threads_if):${bad}")
endif()
message(STATUS "${count} OpenMP parallel regions, all sized by num_threads(...)")
