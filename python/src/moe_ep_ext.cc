// moe_ep._C: the DLPack binding of the C++ library (nanobind). Framework-agnostic: tensors come in
// as any object with __dlpack__ (torch, numpy, ...) and go out as array-API objects (with
// __dlpack__) that torch.from_dlpack / numpy.from_dlpack take without a copy, as often as
// wanted. The GIL is released while an op runs; calls on one Communicator must not overlap.
// Not compiled against PyTorch; moe_ep/torch/ builds the torch ops on top of it.
#include <mpi.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "exit_guard.h"
#include "moe_ep/async.h"
#include "moe_ep/backward.h"
#include "moe_ep/comm.h"
#include "moe_ep/dispatch.h"
#include "moe_ep/error.h"
#include "moe_ep/permute.h"
#include "moe_ep/sharding.h"
#include "moe_ep/tensor.h"
#include "moe_ep/threads.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using moe_ep::DType;
using moe_ep::Tensor;
using moe_ep::TensorView;

// Inputs are read-only views (numpy's read-only arrays are accepted too); outputs are writable.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;
// Outputs: array_api objects (with __dlpack__ and __dlpack_device__), so torch.from_dlpack and
// numpy.from_dlpack both take them, each without a copy.
using ResultArray = nb::ndarray<nb::array_api>;
using OptIn = std::optional<InArray>;

template <typename Array>
TensorView view_of(const Array& a, const char* what) {
  DLTensor dl{};
  dl.data = const_cast<void*>(static_cast<const void*>(a.data()));
  dl.device = {static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  dl.ndim = static_cast<int32_t>(a.ndim());
  const auto dt = a.dtype();
  dl.dtype = {dt.code, dt.bits, dt.lanes};
  dl.shape = const_cast<int64_t*>(a.shape_ptr());
  dl.strides = const_cast<int64_t*>(a.stride_ptr());
  return moe_ep::from_dlpack(dl, what);
}

std::optional<TensorView> view_of(const OptIn& a, const char* what) {
  if (!a) return std::nullopt;
  return view_of(*a, what);
}

nb::dlpack::dtype dl_dtype(DType d) {
  switch (d) {
    case DType::kBF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case DType::kF16:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    case DType::kF32:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Float), 32, 1};
    case DType::kI8:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Int), 8, 1};
    case DType::kI32:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Int), 32, 1};
    case DType::kI64:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Int), 64, 1};
    case DType::kBool:
      return {static_cast<uint8_t>(nb::dlpack::dtype_code::Bool), 8, 1};
  }
  return {};
}

// Hands an owned Tensor to Python without a copy: the capsule keeps the storage alive until the
// last consumer (e.g. a torch tensor made by torch.from_dlpack) lets go. Undefined -> None.
nb::object to_python(Tensor t) {
  if (!t.defined()) return nb::none();
  auto* holder = new Tensor(std::move(t));
  nb::capsule owner(holder, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
  std::vector<size_t> shape(holder->ndim());
  for (int d = 0; d < holder->ndim(); ++d) shape[d] = static_cast<size_t>(holder->size(d));
  ResultArray array(holder->data(), shape.size(), shape.data(), owner, nullptr,
                    dl_dtype(holder->dtype()), nb::device::cpu::value);
  return nb::cast(array, nb::rv_policy::reference);
}

// A dtype by its C++ name (moe_ep::dtype_name): bf16, fp16 or fp32. any_dtype: every DType's
// name (int8, int32, ...), for an op that checks the dtype itself, so that a wrong one gets the
// op's own message.
DType parse_dtype(const std::string& name, const char* op, const char* param,
                  bool any_dtype = false) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32, DType::kI8, DType::kI32, DType::kI64,
                  DType::kBool}) {
    const bool is_float = d == DType::kBF16 || d == DType::kF16 || d == DType::kF32;
    if ((any_dtype || is_float) && name == moe_ep::dtype_name(d)) return d;
  }
  throw moe_ep::Error(
      moe_ep::ErrorKind::kInvalidArgument,
      std::string(op) + ": " + param + " = '" + name + "' is not one of 'bf16', 'fp16', 'fp32'");
}

// The Python face of moe_ep::Communicator: built from an MPI communicator's Fortran handle
// (mpi4py's comm.py2f()), so no MPI header of the caller's Python binding is needed.
struct PyCommunicator {
  std::shared_ptr<moe_ep::Communicator> comm;
  // Calls on one communicator must not overlap: with the GIL released, two threads running
  // collectives on the same communicator would pair each other's messages across ranks.
  std::shared_ptr<std::atomic<bool>> busy = std::make_shared<std::atomic<bool>>(false);
};

// Marks a communicator in use for the duration of one op; a second, overlapping call (another
// thread) raises instead of silently mixing messages.
class InUse {
 public:
  InUse(const PyCommunicator* c, const char* op, const char* param) {
    if (c == nullptr) return;
    if (c->busy->exchange(true)) {
      throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                          std::string(op) + ": " + param +
                              " is in use by another thread (calls on one communicator must not "
                              "overlap: use one communicator per thread)");
    }
    flag_ = c->busy;
  }
  ~InUse() {
    if (flag_) flag_->store(false);
  }
  InUse(const InUse&) = delete;
  InUse& operator=(const InUse&) = delete;

 private:
  std::shared_ptr<std::atomic<bool>> flag_;
};

PyCommunicator make_communicator(int64_t fortran_handle, std::optional<double> timeout_s,
                                 int64_t shm_window_bytes, bool shm_grow) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        "Communicator: MPI is not initialised (import mpi4py.MPI first, and "
                        "start the processes with mpirun)");
  }
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  if (c == MPI_COMM_NULL) {
    throw moe_ep::Error(
        moe_ep::ErrorKind::kInvalidArgument,
        "Communicator: the handle " + std::to_string(fortran_handle) + " is MPI_COMM_NULL");
  }
  moe_ep::CommOptions options;
  options.timeout_s = timeout_s;
  options.shm_window_bytes = shm_window_bytes;  // from_mpi rejects < 0 before MPI_Comm_dup
  options.shm_grow = shm_grow;
  nb::gil_scoped_release release;
  return PyCommunicator{moe_ep::Communicator::from_mpi(c, options)};
}

nb::object placement_to_python(const std::optional<moe_ep::Placement>& p) {
  if (!p) return nb::none();
  switch (p->kind) {
    case moe_ep::Placement::Kind::kReplicate:
      return nb::make_tuple("replicate", 0);
    case moe_ep::Placement::Kind::kShard:
      return nb::make_tuple("shard", p->dim);
    case moe_ep::Placement::Kind::kPartial:
      return nb::make_tuple("partial", 0);
  }
  return nb::none();
}

