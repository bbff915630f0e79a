#include "safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "moe_ep/error.h"

namespace moe_ep_tool {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const char* safetensors_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kBool:
      return "BOOL";
    default:
      throw Error(ErrorKind::kInternal,
                  std::string("safetensors: no dtype name for ") + moe_ep::dtype_name(dtype));
  }
}

namespace {

bool parse_dtype(const std::string& name, DType* dtype) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI32, DType::kI64, DType::kBool}) {
    if (name == safetensors_dtype_name(d)) {
      *dtype = d;
      return true;
    }
  }
  return false;
}

[[noreturn]] void malformed(const std::string& path, const std::string& what) {
  throw Error(ErrorKind::kInvalidArgument, "safetensors file '" + path + "': " + what);
}

// The deepest nesting of JSON arrays and objects a header may have. A safetensors header needs 3
// (the header, a tensor's entry, its shape); a crafted one nested thousands deep crashed the
// parser (SIGSEGV), so the depth is counted before parsing.
constexpr int kMaxHeaderDepth = 64;

void check_header_depth(const std::string& path, const std::string& text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxHeaderDepth)
        malformed(path, "header nests JSON arrays and objects more than " +
                            std::to_string(kMaxHeaderDepth) +
                            " deep (a safetensors header needs 3)");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
}

// Only a regular file is read: opening a FIFO would block until a writer comes (forever), and a
// directory or a device is no safetensors file.
void check_regular_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || st.type() == fs::file_type::not_found)
    throw Error(ErrorKind::kSystem, "cannot open '" + path + "' for reading: " +
                                        (ec ? ec.message() : std::string("no such file")));
  if (st.type() == fs::file_type::regular) return;
  const char* kind = st.type() == fs::file_type::directory   ? "a directory"
                     : st.type() == fs::file_type::fifo      ? "a FIFO"
                     : st.type() == fs::file_type::socket    ? "a socket"
                     : st.type() == fs::file_type::block     ? "a block device"
                     : st.type() == fs::file_type::character ? "a character device"
                                                             : "not a plain file";
  throw Error(ErrorKind::kInvalidArgument,
              "safetensors file '" + path + "': is " + kind + ", not a regular file");
}

}  // namespace

void write_safetensors(const std::string& path, const StFile& file) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    const uint64_t expected = static_cast<uint64_t>(t.numel()) * moe_ep::dtype_size(t.dtype);
    if (t.data.size() != expected) {
      throw Error(ErrorKind::kInternal, "safetensors: tensor '" + name + "' holds " +
                                            std::to_string(t.data.size()) +
                                            " bytes, its shape needs " + std::to_string(expected));
    }
    header[name] = {{"dtype", safetensors_dtype_name(t.dtype)},
                    {"shape", t.shape},
                    {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const uint64_t n = text.size();

  // stdio, not a stream: the failing call's errno names the cause (a full device, a file that
  // takes no data), and it is read right after that call.
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr) {
    throw Error(ErrorKind::kSystem,
                "cannot open '" + path + "' for writing: " + std::strerror(errno));
  }
  int failed = 0;  // the errno of the first failed call (EIO when it set none), or 0
  auto failure = [] { return errno != 0 ? errno : EIO; };
  auto put = [&](const void* data, std::size_t bytes) {
    errno = 0;
    if (failed == 0 && bytes > 0 && std::fwrite(data, 1, bytes, out) != bytes) failed = failure();
  };
  put(&n, 8);
  put(text.data(), text.size());
  for (const auto& [name, t] : file.tensors) put(t.data.data(), t.data.size());
  errno = 0;
  if (std::fclose(out) != 0 && failed == 0) failed = failure();  // the buffer's last flush
  if (failed != 0) {
    throw Error(ErrorKind::kSystem, "writing '" + path + "' failed: " + std::strerror(failed));
  }
}

