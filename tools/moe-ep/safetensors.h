// moe-ep tool: a small reader/writer of the safetensors format
// (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N, N bytes
// of JSON {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "value"}}, then the raw little-endian tensor bytes (offsets relative to
// the end of the header). Supported dtypes: I32, I64, F32, BF16, F16, BOOL (one byte, 0 or 1).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "moe_ep/tensor.h"

namespace moe_ep_tool {

struct StTensor {
  moe_ep::DType dtype = moe_ep::DType::kF32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;  // numel * dtype_size bytes, row-major, little-endian

  int64_t numel() const;
  template <typename T>
  const T* as() const {
    return reinterpret_cast<const T*>(data.data());
  }
};

struct StFile {
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Throws moe_ep::Error(kSystem) when the file cannot be written.
void write_safetensors(const std::string& path, const StFile& file);
// Throws moe_ep::Error(kInvalidArgument) naming the file and the problem when it is not a
// well-formed safetensors file of supported dtypes, kSystem when it cannot be read.
StFile read_safetensors(const std::string& path);
// The same checks on a file's bytes already in memory (`size` bytes at `bytes`); `path` names
// the file in messages. read_safetensors is check_regular_file + read + this (the fuzz target
// tests/fuzz/fuzz_safetensors.cc calls it directly).
StFile parse_safetensors(const std::string& path, const void* bytes, std::size_t size);

// "BF16", "F16", "F32", "I32", "I64", "BOOL".
const char* safetensors_dtype_name(moe_ep::DType dtype);

}  // namespace moe_ep_tool
