// moe-ep tool: the command line. parse_command_line() reads argv into the options of `run`,
// `bench` or `plan`, with every check a flag can have alone or with the others (CLI11's,
// checks.h's, the combinations below). It neither throws nor prints: main prints what it returns
// (the help, the version, or the error as "moe-ep: error: InvalidArgument: <message>") and exits
// with 0 or 2.
#pragma once

#include <string>
#include <vector>

#include "bench.h"
#include "plan.h"
#include "run.h"

namespace moe_ep_tool {

struct CommandLine {
  enum class Action { kRun, kBench, kPlan, kPrint, kError };
  Action action = Action::kError;
  RunOptions run;
  BenchOptions bench;
  PlanOptions plan;
  // kPrint: what to print on stdout (--help, --version); kError: what is wrong, one line, e.g.
  // "moe-ep run: unknown option --token; did you mean --tokens? (moe-ep run --help lists them)".
  std::string text;
};

CommandLine parse_command_line(int argc, const char* const* argv);

// The name in `known` closest to `word` (both with their dashes): a unique name that `word`
// begins, else the nearest by edit distance (insertions, deletions, substitutions and swaps of
// neighbours) when at most 1, or 2 for words of 6 or more letters; "" when none is that close.
std::string closest_name(const std::string& word, const std::vector<std::string>& known);

}  // namespace moe_ep_tool
