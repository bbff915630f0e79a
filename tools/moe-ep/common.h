// moe-ep tool: small helpers `run` and `bench` share: the clock, number formatting, lists in
// words, the report's line wrapping (every report line fits kReportColumns), and combine_v2's
// inputs from a dispatch_v2 call.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe_ep/dispatch.h"

namespace moe_ep_tool {

// The widest line the reports print (a path or a word longer than it stands alone on its line).
constexpr std::size_t kReportColumns = 100;

// Seconds on the steady clock.
double now_s();

// printf of one double: fmt("%.3f", x).
std::string fmt(const char* format, double value);

// "1 rank", "3 ranks"
std::string ranks_words(int64_t n);

// "4, 4, 3, 3"
std::string join_ints(const std::vector<int64_t>& values);

// `text` broken into lines of at most `width` columns (UTF-8 characters), at spaces; lines after
// the first start with `indent` spaces. In the last third of a line a break prefers, in this
// order, a run of spaces (between fields), "; ", ", " or " (", the last of equals; spaces at a
// break are dropped. Each '\n' of `text` starts a new paragraph. No final newline.
std::string wrap(const std::string& text, std::size_t indent = 2,
                 std::size_t width = kReportColumns);

// The non-empty fields joined by two spaces, a new line (of `indent` spaces first) before a field
// that would overflow `width`; a field too long for a line is wrap()ped.
std::string wrap_fields(const std::vector<std::string>& fields, std::size_t indent = 2,
                        std::size_t width = kReportColumns);

// Prints wrap(text, indent) and a newline on stdout.
void print_wrapped(const std::string& text, std::size_t indent = 2);

// `path` as one word for wrap(): its spaces are marked so that no line breaks inside it, and
// wrap() turns the marks back into spaces. A file's path so prints whole, on a line of its own
// when it does not fit after the text before it (longer than the line, it is the one kind of
// line wider than kReportColumns), so it can be copied from the report whatever the checkout's
// path.
std::string whole(const std::string& path);

// `text` with whole()'s marks turned back into spaces: for text that is saved, not wrap()ped.
std::string unmarked(std::string text);

// combine_v2's inputs that a dispatch_v2 call fixes: its expert_ids, expert_scales and
// x_active_mask, the assist_info_for_combine and ep_recv_counts it returned (and with `tp`, its
// tp_recv_counts), with `expand_x`: the experts' outputs in dispatch's layout.
moe_ep::CombineInputs combine_inputs(const moe_ep::DispatchInputs& in,
                                     const moe_ep::DispatchOutputs& out,
                                     const moe_ep::TensorView& expand_x, bool tp = false);

// Prints "  threads: N per rank ..." (moe_ep::num_threads() of this rank, and where it comes
// from) for the header of run and bench; call after the job's Communicators exist.
void print_threads_line();

}  // namespace moe_ep_tool