moe_ep::ShardedOp parse_op(const std::string& name) {
  using moe_ep::ShardedOp;
  for (ShardedOp op : {ShardedOp::kPermute, ShardedOp::kPermuteGrad, ShardedOp::kPermuteGradV2,
                       ShardedOp::kUnpermute, ShardedOp::kUnpermuteWithSaved,
                       ShardedOp::kUnpermuteGrad, ShardedOp::kUnpermuteGradV2}) {
    if (name == moe_ep::op_name(op)) return op;
  }
  throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                      "strategies: op = '" + name +
                          "' is not one of permute, permute_grad, permute_grad_v2, unpermute, "
                          "unpermute_with_saved, unpermute_grad, unpermute_grad_v2");
}

nb::list strategies(const std::string& op, bool has_probs, bool has_permuted_tokens) {
  const auto table = moe_ep::strategies(parse_op(op), has_probs, has_permuted_tokens);
  auto args = [](const std::vector<moe_ep::ArgPlacement>& v) {
    nb::list out;
    for (const auto& a : v) {
      out.append(nb::make_tuple(a.name, placement_to_python(a.placement), a.data_read));
    }
    return out;
  };
  nb::list result;
  for (const auto& s : table) {
    nb::dict d;
    d["name"] = s.name;
    d["inputs"] = args(s.inputs);
    d["outputs"] = args(s.outputs);
    result.append(d);
  }
  return result;
}

constexpr int kErrorKinds = static_cast<int>(moe_ep::ErrorKind::kInternal) + 1;
PyObject* g_errors[kErrorKinds] = {};

void register_errors(nb::module_& m) {
  // moe_ep.Error(RuntimeError) with one subclass per ErrorKind; the kinds that have a natural
  // Python counterpart also derive from it, so `except ValueError` works as users expect.
  PyObject* base = PyErr_NewExceptionWithDoc(
      "moe_ep._C.Error", "moe-ep error; .kind names the ErrorKind", PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::handle(base);
  struct Kind {
    moe_ep::ErrorKind kind;
    const char* name;
    PyObject* also;
  };
  const Kind kinds[] = {
      {moe_ep::ErrorKind::kInvalidArgument, "InvalidArgumentError", PyExc_ValueError},
      {moe_ep::ErrorKind::kUnsupported, "UnsupportedError", PyExc_NotImplementedError},
      {moe_ep::ErrorKind::kTimeout, "TimeoutError", PyExc_TimeoutError},
      {moe_ep::ErrorKind::kRemote, "RemoteError", nullptr},
      {moe_ep::ErrorKind::kSystem, "SystemError", nullptr},
      {moe_ep::ErrorKind::kInternal, "InternalError", nullptr},
  };
  static_assert(sizeof(kinds) / sizeof(kinds[0]) == kErrorKinds, "one class per ErrorKind");
  for (const Kind& k : kinds) {
    PyObject* bases = k.also ? PyTuple_Pack(2, base, k.also) : PyTuple_Pack(1, base);
    const std::string qualified = std::string("moe_ep._C.") + k.name;
    PyObject* dict = PyDict_New();
    PyObject* kind_name = PyUnicode_FromString(moe_ep::error_kind_name(k.kind));
    PyDict_SetItemString(dict, "kind", kind_name);  // also on errors raised from Python
    Py_DECREF(kind_name);
    PyObject* type = PyErr_NewException(qualified.c_str(), bases, dict);
    Py_DECREF(bases);
    Py_DECREF(dict);
    g_errors[static_cast<int>(k.kind)] = type;
    m.attr(k.name) = nb::handle(type);
  }
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const moe_ep::Error& e) {
      PyObject* type = g_errors[static_cast<int>(e.kind())];
      // A peer that stalled or died may leave MPI_Finalize waiting at exit (exit_guard.h). Not
      // kRemote: every peer answered the op's header agreement, so none is gone.
      if (e.kind() == moe_ep::ErrorKind::kTimeout || e.kind() == moe_ep::ErrorKind::kSystem)
        moe_ep_python::note_fault(moe_ep::error_kind_name(e.kind()), e.what());
      PyErr_SetString(type, e.what());
    }
  });
}

// Runs one op of the library: std::bad_alloc and std::length_error (an allocation, or a
// std::vector, sized past memory) become moe_ep errors naming the op, instead of Python's
// MemoryError / ValueError naming nothing.
template <class F>
auto guarded(const char* op, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    throw moe_ep::Error(moe_ep::ErrorKind::kSystem,
                        std::string(op) +
                            ": out of memory (std::bad_alloc): the arguments' sizes need more "
                            "memory than this process can allocate");
  } catch (const std::length_error& e) {
    throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                        std::string(op) + ": a size is too large to allocate (" + e.what() + ")");
  }
}

// ---- SPEC §4 ops --------------------------------------------------------------------------

nb::tuple token_permute(const InArray& tokens, const InArray& indices,
                        std::optional<int64_t> num_out_tokens, bool padded_mode) {
  moe_ep::PermuteArgs a;
  a.tokens = view_of(tokens, "tokens");
  a.indices = view_of(indices, "indices");
  a.num_out_tokens = num_out_tokens;
  a.padded_mode = padded_mode;
  moe_ep::PermuteResult r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_permute", [&] { return moe_ep::permute(a); });
  }
  return nb::make_tuple(to_python(std::move(r.permuted_tokens)),
                        to_python(std::move(r.sorted_indices)));
}

nb::object token_permute_grad(const InArray& tokens, const InArray& grad_permuted_tokens,
                              const InArray& indices, const InArray& sorted_indices,
                              bool padded_mode) {
  moe_ep::PermuteGradArgs a;
  a.tokens = view_of(tokens, "tokens");
  a.grad_permuted_tokens = view_of(grad_permuted_tokens, "grad_permuted_tokens");
  a.indices = view_of(indices, "indices");
  a.sorted_indices = view_of(sorted_indices, "sorted_indices");
  a.padded_mode = padded_mode;
  Tensor r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_permute_grad", [&] { return moe_ep::permute_grad(a); });
  }
  return to_python(std::move(r));
}

nb::object token_permute_grad_v2(const InArray& grad_permuted_tokens, const InArray& sorted_indices,
                                 int64_t tokens_rows, const std::string& tokens_dtype,
                                 int64_t num_topk, bool padded_mode) {
  moe_ep::PermuteGradV2Args a;
  a.grad_permuted_tokens = view_of(grad_permuted_tokens, "grad_permuted_tokens");
  a.sorted_indices = view_of(sorted_indices, "sorted_indices");
  a.tokens_rows = tokens_rows;
  a.tokens_dtype = parse_dtype(tokens_dtype, "permute_grad_v2", "tokens_dtype");
  a.num_topk = num_topk;
  a.padded_mode = padded_mode;
  Tensor r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_permute_grad_v2", [&] { return moe_ep::permute_grad_v2(a); });
  }
  return to_python(std::move(r));
}

