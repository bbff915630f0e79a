#include "batch.h"

#include <charconv>
#include <cmath>
#include <cstring>
#include <numeric>

#include "checks.h"
#include "moe_ep/error.h"
#include "moe_ep/tensor.h"
#include "safetensors.h"

namespace moe_ep_tool {

using moe_ep::DType;
using moe_ep::Error;
using moe_ep::ErrorKind;

namespace {

template <typename T>
StTensor make_tensor(DType dtype, std::vector<int64_t> shape, const std::vector<T>& values) {
  StTensor t;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data.resize(values.size() * sizeof(T));
  if (!values.empty()) std::memcpy(t.data.data(), values.data(), t.data.size());
  return t;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

const StTensor& need(const StFile& f, const std::string& path, const std::string& name,
                     std::initializer_list<DType> dtypes, size_t ndim) {
  auto it = f.tensors.find(name);
  if (it == f.tensors.end()) {
    throw Error(ErrorKind::kInvalidArgument,
                "routing file '" + path + "': no tensor '" + name + "'");
  }
  const StTensor& t = it->second;
  bool ok = false;
  for (DType d : dtypes) ok = ok || t.dtype == d;
  if (!ok || t.shape.size() != ndim) {
    throw Error(ErrorKind::kInvalidArgument,
                "routing file '" + path + "': tensor '" + name + "' is " +
                    safetensors_dtype_name(t.dtype) + " " + shape_str(t.shape) + ", expected " +
                    std::to_string(ndim) + "-D " + safetensors_dtype_name(*dtypes.begin()));
  }
  return t;
}

template <typename T>
std::vector<T> values(const StTensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data.data(), t.data.size());
  return v;
}

// The first NaN or infinity of a (rows, cols) tensor, named with its index.
void check_finite(const std::string& path, const std::string& name, DType dtype, const void* data,
                  int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows * cols; ++i) {
    const float v = moe_ep::load_float(dtype, data, i);
    if (!std::isfinite(v)) {
      throw Error(ErrorKind::kInvalidArgument,
                  "routing file '" + path + "': " + name + "[" + std::to_string(i / cols) + "," +
                      std::to_string(i % cols) + "] = " + format_value(v) + " is not finite");
    }
  }
}

}  // namespace

void save_routing(const std::string& path, const Batch& b) {
  StFile f;
  f.tensors["expert_ids"] = make_tensor(DType::kI32, {b.tokens, b.top_k}, b.expert_ids);
  f.tensors["expert_scales"] = make_tensor(DType::kF32, {b.tokens, b.top_k}, b.expert_scales);
  f.tensors["x"] = make_tensor(b.dtype, {b.tokens, b.hidden}, b.x);
  if (!b.tokens_per_rank.empty()) {
    f.tensors["tokens_per_rank"] = make_tensor(
        DType::kI64, {static_cast<int64_t>(b.tokens_per_rank.size())}, b.tokens_per_rank);
  }
  if (b.mask_dims > 0) {
    std::vector<int64_t> shape{b.tokens};
    if (b.mask_dims == 2) shape.push_back(b.top_k);
    f.tensors["x_active_mask"] = make_tensor(DType::kBool, std::move(shape), b.x_active_mask);
  }
  f.metadata = b.metadata;
  write_safetensors(path, f);
}

Batch load_routing(const std::string& path) {
  return routing_from_file(path, read_safetensors(path));
}

