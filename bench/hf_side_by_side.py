#!/usr/bin/env python3
"""Side by side (issue 31, item 6): one Qwen3-MoE checkpoint served at W ranks by

  (a) single-process transformers, experts_implementation "grouped_mm" and "batched_mm" (one
      process, all W ranks' prompts in one batch);
  (b) transformers' own expert parallelism (DistributedConfig ep_size = W with the model's
      ep_plan) on gloo under torchrun;
  (c) a textbook torch.distributed all-to-all token dispatcher on gloo (torchtitan's / Megatron's
      AllToAllTokenDispatcher: permute by expert, all_to_all_single of the counts, then of the
      rows, the rank's experts, all_to_all back, unpermute), registered as the experts
      implementation "a2a_gloo", data-parallel attention;
  (d) moe-ep's experts implementation "moe_ep", transport "shm" or "mpi", data-parallel attention
      (moe_ep.transformers.lockstep), under mpirun.

Every row runs the same greedy fp32 loop (a prefill of the prompts, then decode steps, each a
model call with the KV cache) and reports prefill and decode tokens/s (all ranks' tokens over the
slowest rank's time), peak RSS per rank (after loading, and while serving) and whether its
tokens equal row (a) grouped_mm's, token for token.

  python bench/hf_side_by_side.py make   --dir D [--smoke] [--world W]     checkpoint + prompts
  python bench/hf_side_by_side.py single --dir D --impl grouped_mm[,batched_mm] [--reference]
  torchrun --nproc-per-node W bench/hf_side_by_side.py hf-ep --dir D [--ep-mode ep|tp+ep|dp+ep]
  torchrun --nproc-per-node W bench/hf_side_by_side.py a2a --dir D    (or mpirun, --master-addr)
  mpirun -n W python bench/hf_side_by_side.py moe-ep --dir D --transport shm[,mpi]
  mpirun -n W python bench/hf_side_by_side.py smoke --dir D     all of the above, tiny, 1 launch
  python bench/hf_side_by_side.py table  --dir D                        Markdown of D/results.jsonl
(--threads N: torch threads; --repeat N: timed runs, the best reported; HF_SBS_PROFILE=1: rank
0's cProfile of the timed runs.) Rows append to D/results.jsonl; (a) --reference writes
D/ref_tokens.pt, which the other rows compare with.

scripts/hf-side-by-side.sh runs them all (docs/performance.md, "Real models (issue 31): side by
side").
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The checkpoint: Qwen3-MoE's layer (Qwen3-30B-A3B: top-8, expert FFN 768, head_dim 128 ...)
# cut down so that four ranks on a 2-core machine serve it in seconds.
SIZES = {
    "full": dict(layers=2, hidden=1024, experts=64, top_k=8, expert_ffn=768, heads=16, kv_heads=4,
                 head_dim=64, vocab=8192, prompts=4, prompt_len=128, steps=16),
    "smoke": dict(layers=2, hidden=128, experts=8, top_k=2, expert_ffn=64, heads=4, kv_heads=2,
                  head_dim=32, vocab=512, prompts=2, prompt_len=16, steps=4),
}


# --------------------------------------------------------------------------------------------
# Small helpers: memory, files, ranks.

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _status_meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def machine_busy_s() -> float:
    """CPU seconds all CPUs of the machine spent outside idle and iowait since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM, the peak resident set size."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    return _status_kib("VmHWM") / 1024.0


def rss_mib() -> float:
    return _status_kib("VmRSS") / 1024.0


def load_meta(d: str) -> dict:
    with open(os.path.join(d, "bench.json")) as f:
        return json.load(f)