moe_ep::UnpermuteArgs unpermute_args(const InArray& permuted_tokens, const InArray& sorted_indices,
                                     const OptIn& probs, bool padded_mode,
                                     const std::optional<std::vector<int64_t>>& restore_shape) {
  moe_ep::UnpermuteArgs a;
  a.permuted_tokens = view_of(permuted_tokens, "permuted_tokens");
  a.sorted_indices = view_of(sorted_indices, "sorted_indices");
  a.probs = view_of(probs, "probs");
  a.padded_mode = padded_mode;
  a.restore_shape = restore_shape;
  return a;
}

nb::object token_unpermute(const InArray& permuted_tokens, const InArray& sorted_indices,
                           const OptIn& probs, bool padded_mode,
                           const std::optional<std::vector<int64_t>>& restore_shape) {
  const auto a = unpermute_args(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape);
  Tensor r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_unpermute", [&] { return moe_ep::unpermute(a); });
  }
  return to_python(std::move(r));
}

nb::tuple token_unpermute_with_saved(const InArray& permuted_tokens, const InArray& sorted_indices,
                                     const OptIn& probs, bool padded_mode,
                                     const std::optional<std::vector<int64_t>>& restore_shape) {
  const auto a = unpermute_args(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape);
  moe_ep::UnpermuteWithSavedResult r;
  {
    nb::gil_scoped_release release;
    r = guarded("_token_unpermute", [&] { return moe_ep::unpermute_with_saved(a); });
  }
  return nb::make_tuple(to_python(std::move(r.out)),
                        to_python(std::move(r.permuted_tokens_for_backward)));
}

nb::tuple grad_result(moe_ep::UnpermuteGradResult r) {
  return nb::make_tuple(to_python(std::move(r.grad_permuted_tokens)),
                        to_python(std::move(r.grad_probs)));
}

nb::tuple token_unpermute_grad(const InArray& permuted_tokens, const InArray& grad_out,
                               const InArray& sorted_indices, const OptIn& probs, bool padded_mode,
                               const std::optional<std::vector<int64_t>>& restore_shape) {
  moe_ep::UnpermuteGradArgs a;
  a.permuted_tokens = view_of(permuted_tokens, "permuted_tokens");
  a.grad_out = view_of(grad_out, "grad_out");
  a.sorted_indices = view_of(sorted_indices, "sorted_indices");
  a.probs = view_of(probs, "probs");
  a.padded_mode = padded_mode;
  a.restore_shape = restore_shape;
  moe_ep::UnpermuteGradResult r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_unpermute_grad", [&] { return moe_ep::unpermute_grad(a); });
  }
  return grad_result(std::move(r));
}

nb::tuple token_unpermute_grad_v2(const InArray& grad_out, const InArray& sorted_indices,
                                  int64_t permuted_rows, const std::string& permuted_dtype,
                                  const OptIn& probs, bool padded_mode,
                                  const std::optional<std::vector<int64_t>>& restore_shape,
                                  const OptIn& permuted_tokens) {
  moe_ep::UnpermuteGradV2Args a;
  a.grad_out = view_of(grad_out, "grad_out");
  a.sorted_indices = view_of(sorted_indices, "sorted_indices");
  a.permuted_rows = permuted_rows;
  a.permuted_dtype = parse_dtype(permuted_dtype, "unpermute_grad_v2", "permuted_dtype");
  a.probs = view_of(probs, "probs");
  a.padded_mode = padded_mode;
  a.restore_shape = restore_shape;
  a.permuted_tokens = view_of(permuted_tokens, "permuted_tokens");
  moe_ep::UnpermuteGradResult r;
  {
    nb::gil_scoped_release release;
    r = guarded("token_unpermute_grad_v2", [&] { return moe_ep::unpermute_grad_v2(a); });
  }
  return grad_result(std::move(r));
}

// The error a caller found before the call (handle_error, caller_error_kind: an ErrorKind's
// name), to be reported inside the collective as this rank's, so that the peers raise RemoteError
// at once instead of waiting until their deadline.
moe_ep::Error caller_error(const std::string& message, const std::string& kind) {
  for (int k = 0; k < kErrorKinds; ++k) {
    const auto e = static_cast<moe_ep::ErrorKind>(k);
    if (kind == moe_ep::error_kind_name(e)) return moe_ep::Error(e, message);
  }
  return moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                       message + " (caller_error_kind = '" + kind + "' is not an ErrorKind name)");
}

// ---- SPEC §1-2 ops ------------------------------------------------------------------------

struct EpArgs {
  int64_t ep_world_size, ep_rank_id, moe_expert_num;
  std::optional<PyCommunicator> group_tp;
  int64_t tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num,
      global_bs;
  std::string comm_alg;
  int64_t zero_expert_num, copy_expert_num, const_expert_num;
  std::string transport;
  bool exact_size;
};

moe_ep::EpConfig ep_config(const PyCommunicator& group_ep, const EpArgs& e) {
  moe_ep::EpConfig c;
  c.group_ep = group_ep.comm.get();
  c.ep_world_size = e.ep_world_size;
  c.ep_rank_id = e.ep_rank_id;
  c.moe_expert_num = e.moe_expert_num;
  c.group_tp = e.group_tp ? e.group_tp->comm.get() : nullptr;
  c.tp_world_size = e.tp_world_size;
  c.tp_rank_id = e.tp_rank_id;
  c.expert_shard_type = e.expert_shard_type;
  c.shared_expert_num = e.shared_expert_num;
  c.shared_expert_rank_num = e.shared_expert_rank_num;
  c.global_bs = e.global_bs;
  c.comm_alg = e.comm_alg;
  c.zero_expert_num = e.zero_expert_num;
  c.copy_expert_num = e.copy_expert_num;
  c.const_expert_num = e.const_expert_num;
  c.transport = e.transport;
  c.exact_size = e.exact_size;
  return c;
}

// The outputs of dispatch_v2 as the Python front takes them.
nb::tuple dispatch_tuple(moe_ep::DispatchOutputs r) {
  return nb::make_tuple(
      to_python(std::move(r.expand_x)), to_python(std::move(r.dynamic_scales)),
      to_python(std::move(r.assist_info_for_combine)), to_python(std::move(r.expert_token_nums)),
      to_python(std::move(r.ep_recv_counts)), to_python(std::move(r.tp_recv_counts)),
      to_python(std::move(r.expand_scales)), nb::cast(std::move(r.handle)));
}

