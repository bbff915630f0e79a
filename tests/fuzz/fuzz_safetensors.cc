// libFuzzer target: the tool's routing-file reader (moe-ep --load-routing) on arbitrary bytes:
// parse_safetensors (the header, dtypes, shapes, offsets; read_safetensors minus the file checks,
// which tests/cli covers), then routing_from_file (load_routing's checks of the tensors). A
// moe_ep::Error is the expected answer to a malformed file; anything else aborts: another
// exception, a crash, a sanitizer report, or a parsed tensor whose bytes disagree with its shape.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "batch.h"
#include "fuzz_common.h"
#include "moe_ep/error.h"
#include "safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moe_ep_tool;
  moe_ep_fuzz::expect_error_or_success([&] {
    const StFile f = parse_safetensors("fuzz", data, size);
    for (const auto& [name, t] : f.tensors) {
      if (t.data.size() != static_cast<std::size_t>(t.numel()) * moe_ep::dtype_size(t.dtype))
        moe_ep_fuzz::finding("tensor '%s' holds %zu bytes, not numel x dtype size", name.c_str(),
                             t.data.size());
    }
    const Batch b = routing_from_file("fuzz", f);
    if (b.x.size() != static_cast<std::size_t>(b.tokens * b.hidden) * moe_ep::dtype_size(b.dtype) ||
        b.expert_ids.size() != static_cast<std::size_t>(b.tokens * b.top_k) ||
        b.expert_scales.size() != b.expert_ids.size())
      moe_ep_fuzz::finding("routing_from_file: a batch whose sizes disagree with its shape");
  });
  return 0;
}
