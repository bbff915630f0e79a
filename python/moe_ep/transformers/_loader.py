"""moe_ep.transformers.from_pretrained: a Hugging Face checkpoint loaded expert-parallel, each
rank reading only its own experts (docs/design.md, "Real models").

The model is built with its parameters on the meta device (transformers' own init context, as
its from_pretrained does), the experts modules are cut to this rank's experts (shard_experts:
rank r of W keeps experts [r * E / W, (r + 1) * E / W)), and every parameter is then allocated
at its local shape and filled from the safetensors files. The files are read with pread straight
into the parameters' storage; only each file's header is parsed (8-byte little-endian length,
then JSON), nothing is memory-mapped, so no page of another rank's experts is ever resident: the
peak resident set is the non-expert weights plus this rank's experts (plus one bounded bounce
buffer when the checkpoint's dtype differs from the model's).

Checkpoint keys are mapped to parameters with transformers' own conversion mapping
(get_model_conversion_mapping: WeightRenaming, WeightConverter). An experts parameter is read
either from one fused tensor (its rows [start, stop): one contiguous byte range) or from the
legacy per-expert tensors (model.layers.0.mlp.experts.3.gate_proj.weight), of which only this
rank's experts are read, each into its place in the local fused tensor as the converter's
operations say (MergeModulelist(dim=0): stack over experts, then Concatenate(dim=d): the source
patterns side by side along d). Any other operation on an experts parameter is refused
(UnsupportedError naming it). Other converters (non-expert parameters) run as transformers runs
them, on whole tensors.

Every failure is agreed among the ranks before it is raised (an allgather of each rank's error),
so a bad input raises on every rank and no rank is left waiting in a collective: a missing or
unreadable file, a checkpoint missing an expert tensor, ranks loading different checkpoints (a
SHA-256 of config.json, every safetensors header, the file sizes and sampled data), a world size
that does not divide the experts.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

import moe_ep
from moe_ep import InternalError, InvalidArgumentError, SystemError, UnsupportedError
from moe_ep.torch.nn import _comm_or_world, allreduce_max, local_expert_range, wait
from moe_ep.transformers._experts import (
    IMPLEMENTATION,
    check_recognised,
    expert_param_names,
    experts_modules,
    shard_experts,
)

OP = "moe_ep.transformers.from_pretrained"

# safetensors' dtype names.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20  # safetensors' own bound on the JSON header
_BOUNCE_BYTES = 64 * 2**20  # the bounce buffer of a dtype conversion
_SAMPLES, _SAMPLE_BYTES = 16, 4096  # data sampled per file into the fingerprint


# ------------------------------------------------------------------------------------------
# Agreeing among the ranks


def _allgather_bytes(comm, data: bytes, what: str) -> List[bytes]:
    """Every rank's data, in rank order (a nonblocking allgather polled against the deadline)."""
    longest = int(allreduce_max(comm, np.array([len(data)], dtype=np.int64), what)[0])
    size = 8 + longest
    send = np.zeros(size, dtype=np.uint8)
    send[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
    send[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    recv = np.empty(size * comm.Get_size(), dtype=np.uint8)
    wait(comm.Iallgather(send, recv), comm, what, (send, recv))
    out = []
    for r in range(comm.Get_size()):
        row = recv[r * size:(r + 1) * size]
        n = int.from_bytes(row[:8].tobytes(), "little")
        out.append(row[8:8 + n].tobytes())
    return out


_KINDS = {c.__name__: c for c in (InvalidArgumentError, UnsupportedError, moe_ep.TimeoutError,
                                  moe_ep.RemoteError, SystemError, InternalError)}


def _agree(comm, error: Optional[BaseException], what: str) -> None:
    """Raises on every rank when any rank failed (error not None there); returns on every rank
    otherwise. A rank that failed raises its own error; the others raise the first failed
    rank's kind (InvalidArgumentError, UnsupportedError, ...) with its message, the rank named."""
    mine = b""
    if error is not None:
        kind = type(error).__name__ if type(error).__name__ in _KINDS else "InternalError"
        mine = json.dumps([kind, str(error)]).encode()
    got = _allgather_bytes(comm, mine, f"{OP} ({what})")
    failed = [(r, json.loads(g)) for r, g in enumerate(got) if g]
    if not failed:
        return
    if error is not None:
        # The same error everywhere (a bad checkpoint every rank reads) needs no rank list.
        same = len(failed) == comm.Get_size() and all(m == [kind, str(error)] for _, m in failed)
        if len(failed) > 1 and not same and isinstance(error, moe_ep.Error):
            others = [r for r, _ in failed if r != comm.Get_rank()]
            raise type(error)(f"{error} (ranks {others} failed too)") from error
        raise error
    rank, (kind, message) = failed[0]
    more = f"; ranks {[r for r, _ in failed[1:]]} failed too" if len(failed) > 1 else ""
    message = message[len(OP) + 2:] if message.startswith(OP + ": ") else message
    raise _KINDS[kind](f"{OP}: rank {rank} failed ({what}): {message}{more}")


# ------------------------------------------------------------------------------------------
# The checkpoint: files, headers, fingerprint


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: absolute byte offset and size of its data."""

    file: str
    key: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


@dataclass
class _Checkpoint:
    folder: str
    files: List[str]
    entries: Dict[str, _Entry]
    fingerprint: str


def _read_header(path: str) -> Tuple[bytes, dict, int]:
    """(the header's JSON bytes, parsed, the data section's offset) of a safetensors file."""
    size = os.path.getsize(path)
    with open(path, "rb", buffering=0) as f:
        head = f.read(8)
        if len(head) < 8:
            raise InvalidArgumentError(
                f"{OP}: {path} is {size} bytes, too short for a safetensors file (8-byte "
                f"header length, then the header)")
        n = int.from_bytes(head, "little")
        if n > min(_MAX_HEADER, size - 8):
            raise InvalidArgumentError(
                f"{OP}: {path}: header length = {n} exceeds the file's {size - 8} bytes after "
                f"the length field (or {_MAX_HEADER}); not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise InvalidArgumentError(f"{OP}: {path}: the safetensors header is not JSON ({e})")
    if not isinstance(header, dict):
        raise InvalidArgumentError(f"{OP}: {path}: the safetensors header is not a JSON object")
    return raw, header, 8 + n


def _entries(path: str, header: dict, base: int, size: int) -> Dict[str, _Entry]:
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _DTYPES[meta["dtype"]]
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(v) for v in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, KeyError) and isinstance(meta, dict) and "dtype" in meta \
                    and meta["dtype"] not in _DTYPES:
                raise UnsupportedError(
                    f"{OP}: {path}: tensor {key!r} has dtype {meta['dtype']!r}; supported: "
                    f"{sorted(_DTYPES)}")
            raise InvalidArgumentError(
                f"{OP}: {path}: header entry {key!r} = {meta!r} lacks dtype, shape or "
                f"data_offsets")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise InvalidArgumentError(
                f"{OP}: {path}: tensor {key!r} ({meta['dtype']}, shape {list(shape)}) has "
                f"data_offsets [{begin}, {end}): {end - begin} bytes for {nbytes}, in a data "
                f"section of {size - base} bytes")
        out[key] = _Entry(path, key, dtype, shape, base + begin, nbytes)
    return out


def _sample(path: str, base: int, size: int) -> bytes:
    """Bytes from _SAMPLES evenly spaced places of the data section (and its end)."""
    span = size - base
    if span <= 0:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        parts = []
        for i in range(_SAMPLES + 1):
            at = base + (span - min(span, _SAMPLE_BYTES)) * i // _SAMPLES
            parts.append(os.pread(fd, min(span, _SAMPLE_BYTES), at))
        return b"".join(parts)
    finally:
        os.close(fd)


def open_checkpoint(path) -> _Checkpoint:
    """The safetensors files of the checkpoint folder path, their tensors and the fingerprint
    (SHA-256 of config.json, each file's name, size, header and sampled data)."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise InvalidArgumentError(f"{OP}: path = {folder!r} does not exist or is not a folder "
                                   f"(a local checkpoint folder: config.json and *.safetensors)")
    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        raise InvalidArgumentError(f"{OP}: path = {folder!r} has no config.json")
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    weight_map: Optional[Dict[str, str]] = None
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgumentError(f"{OP}: {index} is not a safetensors index "
                                       f"(a JSON object with a weight_map): {e!r}")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not os.path.isfile(os.path.join(folder, name)):
                keys = [k for k, v in weight_map.items() if v == name]
                raise InvalidArgumentError(
                    f"{OP}: {index} names file {name!r} (for {len(keys)} tensors, e.g. "
                    f"{keys[0]!r}), which is not in {folder!r}")
        files = [os.path.join(folder, n) for n in names]
    elif os.path.isfile(single):
        files = [single]
    else:
        others = sorted(n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth")))
        raise InvalidArgumentError(
            f"{OP}: path = {folder!r} has neither model.safetensors nor "
            f"model.safetensors.index.json" + (f" (found {others}: only safetensors checkpoints "
                                              f"are read)" if others else ""))
    digest = hashlib.sha256()
    with open(config, "rb") as f:
        digest.update(f.read())
    entries: Dict[str, _Entry] = {}
    for file in files:
        size = os.path.getsize(file)
        raw, header, base = _read_header(file)
        found = _entries(file, header, base, size)
        for key in found:
            if key in entries:
                raise InvalidArgumentError(f"{OP}: tensor {key!r} is in both {entries[key].file} "
                                           f"and {file}")
        entries.update(found)
        digest.update(f"\0{os.path.basename(file)}\0{size}\0".encode())
        digest.update(raw)
        digest.update(_sample(file, base, size))
    if weight_map is not None:
        for key, name in weight_map.items():
            entry = entries.get(key)
            if entry is None or os.path.basename(entry.file) != name:
                raise InvalidArgumentError(
                    f"{OP}: {index} maps tensor {key!r} to {name!r}, whose header "
                    + ("lacks it" if entry is None else f"lacks it (it is in {entry.file})"))
    return _Checkpoint(folder, files, entries, digest.hexdigest())


# ------------------------------------------------------------------------------------------
# Reading


class _Reader:
    """pread of byte ranges of the checkpoint's files into tensors' storage."""

    def __init__(self):
        self._fds: Dict[str, int] = {}
        self.bytes_read = 0

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def _pread_into(self, path: str, offset: int, dest: torch.Tensor) -> None:
        if dest.numel() == 0:
            return
        view = memoryview(dest.reshape(-1).view(torch.uint8).numpy())
        fd, done = self._fd(path), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise InvalidArgumentError(
                    f"{OP}: {path} ended at byte {offset + done}, inside a tensor its header "
                    f"places up to byte {offset + len(view)} (a truncated file?)")
            done += n
        self.bytes_read += len(view)

    def read(self, entry: _Entry, dest: torch.Tensor, start: int = 0,
             stop: Optional[int] = None) -> None:
        """Rows [start, stop) of entry's dim 0 (all of a 0-dim tensor) into dest (their shape,
        any dtype and strides). Straight into dest's storage when the dtypes match and dest is
        contiguous; through a bounce buffer of at most _BOUNCE_BYTES otherwise."""
        if not entry.shape:
            rows, row_shape, row_bytes = 1, (), entry.dtype.itemsize
            start, stop = 0, 1
        else:
            stop = entry.shape[0] if stop is None else stop
            rows, row_shape = stop - start, entry.shape[1:]
            row_bytes = math.prod(row_shape) * entry.dtype.itemsize
        want = (rows,) + row_shape if entry.shape else ()
        if tuple(dest.shape) != want:
            raise InternalError(f"{OP}: reading {entry.key} rows [{start}, {stop}) of shape "
                                f"{list(want)} into a tensor of shape {list(dest.shape)}")
        offset = entry.offset + start * row_bytes
        if dest.dtype == entry.dtype and dest.is_contiguous():
            self._pread_into(entry.file, offset, dest)
            return
        if not entry.shape:
            tmp = torch.empty((), dtype=entry.dtype)
            self._pread_into(entry.file, offset, tmp)
            dest.copy_(tmp)
            return
        step = max(1, _BOUNCE_BYTES // max(1, row_bytes))
        for r in range(0, rows, step):
            k = min(step, rows - r)
            tmp = torch.empty((k,) + row_shape, dtype=entry.dtype)
            self._pread_into(entry.file, offset + r * row_bytes, tmp)
            dest[r:r + k].copy_(tmp)

    def whole(self, entry: _Entry) -> torch.Tensor:
        t = torch.empty(entry.shape, dtype=entry.dtype)
        self.read(entry, t)
        return t


# ------------------------------------------------------------------------------------------
# The plan: which checkpoint tensors fill which parameter


@dataclass
class _Expert:
    """An experts module's per-expert parameter: global shape, this rank's experts."""

    module_name: str
    num_experts: int
    start: int
    stop: int
    global_shape: Tuple[int, ...]


@dataclass
class _Target:
    """A parameter (or persistent buffer) of the model and the checkpoint tensors that fill it."""

    name: str
    converter: object = None  # a WeightConverter, or None: one tensor, maybe renamed
    sources: List[Tuple[str, str]] = field(default_factory=list)  # (source pattern, key)
    expert: Optional[_Expert] = None
    # experts with a converter: [(pattern, {expert index: key}, concat offset)] and the concat dim
    pieces: list = field(default_factory=list)
    concat_dim: Optional[int] = None


def _resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        d = getattr(config, "dtype", None)
        if isinstance(d, str):
            d = getattr(torch, d, None)
        return d if isinstance(d, torch.dtype) else torch.get_default_dtype()
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        names = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16",
                 "float": "float32"}
        d = getattr(torch, names.get(dtype, dtype), None)
        if isinstance(d, torch.dtype) and d.is_floating_point:
            return d
    raise InvalidArgumentError(
        f"{OP}: dtype = {dtype!r} is not a floating torch.dtype, a name of one ('bfloat16', "
        f"'bf16', 'float32', ...), 'auto' or None (both: the checkpoint's config.dtype)")


def _build(folder: str, dtype, comm, transport: str):
    """The model on the meta device, its experts modules cut to this rank's experts."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils.generic import ContextManagers

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise InvalidArgumentError(f"{OP}: {folder}/config.json is not a transformers config "
                                   f"this transformers reads: {e}")
    dtype = _resolve_dtype(dtype, config)
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedError(
            f"{OP}: model_type = {getattr(config, 'model_type', None)!r} ({type(config).__name__}) "
            f"has no causal-LM class in this transformers (AutoModelForCausalLM)")
    config.dtype = dtype
    config._experts_implementation = IMPLEMENTATION
    with ContextManagers(cls.get_init_context(dtype, False, False, None, config)):
        model = cls(config)
    modules = list(experts_modules(model))
    if not modules:
        raise UnsupportedError(
            f"{OP}: {cls.__name__} has no experts module (a class decorated with transformers' "
            f"@use_experts_implementation); moe_ep loads MoE models expert-parallel")
    experts: Dict[str, _Expert] = {}
    for name, module in modules:
        check_recognised(name, module)
        start, stop = local_expert_range(module.num_experts, comm, f"{OP} ({name})")
        for p in expert_param_names(module):
            experts[f"{name}.{p}"] = _Expert(name, module.num_experts, start, stop,
                                             tuple(getattr(module, p).shape))
    shard_experts(model, comm, transport=transport)
    return model, dtype, experts


def _index_regex(pattern: str) -> "re.Pattern":
    return re.compile(pattern.replace("*.", r"(\d+)\."))


def _plan(model, ckpt: _Checkpoint, experts: Dict[str, _Expert]):
    """{parameter name: _Target} and the checkpoint keys that match no parameter."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        apply_renamings,
        dot_natural_key,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    meta = model.state_dict()
    prefix = model.base_model_prefix
    targets: Dict[str, _Target] = {}
    unexpected: List[str] = []
    for key in sorted(ckpt.entries, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if name not in meta and key in meta:
            name, pattern = rename_source_key(key, [], [], prefix, meta)
        if name not in meta:
            unexpected.append(key)
            continue
        target = targets.get(name)
        if target is None:
            target = targets[name] = _Target(
                name, by_pattern[pattern] if pattern is not None else None,
                expert=experts.get(name))
        elif target.converter is None or pattern is None:
            raise InvalidArgumentError(
                f"{OP}: checkpoint tensors {target.sources[0][1]!r} and {key!r} both map to "
                f"parameter {name}")
        target.sources.append((pattern, key))

    for target in targets.values():
        e = target.expert
        if e is None:
            continue
        if target.converter is None:
            entry = ckpt.entries[target.sources[0][1]]
            if entry.shape != e.global_shape:
                raise InvalidArgumentError(
                    f"{OP}: checkpoint tensor {entry.key!r} has shape {list(entry.shape)}; "
                    f"parameter {target.name} ({e.num_experts} experts) has "
                    f"{list(e.global_shape)}")
            continue
        conv = target.converter
        ops = list(conv.operations)
        ok = ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0 and (
            (len(ops) == 1 and len(conv.source_patterns) == 1)
            or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1))
        if not ok:
            raise UnsupportedError(
                f"{OP}: parameter {target.name} is built from {target.sources[0][1]!r}, ... by "
                f"the operations {[repr(op) for op in ops]} of {conv!r}; moe_ep reads an experts "
                f"parameter's local slice through MergeModulelist(dim=0) optionally followed by "
                f"Concatenate(dim >= 1) only, or from a fused tensor")
        target.concat_dim = ops[1].dim if len(ops) == 2 else None
        renamed = {k: apply_renamings(k, renamings) for _, k in target.sources}
        by_src: Dict[str, Dict[int, str]] = {p: {} for p in conv.source_patterns}
        for pattern, key in target.sources:
            if "*" not in pattern:
                raise UnsupportedError(
                    f"{OP}: parameter {target.name}: converter source pattern {pattern!r} has no "
                    f"expert index (*); moe_ep reads per-expert tensors or fused ones")
            m = _index_regex(pattern).search(renamed[key])
            if m is None:
                raise InternalError(f"{OP}: no expert index in {key!r} for pattern {pattern!r}")
            by_src[pattern][int(m.group(1))] = key
        offset, shapes = 0, []
        d = target.concat_dim
        for pattern in conv.source_patterns:
            found = by_src[pattern]
            for i in range(e.num_experts):
                if i in found:
                    continue
                raise InvalidArgumentError(
                    f"{OP}: the checkpoint lacks {_missing_key(found, i, pattern, target)!r}: "
                    f"expert {i} of parameter {target.name} (num_experts = {e.num_experts}; "
                    f"source pattern {pattern!r})")
            bad = {i for i in found if i >= e.num_experts}
            if bad:
                raise InvalidArgumentError(
                    f"{OP}: checkpoint tensor {found[min(bad)]!r} is expert {min(bad)} of "
                    f"parameter {target.name}, which has num_experts = {e.num_experts}")
            first = ckpt.entries[found[0]]
            for i, key in found.items():
                if ckpt.entries[key].shape != first.shape:
                    raise InvalidArgumentError(
                        f"{OP}: checkpoint tensor {key!r} has shape "
                        f"{list(ckpt.entries[key].shape)}, {found[0]!r} has {list(first.shape)} "
                        f"(experts of parameter {target.name} share a shape)")
            target.pieces.append((pattern, found, offset))
            shapes.append(first.shape)
            if d is not None:
                if d - 1 >= len(first.shape):
                    raise InvalidArgumentError(
                        f"{OP}: Concatenate(dim={d}) for parameter {target.name}: checkpoint "
                        f"tensor {found[0]!r} has only {len(first.shape)} dims")
                offset += first.shape[d - 1]
        fused = list(shapes[0])
        if d is not None:
            fused[d - 1] = offset
            for s in shapes:
                if len(s) != len(fused) or any(a != b for j, (a, b) in enumerate(zip(s, fused))
                                               if j != d - 1):
                    fused = None
                    break
        want = tuple([e.num_experts] + fused) if fused is not None else None
        if want != e.global_shape:
            raise InvalidArgumentError(
                f"{OP}: parameter {target.name} has shape {list(e.global_shape)}; the checkpoint's "
                f"per-expert tensors {[p[1][0] for p in target.pieces]} have shapes "
                f"{[list(s) for s in shapes]}, which {conv!r} makes "
                f"{list(want) if want else 'incompatible'}")
    return targets, unexpected


def _missing_key(found: Dict[int, str], i: int, pattern: str, target: _Target) -> str:
    """The key expert i's tensor would have: a sibling's key with the expert index replaced."""
    if found:
        j, key = next(iter(found.items()))
        at = key.rfind(f".{j}.")
        if at >= 0:
            return f"{key[:at]}.{i}.{key[at + len(str(j)) + 2:]}"
    module = target.name.rsplit(".", 1)[0]
    tail = pattern.replace("\\", "").replace("*", str(i))
    return f"{module.rsplit('.experts', 1)[0]}.{tail.lstrip('.')}"


# ------------------------------------------------------------------------------------------
# Filling


def _set(model, name: str, value: torch.Tensor) -> torch.Tensor:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        old = module._parameters[attr]
        value = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        module._parameters[attr] = value
    elif attr in module._buffers:
        module._buffers[attr] = value
    else:
        raise InternalError(f"{OP}: {name} is neither a parameter nor a buffer")
    value._is_hf_initialized = True
    return value


def _target_dtype(name: str, meta: torch.Tensor, dtype_plan) -> torch.dtype:
    if dtype_plan is not None:
        alternation, by_group, plan = dtype_plan
        m = alternation.search(name)
        if m is not None:
            return plan[by_group[m.lastgroup]]
    return meta.dtype


def _fill(model, ckpt: _Checkpoint, targets: Dict[str, _Target], dtype) -> Dict[str, int]:
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype)
    dtype_plan = None
    if plan:
        alternation, by_group, _ = build_glob_alternation(list(plan.keys()))
        dtype_plan = (alternation, by_group, plan)
    meta = dict(model.named_parameters())
    meta.update(model.named_buffers())
    reader = _Reader()
    counts = {"non_expert": 0, "local_expert": 0}
    try:
        for name, target in targets.items():
            old = meta[name]
            tdtype = _target_dtype(name, old, dtype_plan)
            if target.expert is not None:
                e = target.expert
                dest = torch.empty(old.shape, dtype=tdtype)
                if target.converter is None:
                    reader.read(ckpt.entries[target.sources[0][1]], dest, e.start, e.stop)
                else:
                    for _, found, offset in target.pieces:
                        for i in range(e.start, e.stop):
                            entry = ckpt.entries[found[i]]
                            view = dest[i - e.start]
                            if target.concat_dim is not None:
                                view = view.narrow(target.concat_dim - 1, offset,
                                                   entry.shape[target.concat_dim - 1])
                            reader.read(entry, view)
                _set(model, name, dest)
                counts["local_expert"] += dest.numel() * dest.element_size()
                continue
            if target.converter is None:
                entry = ckpt.entries[target.sources[0][1]]
                if entry.shape != tuple(old.shape):
                    raise InvalidArgumentError(
                        f"{OP}: checkpoint tensor {entry.key!r} has shape {list(entry.shape)}; "
                        f"parameter {name} has {list(old.shape)}")
                dest = torch.empty(old.shape, dtype=tdtype)
                reader.read(entry, dest)
                _set(model, name, dest)
                counts["non_expert"] += dest.numel() * dest.element_size()
                continue
            # A non-expert converter: run transformers' own operations on whole tensors.
            conv = copy.deepcopy(target.converter)
            for pattern, key in target.sources:
                entry = ckpt.entries[key]
                conv.add_tensor(name, key, pattern, lambda entry=entry: reader.whole(entry))
            realized = conv.convert(name, model=model, config=model.config)
            for out_name, value in realized.items():
                value = value[0] if isinstance(value, list) else value
                dest_meta = meta.get(out_name)
                if dest_meta is None or tuple(value.shape) != tuple(dest_meta.shape):
                    raise InvalidArgumentError(
                        f"{OP}: {target.converter!r} made {out_name} of shape "
                        f"{list(value.shape)} from {[k for _, k in target.sources]}; the model "
                        + ("has no such parameter" if dest_meta is None
                           else f"expects {list(dest_meta.shape)}"))
                value = value.to(_target_dtype(out_name, dest_meta, dtype_plan)).contiguous()
                _set(model, out_name, value)
                counts["non_expert"] += value.numel() * value.element_size()
    finally:
        reader.close()
    counts["read"] = reader.bytes_read
    return counts


def _finish(model) -> None:
    """What transformers does after loading: non-persistent buffers (rotary inv_freq) and
    persistent ones the checkpoint lacks are allocated and initialised by the model's own
    _init_weights (loaded tensors are marked initialised and left alone), then the tied weights
    are tied. Raises InvalidArgumentError naming any parameter that is still unfilled."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta and name in tied:
            p._is_hf_initialized = True  # tie_weights below replaces it
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            module_name, _, attr = name.rpartition(".")
            model.get_submodule(module_name)._buffers[attr] = torch.empty_like(buf, device="cpu")
    model.initialize_weights()
    model.tie_weights()
    missing = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if missing:
        raise InvalidArgumentError(
            f"{OP}: the checkpoint has no tensor for parameter {missing[0]}"
            + (f" (nor for {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
            + "; a rank cannot make up weights that the others must share")


def from_pretrained(path, comm=None, *, dtype=None, transport: str = ""):
    """The causal LM of the local checkpoint folder path (config.json and model.safetensors or
    model.safetensors.index.json with its shards), expert-parallel over comm (an mpi4py
    communicator; None: MPI.COMM_WORLD): every rank of comm calls it with the same checkpoint;
    rank r of W holds experts [r * E / W, (r + 1) * E / W) of every experts module and reads only
    those from the files. dtype: the parameters' dtype (None or "auto": config.dtype, as
    transformers' "auto"); transport: dispatch_v2's ("shm", "mpi", "": the default).

    Returns the model in eval mode with experts implementation "moe_ep" and the loaded sizes in
    model.moe_ep_bytes = {"non_expert": bytes, "local_expert": bytes, "read": bytes read from
    the files}. Errors, raised on every rank: InvalidArgumentError for a missing or malformed
    file, a checkpoint lacking a parameter or an expert's tensor (named, with the expert), ranks
    loading different checkpoints (the ranks and their hashes named), a world size that does not
    divide the experts; UnsupportedError for a model without experts modules or a conversion
    moe_ep cannot slice. docs/design.md ("Real models")."""
    comm = _comm_or_world(comm)
    folder = os.path.abspath(os.fspath(path))

    ckpt = error = None
    try:
        ckpt = open_checkpoint(folder)
    except Exception as e:  # noqa: BLE001  (agreed below, then raised on every rank)
        error = _as_moe_ep(e, f"reading the checkpoint at {folder!r}")
    _agree(comm, error, "reading the checkpoint")

    prints = _allgather_bytes(comm, json.dumps([ckpt.fingerprint, folder]).encode(),
                              f"{OP} (comparing the checkpoints)")
    prints = [json.loads(p) for p in prints]
    if len({h for h, _ in prints}) > 1:
        groups: Dict[str, List[int]] = {}
        for r, (h, _) in enumerate(prints):
            groups.setdefault(h, []).append(r)
        said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: sha256 "
                         f"{h[:16]} ({prints[rs[0]][1]})" for h, rs in groups.items())
        raise InvalidArgumentError(
            f"{OP}: the ranks load different checkpoints (hash of config.json, the safetensors "
            f"headers, file sizes and sampled data): {said}; every rank must load the same one")

    model = targets = None
    try:
        model, dtype, experts = _build(folder, dtype, comm, transport)
        targets, unexpected = _plan(model, ckpt, experts)
    except Exception as e:  # noqa: BLE001
        error = _as_moe_ep(e, "building the model")
    _agree(comm, error, "building the model")
    if unexpected and comm.Get_rank() == 0:
        warnings.warn(f"{OP}: {len(unexpected)} checkpoint tensors match no parameter of "
                      f"{type(model).__name__} and were not read: {unexpected[:4]}")

    try:
        counts = _fill(model, ckpt, targets, dtype)
        _finish(model)
    except Exception as e:  # noqa: BLE001
        error = _as_moe_ep(e, "reading the weights")
    _agree(comm, error, "reading the weights")

    model.set_experts_implementation(IMPLEMENTATION)
    model.eval()
    gen = os.path.join(folder, "generation_config.json")
    if os.path.isfile(gen) and getattr(model, "generation_config", None) is not None:
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.moe_ep_bytes = counts
    return model


def _as_moe_ep(e: Exception, what: str) -> Exception:
    """moe_ep errors as they are; an OSError as SystemError naming the file; anything else as
    InternalError naming its type (on every rank alike), the original as its cause."""
    if isinstance(e, moe_ep.Error):
        return e
    if isinstance(e, OSError):
        return SystemError(f"{OP}: {what}: {e}")
    wrapped = InternalError(f"{OP}: {what}: {type(e).__name__}: {e}")
    wrapped.__cause__ = e
    return wrapped


__all__ = ["from_pretrained", "open_checkpoint"]