// A started op (async_op=True; moe_ep/async.h). The Python front keeps the input tensors alive
// until wait() has returned.
struct PyPendingDispatch {
  moe_ep::PendingDispatch p;
  nb::tuple wait() {
    moe_ep::DispatchOutputs r;
    {
      nb::gil_scoped_release release;
      r = guarded("dispatch_v2", [&] { return p.wait(); });
    }
    return dispatch_tuple(std::move(r));
  }
  // (source, offsets, rows, expand_x, dynamic_scales or None, expand_scales,
  // assist_info_for_combine), or None.
  nb::object wait_source() {
    std::optional<moe_ep::SourceRows> s;
    {
      nb::gil_scoped_release release;
      s = guarded("dispatch_v2", [&] { return p.wait_source(); });
    }
    if (!s) return nb::none();
    return nb::make_tuple(
        s->source, nb::cast(s->offsets), nb::cast(s->rows), to_python(std::move(s->expand_x)),
        to_python(std::move(s->dynamic_scales)), to_python(std::move(s->expand_scales)),
        to_python(std::move(s->assist_info_for_combine)));
  }
};

struct PyPendingTensor {
  moe_ep::Pending<Tensor> p;
  nb::object wait() {
    Tensor r;
    {
      nb::gil_scoped_release release;
      r = guarded("combine_v2", [&] { return p.wait(); });
    }
    return to_python(std::move(r));
  }
};

nb::object dispatch_v2(const InArray& x, const InArray& expert_ids, const PyCommunicator& group_ep,
                       int64_t ep_world_size, int64_t ep_rank_id, int64_t moe_expert_num,
                       const OptIn& scales, const OptIn& x_active_mask, const OptIn& expert_scales,
                       const OptIn& elastic_info, const std::optional<OutArray>& performance_info,
                       std::optional<PyCommunicator> group_tp, int64_t tp_world_size,
                       int64_t tp_rank_id, int64_t expert_shard_type, int64_t shared_expert_num,
                       int64_t shared_expert_rank_num, int64_t quant_mode, int64_t global_bs,
                       int64_t expert_token_nums_type, const std::string& comm_alg,
                       int64_t zero_expert_num, int64_t copy_expert_num, int64_t const_expert_num,
                       const std::string& transport, bool exact_size,
                       const moe_ep::DispatchHandle* handle, const std::string& handle_error,
                       const std::string& caller_error_kind, bool async_op,
                       const std::optional<std::vector<std::optional<OutArray>>>& out) {
  const moe_ep::EpConfig cfg = ep_config(
      group_ep, {ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
                 expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_alg,
                 zero_expert_num, copy_expert_num, const_expert_num, transport, exact_size});
  moe_ep::DispatchInputs in;
  moe_ep::DispatchBuffers buffers;
  // A tensor the binding cannot take goes into the collective as this rank's argument error, so
  // the peers raise RemoteError at once instead of waiting for this rank until their deadline.
  try {
    in.x = view_of(x, "x");
    in.expert_ids = view_of(expert_ids, "expert_ids");
    in.scales = view_of(scales, "scales");
    in.x_active_mask = view_of(x_active_mask, "x_active_mask");
    in.expert_scales = view_of(expert_scales, "expert_scales");
    in.elastic_info = view_of(elastic_info, "elastic_info");
    if (performance_info) in.performance_info = view_of(*performance_info, "performance_info");
    if (out) {
      // DispatchBuffers (dispatch.h), in DispatchOutputs' order; the op checks each view.
      std::optional<TensorView>* slots[] = {
          &buffers.expand_x,          &buffers.dynamic_scales, &buffers.assist_info_for_combine,
          &buffers.expert_token_nums, &buffers.ep_recv_counts, &buffers.tp_recv_counts,
          &buffers.expand_scales};
      static const char* const names[] = {
          "out.expand_x",          "out.dynamic_scales", "out.assist_info_for_combine",
          "out.expert_token_nums", "out.ep_recv_counts", "out.tp_recv_counts",
          "out.expand_scales"};
      if (out->size() != 7)
        throw moe_ep::Error(moe_ep::ErrorKind::kInvalidArgument,
                            "out holds " + std::to_string(out->size()) + " tensors, not 7");
      for (std::size_t i = 0; i < 7; ++i)
        if ((*out)[i]) *slots[i] = view_of(*(*out)[i], names[i]);
      in.out = &buffers;
    }
  } catch (const moe_ep::Error& e) {
    in = moe_ep::DispatchInputs{};
    in.caller_error = moe_ep::Error(e.kind(), std::string("dispatch_v2: ") + e.what());
  }
  // The buffers must outlive the op, which a started one does not wait for (the Python front
  // refuses this first; this guards direct _C callers).
  if (async_op && out && !in.caller_error)
    in.caller_error = moe_ep::Error(moe_ep::ErrorKind::kUnsupported,
                                    "dispatch_v2: out= with async_op=True is unsupported");
  in.quant_mode = quant_mode;
  in.expert_token_nums_type = expert_token_nums_type;
  in.handle = handle;
  if (!handle_error.empty() && !in.caller_error)
    in.caller_error = caller_error(handle_error, caller_error_kind);
  InUse ep_guard(&group_ep, "dispatch_v2", "group_ep");
  InUse tp_guard(group_tp ? &*group_tp : nullptr, "dispatch_v2", "group_tp");
  if (async_op)
    return nb::cast(PyPendingDispatch{
        guarded("dispatch_v2", [&] { return moe_ep::dispatch_v2_start(in, cfg); })});
  moe_ep::DispatchOutputs r;
  {
    nb::gil_scoped_release release;
    r = guarded("dispatch_v2", [&] { return moe_ep::dispatch_v2(in, cfg); });
  }
  return dispatch_tuple(std::move(r));
}

