#include "common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "moe_ep/threads.h"

namespace moe_ep_tool {

namespace {

// whole()'s mark for a space inside a path (ASCII unit separator: no report text holds it).
constexpr char kPathSpace = '\x1f';

// Columns of a UTF-8 string: its code points (continuation bytes 10xxxxxx do not count).
std::size_t columns(const std::string& s, std::size_t begin, std::size_t end) {
  std::size_t n = 0;
  for (std::size_t i = begin; i < end; ++i) n += (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80;
  return n;
}

// How good a break at the space s[i] is: 3 between fields (a run of spaces), 2 after ';', 1 after
// ',' or before '(', 0 elsewhere.
int break_rank(const std::string& s, std::size_t i) {
  const char before = i > 0 ? s[i - 1] : ' ', after = i + 1 < s.size() ? s[i + 1] : ' ';
  if (before == ' ' || after == ' ') return 3;
  if (before == ';') return 2;
  return before == ',' || after == '(' ? 1 : 0;
}

// Where to break the line s[begin, ...) of at most `avail` columns: the index of a space, or
// npos when the rest fits (or has no space at all). The best-ranked break in the last third of
// the line, the last of equals; else the last space that fits.
std::size_t break_at(const std::string& s, std::size_t begin, std::size_t avail) {
  if (columns(s, begin, s.size()) <= avail) return std::string::npos;
  std::size_t last = std::string::npos, best = std::string::npos;
  int best_rank = -1;
  // Leading spaces (an indented line) are no place to break.
  const std::size_t text = s.find_first_not_of(' ', begin);
  for (std::size_t i = text; i < s.size(); ++i) {
    if (s[i] != ' ') continue;
    const std::size_t used = columns(s, begin, i);
    if (used > avail) break;
    last = i;
    if (used * 3 >= avail * 2 && break_rank(s, i) >= best_rank) {
      best = i;
      best_rank = break_rank(s, i);
    }
  }
  if (best != std::string::npos) return best;
  if (last != std::string::npos) return last;
  return s.find(' ', text);  // a word longer than the line: it stands alone
}

std::string wrap_paragraph(const std::string& s, std::size_t indent, std::size_t width) {
  std::string out;
  std::size_t begin = 0;
  for (bool first = true;; first = false) {
    const std::size_t pad = first ? 0 : indent;
    const std::size_t avail = width > pad + 20 ? width - pad : 20;
    const std::size_t at = break_at(s, begin, avail);
    std::size_t end = at == std::string::npos ? s.size() : at;
    while (end > begin && s[end - 1] == ' ') --end;
    if (!first) out += '\n' + std::string(indent, ' ');
    out.append(s, begin, end - begin);
    if (at == std::string::npos) return out;
    begin = s.find_first_not_of(' ', at);
    if (begin == std::string::npos) return out;
  }
}

}  // namespace

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string fmt(const char* format, double value) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, value);
  return buf;
}

std::string ranks_words(int64_t n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

std::string join_ints(const std::vector<int64_t>& values) {
  std::string s;
  for (std::size_t i = 0; i < values.size(); ++i) {
    s += (i == 0 ? "" : ", ") + std::to_string(values[i]);
  }
  return s;
}

std::string wrap(const std::string& text, std::size_t indent, std::size_t width) {
  std::string out;
  std::size_t from = 0;
  for (;;) {
    const std::size_t nl = text.find('\n', from);
    out +=
        wrap_paragraph(text.substr(from, nl == std::string::npos ? nl : nl - from), indent, width);
    if (nl == std::string::npos) return unmarked(std::move(out));
    out += '\n';
    from = nl + 1;
  }
}

std::string wrap_fields(const std::vector<std::string>& fields, std::size_t indent,
                        std::size_t width) {
  std::string out, line;
  for (const std::string& field : fields) {
    if (field.empty()) continue;
    const std::string pad(indent, ' ');
    if (line.empty()) {
      line = field;
    } else if (columns(line, 0, line.size()) + 2 + columns(field, 0, field.size()) <= width) {
      line += "  " + field;
    } else {
      out += wrap(line, indent, width) + '\n';
      line = pad + field;
    }
  }
  return out + wrap(line, indent, width);
}

void print_wrapped(const std::string& text, std::size_t indent) {
  std::printf("%s\n", wrap(text, indent).c_str());
}

std::string whole(const std::string& path) {
  std::string marked = path;
  std::replace(marked.begin(), marked.end(), ' ', kPathSpace);
  return marked;
}

std::string unmarked(std::string text) {
  std::replace(text.begin(), text.end(), kPathSpace, ' ');
  return text;
}

moe_ep::CombineInputs combine_inputs(const moe_ep::DispatchInputs& in,
                                     const moe_ep::DispatchOutputs& out,
                                     const moe_ep::TensorView& expand_x, bool tp) {
  moe_ep::CombineInputs cin;
  cin.expand_x = expand_x;
  cin.expert_ids = in.expert_ids;
  cin.assist_info_for_combine = out.assist_info_for_combine;
  cin.ep_send_counts = out.ep_recv_counts;
  cin.expert_scales = *in.expert_scales;
  if (tp) cin.tp_send_counts = out.tp_recv_counts;
  cin.x_active_mask = in.x_active_mask;
  return cin;
}

void print_threads_line() {
  print_wrapped("  threads: " + std::to_string(moe_ep::num_threads()) +
                    " per rank in moe-ep's parallel loops (by default each rank's share of its "
                    "machine's CPUs; OMP_NUM_THREADS chooses)",
                4);
}

}  // namespace moe_ep_tool