def append_result(d: str, row: dict) -> None:
    with open(os.path.join(d, "results.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


class Single:
    """The group of one process."""
    rank, world = 0, 1

    def barrier(self):
        pass

    def max(self, x: float) -> float:
        return x

    def gather(self, obj):
        return [obj]


class TorchGroup:
    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def barrier(self):
        self.dist.barrier()

    def max(self, x: float) -> float:
        import torch

        t = torch.tensor([x], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t[0])

    def gather(self, obj):
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out


class MPIGroup:
    def __init__(self, comm):
        self.comm = comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()

    def barrier(self):
        self.comm.Barrier()

    def max(self, x: float) -> float:
        from mpi4py import MPI

        return self.comm.allreduce(x, op=MPI.MAX)

    def gather(self, obj):
        return self.comm.allgather(obj)


def _interface_for(addr: str) -> str | None:
    """The name of this host's network interface that routes to addr (gloo binds to it)."""
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((addr, 9))
        local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    finally:
        s.close()
    return None


def _launcher() -> str:
    if os.environ.get("HF_SBS_LAUNCHER"):
        return os.environ["HF_SBS_LAUNCHER"]
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else \
        "mpirun" if "OMPI_COMM_WORLD_RANK" in os.environ else "python"


def init_torch_distributed(master_addr: str | None, port: int) -> None:
    """torch.distributed on gloo, under torchrun (RANK, WORLD_SIZE set) or mpirun
    (OMPI_COMM_WORLD_RANK / _SIZE; rank 0's host is master_addr)."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
        os.environ["LOCAL_RANK"] = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        os.environ["MASTER_ADDR"] = master_addr or "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
    if master_addr and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = _interface_for(master_addr)
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name
    if not dist.is_initialized():
        dist.init_process_group("gloo")


# --------------------------------------------------------------------------------------------
# The checkpoint and the prompts.

def cmd_make(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    size = dict(SIZES["smoke" if args.smoke else "full"])
    for key in ("layers", "hidden", "experts", "top_k", "expert_ffn", "prompts", "prompt_len",
                "steps", "vocab"):
        v = getattr(args, key, None)
        if v is not None:
            size[key] = v
    cfg = Qwen3MoeConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
        moe_intermediate_size=size["expert_ffn"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
        head_dim=size["head_dim"], num_experts=size["experts"],
        num_experts_per_tok=size["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    os.makedirs(args.dir, exist_ok=True)
    model.save_pretrained(os.path.join(args.dir, "model"))
    g = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, size["vocab"], (args.world * size["prompts"], size["prompt_len"]),
                            generator=g)
    torch.save(prompts, os.path.join(args.dir, "prompts.pt"))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    meta = dict(size, world=args.world, seed=args.seed, smoke=bool(args.smoke), commit=_commit(),
                expert_mib=experts * 4 / 2**20, other_mib=(total - experts) * 4 / 2**20)
    with open(os.path.join(args.dir, "bench.json"), "w") as f:
        json.dump(meta, f, indent=1)
    open(os.path.join(args.dir, "results.jsonl"), "w").close()
    print(f"hf_side_by_side: checkpoint in {args.dir}/model: {describe(meta)}; "
          f"{experts * 4 / 2**20:.0f} MiB of experts, {(total - experts) * 4 / 2**20:.0f} MiB else")


def describe(m: dict) -> str:
    return (f"Qwen3-MoE, {m['layers']} layers, H {m['hidden']}, {m['experts']} experts top-"
            f"{m['top_k']}, expert FFN {m['expert_ffn']}, {m['heads']} heads ({m['kv_heads']} KV, "
            f"head_dim {m['head_dim']}), vocab {m['vocab']}, fp32")


# --------------------------------------------------------------------------------------------
# The greedy loop every row runs.

def greedy(model, ids, steps: int, prefill_impl: str | None = None):
    """Prefill of ids (B, P), then `steps` decode calls; returns (tokens (B, steps + 1), prefill
    seconds, decode seconds). Each is one model call per step with the KV cache; the first new
    token comes from the prefill. prefill_impl: another experts implementation for the prefill
    (the decode steps go back to the model's)."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        impl = model.config._experts_implementation
        if prefill_impl:
            model.set_experts_implementation(prefill_impl)
        t0 = time.perf_counter()
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)
        t1 = time.perf_counter()
        if prefill_impl:
            model.set_experts_implementation(impl)
        toks = [nxt]
        for _ in range(steps):
            out = model(input_ids=nxt[:, None], cache=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
            toks.append(nxt)
        t2 = time.perf_counter()
    return torch.stack(toks, 1), t1 - t0, t2 - t1


def serve(model, ids, meta, group, repeat: int = 1, step_ctx=contextlib.nullcontext,
          prefill_impl=None):
    """Warm-up (a short prefill and 2 decode steps), then `repeat` timed runs, each started
    by a barrier. Returns (tokens, prefill s, decode s): the slowest rank's time of each run,
    the best run's (a shared machine's load comes and goes). Every run's tokens must agree."""
    warm = ids[:, : min(16, ids.shape[1])]
    with step_ctx():
        greedy(model, warm, 2, prefill_impl)
    reset_peak_rss()
    prof = None
    if os.environ.get("HF_SBS_PROFILE") and group.rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    best_pre = best_dec = float("inf")
    tokens = None
    cpu0 = (time.perf_counter(), machine_busy_s(), time.process_time())
    for _ in range(max(1, repeat)):
        group.barrier()
        with step_ctx():
            got, t_pre, t_dec = greedy(model, ids, meta["steps"], prefill_impl)
        if tokens is not None and not bool((got == tokens).all()):
            raise RuntimeError("hf_side_by_side: two timed runs of the same prompts gave "
                               "different tokens")
        tokens = got
        best_pre = min(best_pre, group.max(t_pre))
        best_dec = min(best_dec, group.max(t_dec))
    group.barrier()
    wall, busy, own = (b - a for a, b in zip(cpu0, (time.perf_counter(), machine_busy_s(),
                                                    time.process_time())))
    serve.cpu = dict(wall=wall, busy=busy, own=own)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    return tokens, best_pre, best_dec


def record(args, meta, group, row: dict, tokens, t_pre, t_dec, load_peak, load_rss,
           tokens_total_prompts: int, reference_slice) -> None:
    """Gathers the ranks' figures and token checks; rank 0 appends the row."""
    import torch

    serve_peak = peak_rss_mib()
    ref_path = os.path.join(args.dir, "ref_tokens.pt")
    match = None
    if os.path.exists(ref_path):
        ref = torch.load(ref_path)[reference_slice]
        match = [int((tokens != ref).any(1).sum()), int(ref.shape[0])]
    mine = dict(load_peak=load_peak, load_rss=load_rss, serve_peak=serve_peak, match=match,
                cpu=getattr(serve, "cpu", None))
    every = group.gather(mine)
    if group.rank != 0:
        return
    steps = meta["steps"]
    prompt_tokens = tokens_total_prompts * meta["prompt_len"]
    if any(e["match"] is None for e in every):
        match_text = "no reference"
    else:
        if row.get("replicated"):  # every rank ran every prompt: rank 0's tokens
            bad, seqs = every[0]["match"]
        else:
            bad = sum(e["match"][0] for e in every)
            seqs = sum(e["match"][1] for e in every)
        match_text = "yes" if bad == 0 else f"NO ({bad} of {seqs} sequences differ)"
    row.update(
        prefill_tok_s=prompt_tokens / t_pre, decode_tok_s=tokens_total_prompts * steps / t_dec,
        prefill_s=t_pre, decode_s=t_dec,
        load_peak_mib=max(e["load_peak"] for e in every),
        load_rss_mib=max(e["load_rss"] for e in every),
        serve_peak_mib=max(e["serve_peak"] for e in every),
        serve_peak_all=[round(e["serve_peak"]) for e in every],
        match=match_text, load=os.getloadavg()[0])
    cpu = every[0]["cpu"]
    if cpu and cpu["wall"] > 0:
        # Other processes' CPU use during the timed runs, in CPUs: the machine's busy time
        # less this row's own processes' (the launcher's, a few ms, counts as others').
        others = max(0.0, cpu["busy"] - sum(e["cpu"]["own"] for e in every)) / cpu["wall"]
        row.update(others_cpus=others, own_cpus=sum(e["cpu"]["own"] for e in every) / cpu["wall"])
    append_result(args.dir, row)
    print(f"hf_side_by_side: {row['row']}: prefill {row['prefill_tok_s']:.0f} tok/s, decode "
          f"{row['decode_tok_s']:.1f} tok/s, peak RSS/rank {row['serve_peak_mib']:.0f} MiB "
          f"(load {row['load_peak_mib']:.0f}), tokens match: {match_text}", flush=True)


def record_error(args, group_rank: int, row: dict, err: BaseException) -> None:
    if group_rank != 0:
        return
    msg = f"{type(err).__name__}: {err}".strip().splitlines()
    row.update(error=" ".join(m.strip() for m in msg)[:600])
    append_result(args.dir, row)
    print(f"hf_side_by_side: {row['row']}: FAILED: {row['error']}", flush=True)


def set_threads(n: int | None) -> int:
    import torch

    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def load_model(path: str, impl: str, **kw):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 experts_implementation=impl, **kw)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------
# (a) single process.

def cmd_single(args) -> None:
    """One process, all W ranks' prompts in one batch; --impl grouped_mm,batched_mm runs the
    implementations one after the other on the same loaded model (each its own row; the first
    one's tokens are the reference with --reference)."""
    import torch

    meta = load_meta(args.dir)
    threads = set_threads(args.threads)
    group = Single()
    prompts = torch.load(os.path.join(args.dir, "prompts.pt"))
    impls = args.impl.split(",")
    model = load_model(os.path.join(args.dir, "model"), impls[0])
    gc.collect()
    load_peak, load_rss = peak_rss_mib(), rss_mib()
    for i, impl in enumerate(impls):
        model.set_experts_implementation(impl)
        row = dict(group="a", row=f"(a) transformers, 1 process (all prompts), {impl}", ranks=1,
                   threads=threads, launcher="python", loader="whole (transformers)")
        prefill_impl = None
        if impl == "batched_mm":
            # batched_mm gathers each (token, expert) pair's weights: T * K copies of an
            # expert's gate_up_proj and down_proj in one layer's call.
            need = prompts.numel() * meta["top_k"] * 3 * meta["hidden"] * meta["expert_ffn"] * 4
            avail = _status_meminfo_kib("MemAvailable") * 1024
            if need > avail / 2:
                prefill_impl = "grouped_mm"
                row["note"] = (f"batched_mm's prefill would gather {need / 2**30:.0f} GiB of "
                               f"expert weights per layer ({prompts.numel()} tokens x top-"
                               f"{meta['top_k']} copies of an expert's weights); the machine has "
                               f"{avail / 2**30:.0f} GiB available, so its prefill ran "
                               f"grouped_mm and only its decode steps batched_mm")
                row["prefill_impl"] = prefill_impl
        tokens, t_pre, t_dec = serve(model, prompts, meta, group, repeat=args.repeat,
                                     prefill_impl=prefill_impl)
        if args.reference and i == 0:
            torch.save(tokens, os.path.join(args.dir, "ref_tokens.pt"))
            row["reference"] = True
        record(args, meta, group, row, tokens, t_pre, t_dec, load_peak, load_rss,
               prompts.shape[0], slice(None))


# --------------------------------------------------------------------------------------------
# (b) transformers' own expert parallelism.

def cmd_hf_ep(args) -> None:
    import torch

    meta = load_meta(args.dir)
    threads = set_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    modes = {
        # Only the experts split (tp_plan {}): every rank runs the whole batch through attention;
        # at inference AutoEP picks AllReduceEP (each rank its experts on every token, then an
        # all-reduce of the partial outputs).
        "ep": dict(ep_size=world, tp_size=world, tp_plan={}),
        # The model's tp_plan for attention and its ep_plan for the experts, the whole batch on
        # every rank (AllReduceEP as above).
        "tp+ep": dict(ep_size=world, tp_size=world),
        # Data parallel (each rank its own prompts; FSDP2 shards the dense weights) and the
        # experts over all_to_all (AllToAllEP).
        "dp+ep": dict(ep_size=world, fsdp_size=world, ep_implementation="all_to_all"),
    }
    kw = modes[args.ep_mode]
    label = {"ep": "(b) transformers EP, whole batch on every rank (AllReduceEP)",
             "tp+ep": "(b) transformers TP attention + EP, whole batch on every rank "
                      "(AllReduceEP)",
             "dp+ep": "(b) transformers FSDP + EP, each rank its prompts (AllToAllEP)"}[
                 args.ep_mode]
    row = dict(group="b", row=label, ranks=world, threads=threads, launcher=_launcher(),
               loader="transformers (distributed_config)",
               config=f"DistributedConfig({', '.join(f'{k}={v!r}' for k, v in kw.items())})")
    replicated = args.ep_mode != "dp+ep"
    row["replicated"] = replicated
    prompts = torch.load(os.path.join(args.dir, "prompts.pt"))
    B = meta["prompts"]
    ids = prompts if replicated else prompts[rank * B:(rank + 1) * B]
    group = None
    try:
        from transformers.distributed import DistributedConfig

        model = load_model(os.path.join(args.dir, "model"), "grouped_mm",
                           distributed_config=DistributedConfig(**kw))
        group = TorchGroup()
        gc.collect()
        load_peak, load_rss = peak_rss_mib(), rss_mib()
        tokens, t_pre, t_dec = serve(model, ids, meta, group, repeat=args.repeat)
    except Exception as e:  # noqa: BLE001 - the row records why this path cannot run here
        if rank == 0:
            traceback.print_exc()
        record_error(args, rank, row, e)
        return
    record(args, meta, group, row, tokens, t_pre, t_dec, load_peak, load_rss,
           prompts.shape[0], slice(None) if replicated else slice(rank * B, (rank + 1) * B))
    if not getattr(args, "keep_group", False):
        # Without this a rank of the FSDP run aborted at exit ("terminate called without an
        # active exception").
        del model
        group.barrier()
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------
# (c) the textbook all-to-all dispatcher on gloo.

def _local_experts(module, x, counts):
    """The module's own expert math on rows grouped by local expert: moe_ep.transformers' own
    loop, so that (c) and (d) differ only in the exchange."""
    from moe_ep.transformers._experts import local_experts

    if x.shape[0] == 0:
        return x.new_zeros((0, module.down_proj.shape[-2]))
    return local_experts(module)(x, counts).to(x.dtype)


def a2a_gloo_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Megatron's AllToAllTokenDispatcher / torchtitan's all-to-all EP, on gloo:
    permute (sort the T*K (token, expert) rows by expert) -> all_to_all_single of the per-expert
    counts -> all_to_all_single of the rows -> sort the received chunks by local expert -> the
    rank's experts -> unsort -> all_to_all_single back -> unpermute with the top-k weights."""
    import torch
    import torch.distributed as dist

    world, E, L = self._a2a_world, self._a2a_num_experts, self._a2a_local
    T, K = top_k_index.shape
    H = hidden_states.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    permuted = hidden_states[order // K]
    counts = torch.bincount(flat, minlength=E)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send_split = counts.view(world, L).sum(1).tolist()
    recv_cnt = recv_counts.view(world, L)
    recv_split = recv_cnt.sum(1).tolist()
    received = permuted.new_empty((sum(recv_split), H))
    dist.all_to_all_single(received, permuted, recv_split, send_split)
    # (source, local expert) chunks -> (local expert, source) order for the experts.
    chunks = received.split(recv_cnt.reshape(-1).tolist())
    by_expert = [chunks[s * L + e] for e in range(L) for s in range(world)]
    y = _local_experts(self, torch.cat(by_expert) if by_expert else received,
                       recv_cnt.sum(0).tolist())
    ychunks = y.split([int(recv_cnt[s, e]) for e in range(L) for s in range(world)])
    back_src = torch.cat([ychunks[e * world + s] for s in range(world) for e in range(L)]) \
        if ychunks else y
    back = permuted.new_empty((T * K, H))
    dist.all_to_all_single(back, back_src.contiguous(), send_split, recv_split)
    unpermuted = torch.empty_like(back)
    unpermuted[order] = back
    out = (unpermuted.view(T, K, H) * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(1)
    return out.to(hidden_states.dtype)


class _SafetensorsFile:
    """A safetensors file read with plain reads into fresh tensors (8-byte header length, JSON
    header, data): no mapping, so only the bytes read become this process's memory."""

    DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

    def __init__(self, path: str):
        import struct

        self.f = open(path, "rb")
        (n,) = struct.unpack("<Q", self.f.read(8))
        self.header = json.loads(self.f.read(n))
        self.base = 8 + n

    def read(self, key: str, rows=None):
        import torch

        meta = self.header[key]
        dtype = getattr(torch, self.DTYPES[meta["dtype"]])
        shape = list(meta["shape"])
        begin = meta["data_offsets"][0]
        if rows is not None:
            row_bytes = dtype.itemsize
            for d in shape[1:]:
                row_bytes *= d
            begin += rows[0] * row_bytes
            shape[0] = rows[1] - rows[0]
        t = torch.empty(shape, dtype=dtype)
        self.f.seek(self.base + begin)
        self.f.readinto(memoryview(t.view(torch.uint8).numpy()).cast("B"))
        return t

    def close(self):
        self.f.close()


def load_rank_experts(path: str, impl: str, rank: int, world: int):
    """The Qwen3-MoE checkpoint with this rank's experts only, as a hand-written expert-parallel
    stack loads it: the model built on the meta device (transformers' init context), every
    non-expert tensor read whole, and of each experts module only experts
    [rank * E / W, (rank + 1) * E / W): from the fused gate_up_proj / down_proj when the file
    has them, else from the per-expert gate_proj / up_proj / down_proj (save_pretrained's
    layout), concatenated as transformers' conversion does (gate rows, then up rows). The
    files are read, not mapped (_SafetensorsFile)."""
    import glob

    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils.generic import ContextManagers

    config = AutoConfig.from_pretrained(path)
    config.dtype = torch.float32
    config._experts_implementation = impl
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with ContextManagers(cls.get_init_context(torch.float32, False, False, None, config)):
        model = cls(config)
    files = {}
    handles = [_SafetensorsFile(f) for f in sorted(glob.glob(os.path.join(path, "*.safetensors")))]
    for h in handles:
        for k in h.header:
            if k != "__metadata__":
                files[k] = h

    def get(key, rows=None):
        return files[key].read(key, rows)

    experts = {name: m for name, m in model.named_modules()
               if hasattr(m, "gate_up_proj") and hasattr(m, "num_experts")}
    for name, m in experts.items():
        E = m.num_experts
        if E % world:
            raise ValueError(f"{name}: {E} experts do not divide over {world} ranks")
        L = E // world
        lo = rank * L
        if f"{name}.gate_up_proj" in files:
            gate_up = get(f"{name}.gate_up_proj", (lo, lo + L))
            down = get(f"{name}.down_proj", (lo, lo + L))
        else:
            gate_up = torch.empty((L,) + tuple(m.gate_up_proj.shape[1:]), dtype=torch.float32)
            down = torch.empty((L,) + tuple(m.down_proj.shape[1:]), dtype=torch.float32)
            half = gate_up.shape[1] // 2
            for i, e in enumerate(range(lo, lo + L)):
                gate_up[i, :half] = get(f"{name}.{e}.gate_proj.weight")
                gate_up[i, half:] = get(f"{name}.{e}.up_proj.weight")
                down[i] = get(f"{name}.{e}.down_proj.weight")
        m.gate_up_proj = torch.nn.Parameter(gate_up.float().contiguous(), requires_grad=False)
        m.down_proj = torch.nn.Parameter(down.float().contiguous(), requires_grad=False)
        m._a2a_world, m._a2a_rank, m._a2a_num_experts, m._a2a_local = world, rank, E, L
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        module._parameters[attr] = torch.nn.Parameter(get(name).float().clone(),
                                                      requires_grad=False)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._buffers[attr] = torch.empty_like(buf, device="cpu")
    for p in model.parameters():
        p._is_hf_initialized = True
    model.initialize_weights()  # the non-persistent buffers (rotary inv_freq)
    model.tie_weights()
    for h in handles:
        h.close()
    model.eval()
    return model


def cmd_a2a(args) -> None:
    import torch
    from transformers.integrations.moe import ExpertsInterface

    meta = load_meta(args.dir)
    threads = set_threads(args.threads)
    init_torch_distributed(args.master_addr, args.port)
    group = TorchGroup()
    rank, world = group.rank, group.world
    launcher = _launcher()
    label = "(c) textbook all-to-all dispatcher, gloo" + (f", {args.label}" if args.label else "")
    row = dict(group="c", row=label,
               ranks=world, threads=threads, launcher=launcher,
               loader="the rank's experts (read, not mapped)")
    ExpertsInterface.register("a2a_gloo", a2a_gloo_experts_forward)
    prompts = torch.load(os.path.join(args.dir, "prompts.pt"))
    B = meta["prompts"]
    model = load_rank_experts(os.path.join(args.dir, "model"), "a2a_gloo", rank, world)
    gc.collect()
    load_peak, load_rss = peak_rss_mib(), rss_mib()
    ids = prompts[rank * B:(rank + 1) * B]
    tokens, t_pre, t_dec = serve(model, ids, meta, group, repeat=args.repeat)
    record(args, meta, group, row, tokens, t_pre, t_dec, load_peak, load_rss,
           prompts.shape[0], slice(rank * B, (rank + 1) * B))
    if not getattr(args, "keep_group", False):
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------
# (d) moe-ep.

def cmd_moe_ep(args) -> None:
    """Data-parallel attention (each rank its own prompts, moe_ep.transformers.lockstep), the
    experts through moe-ep. --transport shm,mpi runs both on the same loaded model, one row
    each."""
    import torch
    from mpi4py import MPI

    try:
        import moe_ep.transformers as mt
    except ImportError:
        sys.path.insert(0, os.path.join(ROOT, "python"))
        import moe_ep.transformers as mt

    meta = load_meta(args.dir)
    threads = set_threads(args.threads)
    comm = MPI.COMM_WORLD
    group = MPIGroup(comm)
    rank, world = group.rank, group.world
    path = os.path.join(args.dir, "model")
    transports = args.transport.split(",")
    if args.loader != "full" and hasattr(mt, "from_pretrained"):
        # Reads only this rank's experts (issue 31, item 2).
        model = mt.from_pretrained(path, comm)
        loader = "the rank's experts (moe_ep.transformers.from_pretrained)"
    else:
        model = load_model(path, "moe_ep")
        loader = "whole (transformers), then shard_experts"
    mt.shard_experts(model, comm, transport=transports[0])
    model.eval()
    gc.collect()
    load_peak, load_rss = peak_rss_mib(), rss_mib()
    prompts = torch.load(os.path.join(args.dir, "prompts.pt"))
    B = meta["prompts"]
    ids = prompts[rank * B:(rank + 1) * B]
    for transport in transports:
        for _, m in mt.experts_modules(model):
            m._moe_ep.transport = transport
        row = dict(group="d", row=f"(d) moe-ep (lockstep), transport {transport}" +
                   (f", {args.label}" if args.label else ""), ranks=world, threads=threads,
                   launcher=_launcher(), loader=loader)
        tokens, t_pre, t_dec = serve(model, ids, meta, group, repeat=args.repeat,
                                     step_ctx=lambda: mt.lockstep(model, comm))
        record(args, meta, group, row, tokens, t_pre, t_dec, load_peak, load_rss,
               prompts.shape[0], slice(rank * B, (rank + 1) * B))


# --------------------------------------------------------------------------------------------
# Every row group in one launch (the smoke test: one interpreter start per rank).

def cmd_smoke(args) -> None:
    """Under mpirun -n W: rank 0 makes the tiny checkpoint and runs (a); then every rank runs
    (b) (transformers' EP on the gloo group that torchrun would have made, here from mpirun's
    ranks), (c) and (d) shm and mpi, one after the other in the same processes."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    os.environ["HF_SBS_LAUNCHER"] = "mpirun (smoke, one launch)"
    ns = argparse.Namespace
    if rank == 0:
        cmd_make(ns(dir=args.dir, smoke=True, world=world, seed=0, layers=None, hidden=None,
                    experts=None, top_k=None, expert_ffn=None, prompts=None, prompt_len=None,
                    steps=None, vocab=None))
        cmd_single(ns(dir=args.dir, impl="grouped_mm,batched_mm", reference=True, threads=1,
                      repeat=1))
    comm.Barrier()
    init_torch_distributed(None, args.port)
    common = dict(dir=args.dir, threads=1, repeat=1)
    cmd_hf_ep(ns(ep_mode="ep", keep_group=True, **common))
    cmd_a2a(ns(master_addr=None, port=args.port, label="", keep_group=True, **common))
    cmd_moe_ep(ns(transport="shm,mpi", loader="auto", label="", **common))


# --------------------------------------------------------------------------------------------
# The table.

def meta_date(d: str) -> str:
    """The day the checkpoint (and so the run) was made."""
    when = os.path.getmtime(os.path.join(d, "bench.json"))
    return time.strftime("%Y-%m-%d", time.localtime(when))


def _commit() -> str:
    """The checkout's commit (with "+" when its tracked files differ from it), or "?"."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--"],
                               capture_output=True).returncode != 0
        return head + ("+" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def machine_line(d: str, rows) -> str:
    import platform

    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _status_meminfo_kib("MemTotal") / 2**20
    commit = load_meta(d).get("commit") or _commit()
    versions = []
    for mod in ("torch", "transformers"):
        try:
            versions.append(f"{mod} {__import__(mod).__version__}")
        except ImportError:
            pass
    return (f"Measured {meta_date(d)} on commit {commit}: {cpu}, "
            f"{os.cpu_count()} CPUs, {mem:.0f} GiB, Linux {platform.release()}, "
            f"{', '.join(versions)}. Times: the best of the timed runs after a warm-up, each the "
            f"slowest rank's; tok/s counts every rank's tokens. CPUs busy: the row's processes' "
            f"CPU time and the rest of the machine's during the timed runs, over their wall "
            f"time (of {os.cpu_count()}).")


STAR = "\\*"  # a footnote mark, escaped for Markdown


def cmd_table(args) -> None:
    meta = load_meta(args.dir)
    rows, notes = [], []
    with open(os.path.join(args.dir, "results.jsonl")) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    W = meta["world"]
    out = [f"Checkpoint: {describe(meta)} ({meta['expert_mib']:.0f} MiB of experts, "
           f"{meta['other_mib']:.0f} MiB else). W = {W}: {W} x {meta['prompts']} prompts of "
           f"{meta['prompt_len']} tokens, {meta['steps']} greedy decode steps.",
           "", machine_line(args.dir, rows), "",
           "| row | launcher | ranks x threads | prefill tok/s | decode tok/s | peak RSS/rank "
           "serving (MiB) | peak RSS/rank incl. load (MiB) | weights loaded | CPUs busy: row, "
           "others | tokens match (a) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['row']} | {r['launcher']} | {r['ranks']} x {r['threads']} | - | - "
                       f"| - | - | {r.get('loader', '')} | - | cannot run: "
                       f"{r['error'].replace('|', '/')} |")
            continue
        match = r["match"] + (" (reference)" if r.get("reference") else "")
        busy = f"{r['own_cpus']:.1f}, {r['others_cpus']:.1f}" if "own_cpus" in r else "?"
        prefill = f"{r['prefill_tok_s']:.0f}"
        if r.get("prefill_impl"):
            notes.append(r["note"])
            prefill = f"({prefill}, {r['prefill_impl']})" + STAR * len(notes)

        out.append(f"| {r['row']} | {r['launcher']} | {r['ranks']} x {r['threads']} | "
                   f"{prefill} | {r['decode_tok_s']:.1f} | "
                   f"{r['serve_peak_mib']:.0f} | {r['load_peak_mib']:.0f} | {r.get('loader', '')} "
                   f"| {busy} | {match} |")
    if notes:
        out.append("")
        out += [STAR * (i + 1) + f" {n}." for i, n in enumerate(notes)]
    text = "\n".join(out)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--dir", required=True, help="the checkpoint directory (make's)")
        sp.add_argument("--threads", type=int, default=None,
                        help="torch threads per process (default: torch's)")
        sp.add_argument("--repeat", type=int, default=1,
                        help="timed runs after the warm-up; the best one's times are reported")
        return sp

    m = sub.add_parser("make")
    m.add_argument("--dir", required=True)
    m.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    m.add_argument("--world", type=int, default=4)
    m.add_argument("--seed", type=int, default=0)
    for key in ("layers", "hidden", "experts", "top_k", "expert_ffn", "prompts", "prompt_len",
                "steps", "vocab"):
        m.add_argument("--" + key.replace("_", "-"), dest=key, type=int, default=None)
    s = common(sub.add_parser("single"))
    s.add_argument("--impl", default="grouped_mm",
                   help="grouped_mm, batched_mm, or both comma-separated (one row each)")
    s.add_argument("--reference", action="store_true",
                   help="save this row's tokens as the reference the other rows compare with")
    b = common(sub.add_parser("hf-ep"))
    b.add_argument("--ep-mode", default="ep", choices=["ep", "tp+ep", "dp+ep"])
    c = common(sub.add_parser("a2a"))
    c.add_argument("--master-addr", default=None,
                   help="under mpirun: rank 0's host address (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=29517)
    c.add_argument("--label", default="")
    d = common(sub.add_parser("moe-ep"))
    d.add_argument("--transport", default="shm",
                   help="shm, mpi, or both comma-separated (one row each)")
    d.add_argument("--loader", default="auto", choices=["auto", "full"],
                   help="auto: moe_ep.transformers.from_pretrained when it exists")
    d.add_argument("--label", default="")
    sm = sub.add_parser("smoke")
    sm.add_argument("--dir", required=True)
    sm.add_argument("--port", type=int, default=29523)
    t = sub.add_parser("table")
    t.add_argument("--dir", required=True)
    t.add_argument("--out", default=None)
    args = p.parse_args(argv)
    _quiet()
    {"make": cmd_make, "single": cmd_single, "hf-ep": cmd_hf_ep, "a2a": cmd_a2a,
     "moe-ep": cmd_moe_ep, "smoke": cmd_smoke, "table": cmd_table}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