nb::object combine_v2(
    const InArray& expand_x, const InArray& expert_ids, const OptIn& assist_info_for_combine,
    const OptIn& ep_send_counts, const InArray& expert_scales, const PyCommunicator& group_ep,
    int64_t ep_world_size, int64_t ep_rank_id, int64_t moe_expert_num, const OptIn& tp_send_counts,
    const OptIn& x_active_mask, const OptIn& expand_scales, const OptIn& shared_expert_x,
    const OptIn& elastic_info, const OptIn& ori_x, const OptIn& const_expert_alpha_1,
    const OptIn& const_expert_alpha_2, const OptIn& const_expert_v,
    const std::optional<OutArray>& performance_info, std::optional<PyCommunicator> group_tp,
    int64_t tp_world_size, int64_t tp_rank_id, int64_t expert_shard_type, int64_t shared_expert_num,
    int64_t shared_expert_rank_num, int64_t global_bs, int64_t comm_quant_mode,
    const std::string& comm_alg, int64_t zero_expert_num, int64_t copy_expert_num,
    int64_t const_expert_num, const std::string& transport, bool exact_size,
    const moe_ep::DispatchHandle* handle, const std::string& handle_error,
    const std::string& caller_error_kind, bool async_op, const std::optional<OutArray>& out) {
  const moe_ep::EpConfig cfg = ep_config(
      group_ep, {ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
                 expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_alg,
                 zero_expert_num, copy_expert_num, const_expert_num, transport, exact_size});
  moe_ep::CombineInputs in;
  try {  // as in dispatch_v2
    in.expand_x = view_of(expand_x, "expand_x");
    in.expert_ids = view_of(expert_ids, "expert_ids");
    // With a handle they are not read; without, a missing one is the op's error.
    in.assist_info_for_combine =
        view_of(assist_info_for_combine, "assist_info_for_combine").value_or(TensorView{});
    in.ep_send_counts = view_of(ep_send_counts, "ep_send_counts").value_or(TensorView{});
    in.expert_scales = view_of(expert_scales, "expert_scales");
    in.tp_send_counts = view_of(tp_send_counts, "tp_send_counts");
    in.x_active_mask = view_of(x_active_mask, "x_active_mask");
    in.expand_scales = view_of(expand_scales, "expand_scales");
    in.shared_expert_x = view_of(shared_expert_x, "shared_expert_x");
    in.elastic_info = view_of(elastic_info, "elastic_info");
    in.ori_x = view_of(ori_x, "ori_x");
    in.const_expert_alpha_1 = view_of(const_expert_alpha_1, "const_expert_alpha_1");
    in.const_expert_alpha_2 = view_of(const_expert_alpha_2, "const_expert_alpha_2");
    in.const_expert_v = view_of(const_expert_v, "const_expert_v");
    if (performance_info) in.performance_info = view_of(*performance_info, "performance_info");
    if (out) in.out = view_of(*out, "out");
  } catch (const moe_ep::Error& e) {
    in = moe_ep::CombineInputs{};
    in.caller_error = moe_ep::Error(e.kind(), std::string("combine_v2: ") + e.what());
  }
  if (async_op && out && !in.caller_error)
    in.caller_error = moe_ep::Error(moe_ep::ErrorKind::kUnsupported,
                                    "combine_v2: out= with async_op=True is unsupported");
  in.comm_quant_mode = comm_quant_mode;
  in.handle = handle;
  if (!handle_error.empty() && !in.caller_error)
    in.caller_error = caller_error(handle_error, caller_error_kind);
  InUse ep_guard(&group_ep, "combine_v2", "group_ep");
  InUse tp_guard(group_tp ? &*group_tp : nullptr, "combine_v2", "group_tp");
  if (async_op)
    return nb::cast(
        PyPendingTensor{guarded("combine_v2", [&] { return moe_ep::combine_v2_start(in, cfg); })});
  Tensor r;
  {
    nb::gil_scoped_release release;
    r = guarded("combine_v2", [&] { return moe_ep::combine_v2(in, cfg); });
  }
  return to_python(std::move(r));
}

// SPEC §6 (backward.h). Like the forward ops, a tensor the binding cannot take becomes this rank's
// caller_error inside the collective.
nb::object dispatch_v2_backward(const InArray& grad_expand_x, const InArray& expert_ids,
                                const PyCommunicator& group_ep, const EpArgs& ep,
                                const OptIn& x_active_mask, const moe_ep::DispatchHandle* handle,
                                const std::string& handle_error,
                                const std::string& caller_error_kind) {
  const moe_ep::EpConfig cfg = ep_config(group_ep, ep);
  moe_ep::DispatchBackwardInputs in;
  try {
    in.grad_expand_x = view_of(grad_expand_x, "grad_expand_x");
    in.expert_ids = view_of(expert_ids, "expert_ids");
    in.x_active_mask = view_of(x_active_mask, "x_active_mask");
  } catch (const moe_ep::Error& e) {
    in = moe_ep::DispatchBackwardInputs{};
    in.caller_error = moe_ep::Error(e.kind(), std::string("dispatch_v2_backward: ") + e.what());
  }
  in.handle = handle;
  if (!handle_error.empty() && !in.caller_error)
    in.caller_error = caller_error(handle_error, caller_error_kind);
  InUse ep_guard(&group_ep, "dispatch_v2_backward", "group_ep");
  InUse tp_guard(ep.group_tp ? &*ep.group_tp : nullptr, "dispatch_v2_backward", "group_tp");
  Tensor r;
  {
    nb::gil_scoped_release release;
    r = guarded("dispatch_v2_backward", [&] { return moe_ep::dispatch_v2_backward(in, cfg); });
  }
  return to_python(std::move(r));
}

nb::tuple combine_v2_backward(const InArray& grad_out, const InArray& expand_x,
                              const InArray& expert_ids, const InArray& expert_scales,
                              const PyCommunicator& group_ep, const EpArgs& ep,
                              const OptIn& x_active_mask, bool shared_expert_x, const OptIn& ori_x,
                              const OptIn& const_expert_alpha_1, const OptIn& const_expert_alpha_2,
                              const OptIn& const_expert_v, const moe_ep::DispatchHandle* handle,
                              const std::string& handle_error,
                              const std::string& caller_error_kind) {
  const moe_ep::EpConfig cfg = ep_config(group_ep, ep);
  moe_ep::CombineBackwardInputs in;
  try {
    in.grad_out = view_of(grad_out, "grad_out");
    in.expand_x = view_of(expand_x, "expand_x");
    in.expert_ids = view_of(expert_ids, "expert_ids");
    in.expert_scales = view_of(expert_scales, "expert_scales");
    in.x_active_mask = view_of(x_active_mask, "x_active_mask");
    in.ori_x = view_of(ori_x, "ori_x");
    in.const_expert_alpha_1 = view_of(const_expert_alpha_1, "const_expert_alpha_1");
    in.const_expert_alpha_2 = view_of(const_expert_alpha_2, "const_expert_alpha_2");
    in.const_expert_v = view_of(const_expert_v, "const_expert_v");
  } catch (const moe_ep::Error& e) {
    in = moe_ep::CombineBackwardInputs{};
    in.caller_error = moe_ep::Error(e.kind(), std::string("combine_v2_backward: ") + e.what());
  }
  in.shared_expert_x = shared_expert_x;
  in.handle = handle;
  if (!handle_error.empty() && !in.caller_error)
    in.caller_error = caller_error(handle_error, caller_error_kind);
  InUse ep_guard(&group_ep, "combine_v2_backward", "group_ep");
  InUse tp_guard(ep.group_tp ? &*ep.group_tp : nullptr, "combine_v2_backward", "group_tp");
  moe_ep::CombineBackwardOutputs r;
  {
    nb::gil_scoped_release release;
    r = guarded("combine_v2_backward", [&] { return moe_ep::combine_v2_backward(in, cfg); });
  }
  return nb::make_tuple(
      to_python(std::move(r.grad_expand_x)), to_python(std::move(r.grad_expert_scales)),
      to_python(std::move(r.grad_shared_expert_x)), to_python(std::move(r.grad_ori_x)),
      to_python(std::move(r.grad_const_expert_alpha_1)),
      to_python(std::move(r.grad_const_expert_alpha_2)),
      to_python(std::move(r.grad_const_expert_v)));
}