StFile read_safetensors(const std::string& path) {
  check_regular_file(path);
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw Error(ErrorKind::kSystem, "cannot open '" + path + "' for reading");
  const auto file_size = static_cast<std::size_t>(in.tellg());
  in.seekg(0);
  std::vector<char> bytes(file_size);
  if (!in.read(bytes.data(), static_cast<std::streamsize>(file_size))) {
    throw Error(ErrorKind::kSystem, "reading '" + path + "' failed");
  }
  return parse_safetensors(path, bytes.data(), bytes.size());
}

StFile parse_safetensors(const std::string& path, const void* bytes, std::size_t size) {
  const auto* p = static_cast<const char*>(bytes);
  const uint64_t file_size = size;
  uint64_t n = 0;
  if (file_size < 8) malformed(path, "shorter than the 8-byte header length");
  std::memcpy(&n, p, 8);
  if (n > file_size - 8) {
    malformed(path, "header length " + std::to_string(n) + " exceeds the file size " +
                        std::to_string(file_size));
  }
  const std::string text(p + 8, n);
  const uint64_t data_size = file_size - 8 - n;
  const auto* data_begin = reinterpret_cast<const std::byte*>(p + 8 + n);

  check_header_depth(path, text);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    malformed(path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) malformed(path, "header is not a JSON object");

  StFile file;
  struct Span {
    uint64_t begin, end;
    std::string name;
  };
  std::vector<Span> spans;  // the non-empty tensors' data
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) malformed(path, "__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) malformed(path, "__metadata__['" + key + "'] is not a string");
        file.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + name + "': ";
    if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
        !entry.contains("data_offsets")) {
      malformed(path, where + "needs dtype, shape and data_offsets");
    }
    StTensor t;
    if (!entry["dtype"].is_string() || !parse_dtype(entry["dtype"].get<std::string>(), &t.dtype)) {
      malformed(path, where + "dtype " + entry["dtype"].dump() +
                          " is not one of {BF16, F16, F32, I32, I64, BOOL}");
    }
    const auto& shape = entry["shape"];
    const auto& offsets = entry["data_offsets"];
    if (!shape.is_array() || shape.size() > 8) malformed(path, where + "bad shape");
    for (const auto& d : shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        malformed(path, where + "shape " + shape.dump() + " has a non-integer or negative size");
      }
      t.shape.push_back(d.get<int64_t>());
    }
    // The shape's bytes (compared with data_offsets below), checked for overflow first.
    const bool empty = std::find(t.shape.begin(), t.shape.end(), 0) != t.shape.end();
    uint64_t bytes = empty ? 0 : moe_ep::dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) {
        malformed(path, where + "shape " + shape.dump() + " is too large (its size in bytes " +
                            "overflows 64 bits)");
      }
    }
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned()) {
      malformed(path, where + "data_offsets " + offsets.dump() + " is not [begin, end]");
    }
    const uint64_t begin = offsets[0].get<uint64_t>();
    const uint64_t end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      malformed(path, where + "data_offsets " + offsets.dump() + " outside the " +
                          std::to_string(data_size) + " data bytes" +
                          (begin <= end ? " (a truncated file?)" : ""));
    }
    if (end - begin != bytes) {
      malformed(path, where + "holds " + std::to_string(end - begin) + " bytes, shape " +
                          shape.dump() + " needs " + std::to_string(bytes));
    }
    t.data.assign(data_begin + begin, data_begin + end);
    file.tensors.emplace(name, std::move(t));
    if (begin < end) spans.push_back({begin, end, name});
  }
  // Each byte belongs to at most one tensor.
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (std::size_t i = 1; i < spans.size(); ++i) {
    const Span &a = spans[i - 1], &b = spans[i];
    if (b.begin < a.end) {
      malformed(path, "tensor '" + b.name + "': data_offsets [" + std::to_string(b.begin) + "," +
                          std::to_string(b.end) + "] overlap tensor '" + a.name + "' at [" +
                          std::to_string(a.begin) + "," + std::to_string(a.end) + "]");
    }
  }
  return file;
}

}  // namespace moe_ep_tool