Batch routing_from_file(const std::string& path, const StFile& f) {
  const StTensor& ids = need(f, path, "expert_ids", {DType::kI32}, 2);
  const StTensor& scales = need(f, path, "expert_scales", {DType::kF32}, 2);
  const StTensor& x = need(f, path, "x", {DType::kBF16, DType::kF16, DType::kF32}, 2);
  Batch b;
  b.tokens = x.shape[0];
  b.hidden = x.shape[1];
  b.top_k = ids.shape[1];
  b.dtype = x.dtype;
  if (ids.shape[0] != b.tokens || scales.shape != ids.shape) {
    throw Error(ErrorKind::kInvalidArgument,
                "routing file '" + path + "': expert_ids " + shape_str(ids.shape) +
                    ", expert_scales " + shape_str(scales.shape) + " and x " + shape_str(x.shape) +
                    " disagree on the number of tokens or top-k");
  }
  check_finite(path, "x", b.dtype, x.data.data(), b.tokens, b.hidden);
  check_finite(path, "expert_scales", DType::kF32, scales.data.data(), b.tokens, b.top_k);
  b.x = x.data;
  b.expert_ids = values<int32_t>(ids);
  b.expert_scales = values<float>(scales);
  if (f.tensors.count("tokens_per_rank")) {
    const StTensor& tpr = need(f, path, "tokens_per_rank", {DType::kI64}, 1);
    b.tokens_per_rank = values<int64_t>(tpr);
    int64_t sum = 0;
    for (int64_t n : b.tokens_per_rank) {
      if (n < 0) {
        throw Error(ErrorKind::kInvalidArgument, "routing file '" + path +
                                                     "': tokens_per_rank has a negative entry " +
                                                     std::to_string(n));
      }
      if (n > b.tokens - sum) {  // also keeps the sum from overflowing (found by tests/fuzz)
        throw Error(ErrorKind::kInvalidArgument, "routing file '" + path +
                                                     "': tokens_per_rank sums to more than the " +
                                                     std::to_string(b.tokens) + " tokens of x");
      }
      sum += n;
    }
    if (sum != b.tokens) {
      throw Error(ErrorKind::kInvalidArgument,
                  "routing file '" + path + "': tokens_per_rank sums to " + std::to_string(sum) +
                      ", x has " + std::to_string(b.tokens) + " tokens");
    }
  }
  if (auto it = f.tensors.find("x_active_mask"); it != f.tensors.end()) {
    const StTensor& m = it->second;
    const bool shape_ok = (m.shape.size() == 1 && m.shape[0] == b.tokens) ||
                          (m.shape.size() == 2 && m.shape[0] == b.tokens && m.shape[1] == b.top_k);
    if (m.dtype != DType::kBool || !shape_ok) {
      throw Error(ErrorKind::kInvalidArgument,
                  "routing file '" + path + "': tensor 'x_active_mask' is " +
                      safetensors_dtype_name(m.dtype) + " " + shape_str(m.shape) +
                      ", expected BOOL [" + std::to_string(b.tokens) + "] or [" +
                      std::to_string(b.tokens) + ", " + std::to_string(b.top_k) + "]");
    }
    b.mask_dims = static_cast<int>(m.shape.size());
    b.x_active_mask = values<uint8_t>(m);
    for (size_t i = 0; i < b.x_active_mask.size(); ++i) {
      if (b.x_active_mask[i] > 1) {
        throw Error(ErrorKind::kInvalidArgument,
                    "routing file '" + path + "': x_active_mask element " + std::to_string(i) +
                        " = " + std::to_string(b.x_active_mask[i]) + " is not a bool (0 or 1)");
      }
    }
  }
  b.metadata = f.metadata;
  if (auto it = b.metadata.find("seed"); it != b.metadata.end()) {
    const std::string& text = it->second;
    uint64_t seed = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), seed);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size()) {
      throw Error(ErrorKind::kInvalidArgument, "routing file '" + path + "': metadata seed = '" +
                                                   text + "' is not an unsigned integer");
    }
    b.seed = seed;
  }
  return b;
}

void save_output(const std::string& path, const std::vector<std::byte>& output, int64_t tokens,
                 int64_t hidden, DType dtype) {
  StFile f;
  StTensor t;
  t.dtype = dtype;
  t.shape = {tokens, hidden};
  t.data = output;
  f.tensors["output"] = std::move(t);
  write_safetensors(path, f);
}

std::vector<int64_t> split_tokens(int64_t tokens, const std::vector<int64_t>& tokens_per_rank,
                                  int64_t world) {
  if (static_cast<int64_t>(tokens_per_rank.size()) == world &&
      std::accumulate(tokens_per_rank.begin(), tokens_per_rank.end(), int64_t{0}) == tokens) {
    return tokens_per_rank;
  }
  std::vector<int64_t> split(world, tokens / world);
  for (int64_t r = 0; r < tokens % world; ++r) ++split[r];
  return split;
}

}  // namespace moe_ep_tool