// The size query (dispatch.h, DispatchWorkspace). Local: reads the communicator's rank and size
// only, so it needs neither the other ranks nor the in-use guard of the collective ops.
nb::dict dispatch_workspace(int64_t bs, int64_t hidden, int64_t top_k, const std::string& dtype,
                            const PyCommunicator& group_ep, int64_t ep_world_size,
                            int64_t ep_rank_id, int64_t moe_expert_num,
                            std::optional<PyCommunicator> group_tp, int64_t tp_world_size,
                            int64_t tp_rank_id, int64_t expert_shard_type,
                            int64_t shared_expert_num, int64_t shared_expert_rank_num,
                            int64_t quant_mode, int64_t global_bs, int64_t comm_quant_mode,
                            const std::string& comm_alg, int64_t zero_expert_num,
                            int64_t copy_expert_num, int64_t const_expert_num,
                            const std::string& transport, bool exact_size) {
  const moe_ep::EpConfig cfg = ep_config(
      group_ep, {ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
                 expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_alg,
                 zero_expert_num, copy_expert_num, const_expert_num, transport, exact_size});
  // Any DType's name: dispatch_workspace names a wrong one itself ("dtype = int32 must be ...").
  const DType d = parse_dtype(dtype, "dispatch_workspace", "dtype", /*any_dtype=*/true);
  const moe_ep::DispatchWorkspace w = guarded("dispatch_workspace", [&] {
    return moe_ep::dispatch_workspace(cfg, bs, hidden, top_k, d, quant_mode, comm_quant_mode);
  });
  nb::dict out;
  out["recv_rows"] = w.recv_rows;
  out["expand_x_bytes"] = w.expand_x_bytes;
  out["other_outputs_bytes"] = w.other_outputs_bytes;
  out["shm_slot_bytes"] = w.shm_slot_bytes;
  out["shm_stage_bytes"] = w.shm_stage_bytes;
  out["combine_output_bytes"] = w.combine_output_bytes;
  return out;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "moe-ep's DLPack binding (framework-agnostic); see moe_ep.torch for the torch ops";
  register_errors(m);

  nb::class_<moe_ep::DispatchHandle>(
      m, "DispatchHandle",
      "The plan of one dispatch_v2 call (SPEC §7): pass it to the combine_v2 of its outputs, or "
      "to a dispatch_v2 with the same routing, so that they exchange rows only")
      .def_prop_ro("defined", &moe_ep::DispatchHandle::defined);
  nb::class_<PyPendingDispatch>(m, "PendingDispatch",
                                "A dispatch_v2 started with async_op=True (moe_ep/async.h)")
      .def(
          "test", [](const PyPendingDispatch& d) { return d.p.test(); },
          "True once the op has ended (wait() then returns at once); never blocks")
      .def("wait", &PyPendingDispatch::wait,
           "Blocks until the op has ended; returns dispatch_v2's tuple or raises its error; once")
      .def("wait_source", &PyPendingDispatch::wait_source,
           "Blocks until one more source rank's rows have landed: (source, offsets, rows, "
           "expand_x, dynamic_scales, expand_scales, assist_info_for_combine), rows [offsets[l], "
           "offsets[l] + rows[l]) "
           "of expand_x for local expert l; None once every source was returned");
  nb::class_<PyPendingTensor>(m, "PendingTensor",
                              "A combine_v2 started with async_op=True (moe_ep/async.h)")
      .def("test", [](const PyPendingTensor& d) { return d.p.test(); })
      .def("wait", &PyPendingTensor::wait);
  nb::class_<PyCommunicator>(m, "Communicator",
                             "An MPI communicator (duplicated) with moe-ep's settings (deadline, "
                             "shared-memory window size)")
      .def_static("from_fortran", &make_communicator, "fortran_handle"_a,
                  "timeout_s"_a = nb::none(), "shm_window_bytes"_a = 0, "shm_grow"_a = true,
                  "Collective over the communicator whose Fortran handle is given (mpi4py: "
                  "comm.py2f()). timeout_s: the deadline of every wait (default "
                  "$MOE_EP_TIMEOUT_S, else 300). shm_window_bytes: bytes of this rank's "
                  "shared-memory window segment when the first op creates it (>= 0; 0: twice "
                  "that op's need, at least 1 MiB; size it with dispatch_workspace). shm_grow: "
                  "False makes the window now, with shm_window_bytes (> 0), and no op grows it "
                  "(a call without room moves its rows by messages). CommOptions, comm.h. "
                  "Raises InvalidArgumentError for a bad timeout_s, a negative "
                  "shm_window_bytes, or shm_grow False without one (on this rank, before "
                  "duplicating), and on every rank when ranks disagree on shm_grow")
      .def_prop_ro("rank", [](const PyCommunicator& c) { return c.comm->rank(); })
      .def_prop_ro("size", [](const PyCommunicator& c) { return c.comm->size(); })
      .def_prop_ro("timeout_s", [](const PyCommunicator& c) { return c.comm->timeout_s(); })
      .def_prop_ro("shm_window_bytes",
                   [](const PyCommunicator& c) { return c.comm->shm_window_bytes(); })
      .def_prop_ro("shm_grow", [](const PyCommunicator& c) { return c.comm->shm_grow(); });

  m.def("_arm_exit_guard", &moe_ep_python::arm_exit_guard,
        "At interpreter exit, before MPI is finalised: after a Timeout or System error, "
        "ends the process with status 1 if it still runs after $MOE_EP_EXIT_GRACE_S seconds "
        "(default 2), naming the first error on stderr; returns that grace, or -1 (no fault "
        "seen, nothing armed). exit_guard.h");
  m.def("_abort_job", &moe_ep_python::abort_job, "what"_a,
        "moe_ep's sys.excepthook, after the traceback: under MPI with more than one process in "
        "MPI_COMM_WORLD, names this rank and `what` on stderr and calls MPI_Abort (does not "
        "return); otherwise returns False. exit_guard.h");
  m.def(
      "check_environment",
      [](std::optional<double> timeout_s, const std::string& transport) {
        moe_ep::CommOptions options;
        options.timeout_s = timeout_s;
        return moe_ep::check_environment(options, transport);
      },
      "timeout_s"_a = nb::none(), "transport"_a = "",
      "Reads $MOE_EP_TIMEOUT_S (when timeout_s is None), $MOE_EP_TRANSPORT (when transport is "
      "'') and $MOE_EP_STREAM_MIN_BYTES as Communicator.from_fortran and the ops will; no MPI "
      "call, so every rank can run it before its first collective. Returns the deadline in "
      "seconds the communicator would use. Raises InvalidArgumentError for a malformed value "
      "(comm.h, check_environment)");
  m.def("set_num_threads", &moe_ep::set_num_threads, "n"_a,
        "1 <= n <= 1024: moe-ep's parallel loops use n threads from now on (process-wide); 0: "
        "back to the automatic rule (num_threads). Raises InvalidArgumentError for n < 0 or "
        "n > 1024 (threads.h, kMaxThreads)");
  m.def("num_threads", &moe_ep::num_threads,
        "The thread count of moe-ep's parallel loops: set_num_threads's n; else "
        "omp_get_max_threads() when $OMP_NUM_THREADS holds a positive count or OpenMP binds its "
        "threads; else this rank's share of its machine (the CPUs of the ranks on it, from the "
        "Communicators created so far, divided by those ranks), at least 1 and at most this "
        "process's CPUs and omp_get_max_threads() (threads.h). Results never depend on it");
  m.def("strategies", &strategies, "op"_a, "has_probs"_a, "has_permuted_tokens"_a = true,
        "SPEC §5: the two sharding strategies of a local op, R first, as the C++ table gives "
        "them: [{'name', 'inputs': [(arg, placement, data_read)], 'outputs': [...]}], placement "
        "= ('replicate', 0) | ('shard', dim) | ('partial', 0) | None (absent)");

  m.def("token_permute", &token_permute, "tokens"_a, "indices"_a, "num_out_tokens"_a = nb::none(),
        "padded_mode"_a = false);
  m.def("token_permute_grad", &token_permute_grad, "tokens"_a, "grad_permuted_tokens"_a,
        "indices"_a, "sorted_indices"_a, "padded_mode"_a = false);
  m.def("token_permute_grad_v2", &token_permute_grad_v2, "grad_permuted_tokens"_a,
        "sorted_indices"_a, "tokens_rows"_a, "tokens_dtype"_a, "num_topk"_a,
        "padded_mode"_a = false);
  m.def("token_unpermute", &token_unpermute, "permuted_tokens"_a, "sorted_indices"_a,
        "probs"_a = nb::none(), "padded_mode"_a = false, "restore_shape"_a = nb::none());
  m.def("token_unpermute_with_saved", &token_unpermute_with_saved, "permuted_tokens"_a,
        "sorted_indices"_a, "probs"_a = nb::none(), "padded_mode"_a = false,
        "restore_shape"_a = nb::none());
  m.def("token_unpermute_grad", &token_unpermute_grad, "permuted_tokens"_a, "grad_out"_a,
        "sorted_indices"_a, "probs"_a = nb::none(), "padded_mode"_a = false,
        "restore_shape"_a = nb::none());
  m.def("token_unpermute_grad_v2", &token_unpermute_grad_v2, "grad_out"_a, "sorted_indices"_a,
        "permuted_rows"_a, "permuted_dtype"_a, "probs"_a = nb::none(), "padded_mode"_a = false,
        "restore_shape"_a = nb::none(), "permuted_tokens"_a = nb::none());

  m.def("dispatch_v2", &dispatch_v2, "x"_a, "expert_ids"_a, "group_ep"_a, "ep_world_size"_a,
        "ep_rank_id"_a, "moe_expert_num"_a, nb::kw_only(), "scales"_a = nb::none(),
        "x_active_mask"_a = nb::none(), "expert_scales"_a = nb::none(),
        "elastic_info"_a = nb::none(), "performance_info"_a = nb::none(), "group_tp"_a = nb::none(),
        "tp_world_size"_a = 0, "tp_rank_id"_a = 0, "expert_shard_type"_a = 0,
        "shared_expert_num"_a = 1, "shared_expert_rank_num"_a = 0, "quant_mode"_a = 0,
        "global_bs"_a = 0, "expert_token_nums_type"_a = 1, "comm_alg"_a = "",
        "zero_expert_num"_a = 0, "copy_expert_num"_a = 0, "const_expert_num"_a = 0,
        "transport"_a = "", "exact_size"_a = false, "handle"_a = nb::none(), "handle_error"_a = "",
        "caller_error_kind"_a = "InvalidArgument", "async_op"_a = false, "out"_a = nb::none(),
        "SPEC §1. async_op: start it and return a PendingDispatch (moe_ep/async.h). out: 7 "
        "tensors or None in the order returned (DispatchBuffers, dispatch.h), written in place; "
        "the outputs returned for them view that memory (the caller keeps it alive). Returns "
        "(expand_x, dynamic_scales or None, assist_info_for_combine, "
        "expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales, handle); exact_size: "
        "EpConfig::exact_size (outputs sized to the rows received, not SPEC §1.4's A); handle: "
        "a DispatchHandle of an earlier call with the same routing (a cached dispatch, SPEC §7); "
        "handle_error: the caller's message about an argument it could not use (a handle it could "
        "not resolve, a malformed argument the Python front found), reported as this rank's error "
        "of kind caller_error_kind (an ErrorKind name, default 'InvalidArgument') inside the "
        "collective (the peers raise RemoteError); the tensors may then be placeholders");
  m.def("combine_v2", &combine_v2, "expand_x"_a, "expert_ids"_a, "assist_info_for_combine"_a.none(),
        "ep_send_counts"_a.none(), "expert_scales"_a, "group_ep"_a, "ep_world_size"_a,
        "ep_rank_id"_a, "moe_expert_num"_a, nb::kw_only(), "tp_send_counts"_a = nb::none(),
        "x_active_mask"_a = nb::none(), "expand_scales"_a = nb::none(),
        "shared_expert_x"_a = nb::none(), "elastic_info"_a = nb::none(), "ori_x"_a = nb::none(),
        "const_expert_alpha_1"_a = nb::none(), "const_expert_alpha_2"_a = nb::none(),
        "const_expert_v"_a = nb::none(), "performance_info"_a = nb::none(),
        "group_tp"_a = nb::none(), "tp_world_size"_a = 0, "tp_rank_id"_a = 0,
        "expert_shard_type"_a = 0, "shared_expert_num"_a = 1, "shared_expert_rank_num"_a = 0,
        "global_bs"_a = 0, "comm_quant_mode"_a = 0, "comm_alg"_a = "", "zero_expert_num"_a = 0,
        "copy_expert_num"_a = 0, "const_expert_num"_a = 0, "transport"_a = "",
        "exact_size"_a = false, "handle"_a = nb::none(), "handle_error"_a = "",
        "caller_error_kind"_a = "InvalidArgument", "async_op"_a = false, "out"_a = nb::none(),
        "SPEC §2. async_op: start it and return a PendingTensor (moe_ep/async.h). out: the "
        "caller's (BS, H) tensor, written and viewed by the result (CombineInputs::out). Returns "
        "x (BS, H). handle: dispatch_v2's DispatchHandle (SPEC §7); then "
        "assist_info_for_combine and ep_send_counts are not read and may be None");
  // The backward ops take the EP arguments by keyword, as the forward ones do.
  m.def(
      "dispatch_v2_backward",
      [](const InArray& grad_expand_x, const InArray& expert_ids, const PyCommunicator& group_ep,
         int64_t ep_world_size, int64_t ep_rank_id, int64_t moe_expert_num,
         const OptIn& x_active_mask, std::optional<PyCommunicator> group_tp, int64_t tp_world_size,
         int64_t tp_rank_id, int64_t expert_shard_type, int64_t shared_expert_num,
         int64_t shared_expert_rank_num, int64_t global_bs, const std::string& comm_alg,
         int64_t zero_expert_num, int64_t copy_expert_num, int64_t const_expert_num,
         const std::string& transport, bool exact_size, const moe_ep::DispatchHandle* handle,
         const std::string& handle_error, const std::string& caller_error_kind) {
        return dispatch_v2_backward(
            grad_expand_x, expert_ids, group_ep,
            {ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
             expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_alg,
             zero_expert_num, copy_expert_num, const_expert_num, transport, exact_size},
            x_active_mask, handle, handle_error, caller_error_kind);
      },
      "grad_expand_x"_a, "expert_ids"_a, "group_ep"_a, "ep_world_size"_a, "ep_rank_id"_a,
      "moe_expert_num"_a, nb::kw_only(), "x_active_mask"_a = nb::none(), "group_tp"_a = nb::none(),
      "tp_world_size"_a = 0, "tp_rank_id"_a = 0, "expert_shard_type"_a = 0,
      "shared_expert_num"_a = 1, "shared_expert_rank_num"_a = 0, "global_bs"_a = 0,
      "comm_alg"_a = "", "zero_expert_num"_a = 0, "copy_expert_num"_a = 0, "const_expert_num"_a = 0,
      "transport"_a = "", "exact_size"_a = false, "handle"_a = nb::none(), "handle_error"_a = "",
      "caller_error_kind"_a = "InvalidArgument",
      "SPEC §6 (backward.h). Returns grad_x (BS, H). handle: the forward dispatch_v2's "
      "DispatchHandle (required)");
  m.def(
      "combine_v2_backward",
      [](const InArray& grad_out, const InArray& expand_x, const InArray& expert_ids,
         const InArray& expert_scales, const PyCommunicator& group_ep, int64_t ep_world_size,
         int64_t ep_rank_id, int64_t moe_expert_num, const OptIn& x_active_mask,
         bool shared_expert_x, const OptIn& ori_x, const OptIn& const_expert_alpha_1,
         const OptIn& const_expert_alpha_2, const OptIn& const_expert_v,
         std::optional<PyCommunicator> group_tp, int64_t tp_world_size, int64_t tp_rank_id,
         int64_t expert_shard_type, int64_t shared_expert_num, int64_t shared_expert_rank_num,
         int64_t global_bs, const std::string& comm_alg, int64_t zero_expert_num,
         int64_t copy_expert_num, int64_t const_expert_num, const std::string& transport,
         bool exact_size, const moe_ep::DispatchHandle* handle, const std::string& handle_error,
         const std::string& caller_error_kind) {
        return combine_v2_backward(
            grad_out, expand_x, expert_ids, expert_scales, group_ep,
            {ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
             expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs, comm_alg,
             zero_expert_num, copy_expert_num, const_expert_num, transport, exact_size},
            x_active_mask, shared_expert_x, ori_x, const_expert_alpha_1, const_expert_alpha_2,
            const_expert_v, handle, handle_error, caller_error_kind);
      },
      "grad_out"_a, "expand_x"_a, "expert_ids"_a, "expert_scales"_a, "group_ep"_a,
      "ep_world_size"_a, "ep_rank_id"_a, "moe_expert_num"_a, nb::kw_only(),
      "x_active_mask"_a = nb::none(), "shared_expert_x"_a = false, "ori_x"_a = nb::none(),
      "const_expert_alpha_1"_a = nb::none(), "const_expert_alpha_2"_a = nb::none(),
      "const_expert_v"_a = nb::none(), "group_tp"_a = nb::none(), "tp_world_size"_a = 0,
      "tp_rank_id"_a = 0, "expert_shard_type"_a = 0, "shared_expert_num"_a = 1,
      "shared_expert_rank_num"_a = 0, "global_bs"_a = 0, "comm_alg"_a = "", "zero_expert_num"_a = 0,
      "copy_expert_num"_a = 0, "const_expert_num"_a = 0, "transport"_a = "", "exact_size"_a = false,
      "handle"_a = nb::none(), "handle_error"_a = "", "caller_error_kind"_a = "InvalidArgument",
      "SPEC §6 (backward.h). Returns (grad_expand_x, grad_expert_scales, grad_shared_expert_x, "
      "grad_ori_x, grad_const_expert_alpha_1, grad_const_expert_alpha_2, grad_const_expert_v); "
      "None where the forward had no such input. handle: required");
  m.def("dispatch_workspace", &dispatch_workspace, "bs"_a, "hidden"_a, "top_k"_a, "dtype"_a,
        "group_ep"_a, "ep_world_size"_a, "ep_rank_id"_a, "moe_expert_num"_a, nb::kw_only(),
        "group_tp"_a = nb::none(), "tp_world_size"_a = 0, "tp_rank_id"_a = 0,
        "expert_shard_type"_a = 0, "shared_expert_num"_a = 1, "shared_expert_rank_num"_a = 0,
        "quant_mode"_a = 0, "global_bs"_a = 0, "comm_quant_mode"_a = 0, "comm_alg"_a = "",
        "zero_expert_num"_a = 0, "copy_expert_num"_a = 0, "const_expert_num"_a = 0,
        "transport"_a = "", "exact_size"_a = false,
        "The bytes one dispatch_v2 and its combine_v2 take on this rank (dispatch.h, "
        "DispatchWorkspace). Local: no communication. dtype: x's, by name ('bf16', 'fp16', "
        "'fp32'). Returns {'recv_rows', 'expand_x_bytes', 'other_outputs_bytes', "
        "'shm_slot_bytes', 'shm_stage_bytes', 'combine_output_bytes'}, all but recv_rows in "
        "bytes. Raises InvalidArgumentError / UnsupportedError (dispatch_v2's checks of the EP "
        "arguments, and bs, hidden, top_k, dtype, quant_mode, comm_quant_mode)");
}
