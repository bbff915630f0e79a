"""Greedy generation with a Hugging Face transformers MoE model, expert-parallel through moe-ep:
each rank holds only its experts (moe_ep.transformers.from_pretrained reads only those from the
checkpoint) and runs its own prompts through attention (data-parallel attention); the MoE layers
exchange tokens with dispatch_v2 / combine_v2.

Run (any world size W that divides the model's experts):

    mpirun -n 4 --oversubscribe python examples/python/hf_generate.py
    mpirun -n 4 --oversubscribe python examples/python/hf_generate.py --model gpt-oss
    mpirun -n 2 python examples/python/hf_generate.py --checkpoint DIR --dtype bf16

Without --checkpoint, rank 0 writes a small seeded random one (python -m
moe_ep.transformers.make_checkpoint --small) into a temporary directory. Rank r gets
--prompts prompts whose lengths differ from rank to rank (and within the rank: left-padded),
--idle-rank gives one rank none, --new-tokens-step makes rank r generate fewer tokens than rank 0.
--overlap on,off runs each MoE layer as two overlapped micro-batches, then as one batch, and
reports the tokens/s of each.

The check, on every rank: in fp32, the generated tokens equal those of single-process
transformers with the stock experts implementation (grouped_mm) on the same prompts, token for
token; in bf16, the first step's logits differ from fp32's by no more than stock bf16's do
(twice that, plus 1e-3 of their scale: the two sum in different orders). The last line is
PASS/FAIL with tokens/s and the peak RSS of each rank (measured before the reference model is
loaded). The table gives each rank's RSS before loading, its peak up to the end of loading, and
that peak over the weights the rank holds (non-expert + its experts); --rss-bound 1.2 makes that
ratio part of the check (for real-width checkpoints, e.g. make_checkpoint --model qwen3-moe
--layers 2 --out DIR, then --checkpoint DIR --dtype bf16 --no-reference --rss-bound 1.2).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time

import torch
from mpi4py import MPI

import moe_ep.transformers as mt
from moe_ep.transformers.make_checkpoint import small_for_ranks
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --dtype's names
OVERLAP = {"off": False, "on": True, "split": "split"}  # --overlap's names


def memory_mib(field: str) -> float:
    """/proc/self/status's VmRSS (resident now) or VmHWM (its peak since the last reset), MiB;
    ru_maxrss where /proc has neither."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def reset_peak() -> None:
    """Starts VmHWM again from the current RSS (Linux: clear_refs 5), so that each run of one
    launch reports its own peak, not an earlier run's reference models."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass


def prompts(rank: int, count: int, vocab: int, seed: int):
    """count prompts for this rank, lengths 4 + 3 * rank + 2 * i, left-padded with an attention
    mask (pad id 0, never generated unmasked)."""
    g = torch.Generator().manual_seed(seed + rank)
    lengths = [4 + 3 * rank + 2 * i for i in range(count)]
    width = max(lengths, default=0)
    ids = torch.zeros(count, width, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def generate(model, ids, mask, new_tokens: int):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def first_logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits[:, -1].float()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-moe",
                    help="family of the generated checkpoint (make_checkpoint --model); a comma "
                         "list runs each in turn")
    ap.add_argument("--checkpoint", help="a local checkpoint directory (default: a small one)")
    ap.add_argument("--dtype", default="fp32", help="fp32 or bf16; a comma list runs each")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--new-tokens-step", type=int, default=0,
                    help="rank r generates new_tokens - r * this many")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per rank")
    ap.add_argument("--idle-rank", type=int, default=-1, help="this rank gets no prompts")
    ap.add_argument("--transport", choices=("", "shm", "mpi"), default="")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the single-process check (large checkpoints)")
    ap.add_argument("--rss-bound", type=float, default=0.0,
                    help="also fail when a rank's peak RSS up to the end of loading exceeds this "
                         "many times its weights (non-expert + its experts); 0: not checked")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overlap", default="off",
                    help="off (one batch per MoE layer), on (two micro-batches whose dispatch "
                         "and combine travel while the other's experts compute) or split (the "
                         "same two one after the other); a comma list runs each "
                         "(moe_ep.transformers.set_overlap)")
    a = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    comm = MPI.COMM_WORLD
    ok = True
    overlaps = a.overlap.split(",")
    for name in overlaps:
        if name not in OVERLAP:
            ap.error(f"--overlap {name!r} is not one of {', '.join(OVERLAP)}")
    for dtype_name in a.dtype.split(","):
        if dtype_name not in DTYPES:
            ap.error(f"--dtype {dtype_name!r} is not one of {', '.join(DTYPES)}")
        for family in [None] if a.checkpoint else a.model.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                path = a.checkpoint or small_for_ranks(comm, family, tmp)
                for overlap in overlaps:
                    ok = run(comm, a, path, dtype_name, overlap) and ok
    runs = len(a.dtype.split(",")) * len(a.model.split(",")) * len(overlaps)
    if comm.Get_rank() == 0 and runs > 1:
        print(f"{'PASS' if ok else 'FAIL'}: all runs")
    return 0 if ok else 1


def run(comm, a, path: str, dtype_name: str, overlap: str) -> bool:
    """One checkpoint in one dtype: load, generate on every rank, check; rank 0 reports."""
    rank, world = comm.Get_rank(), comm.Get_size()
    reset_peak()
    rss_before = memory_mib("VmRSS")
    model = mt.from_pretrained(path, comm, dtype=DTYPES[dtype_name], transport=a.transport)
    rss_loaded = memory_mib("VmHWM")
    mt.set_overlap(model, OVERLAP[overlap], comm)
    vocab = model.config.get_text_config().vocab_size
    count = 0 if rank == a.idle_rank else a.prompts
    ids, mask = prompts(rank, count, vocab, a.seed)
    new_tokens = max(1, a.new_tokens - rank * a.new_tokens_step)

    out, logits = None, None
    comm.Barrier()
    start = time.perf_counter()
    with torch.no_grad(), mt.lockstep(model, comm):
        if count:
            out = generate(model, ids, mask, new_tokens)
    seconds = time.perf_counter() - start
    with torch.no_grad(), mt.lockstep(model, comm):  # every rank enters; idle ones wait
        if count and dtype_name == "bf16":
            logits = first_logits(model, ids, mask)
    generated = count * new_tokens
    rss_peak = memory_mib("VmHWM")
    sizes = getattr(model, "moe_ep_bytes", {})
    del model

    verdict, detail = True, "no reference (--no-reference)" if count else "no prompts"
    if count and not a.no_reference:
        verdict, detail = check(path, dtype_name, ids, mask, out, logits, new_tokens)
    if a.rss_bound:
        ratio = rss_loaded / ((sizes["non_expert"] + sizes["local_expert"]) / 2**20)
        verdict = verdict and ratio <= a.rss_bound
        detail += f"; RSS after loading / weights {ratio:.3f} (bound {a.rss_bound:g})"
    total_tokens = comm.allreduce(generated)
    slowest = comm.allreduce(seconds, op=MPI.MAX)
    rows = comm.gather((rank, count, new_tokens, generated / seconds if seconds else 0.0,
                        rss_before, rss_loaded, rss_peak, sizes, verdict, detail), root=0)
    ok = comm.allreduce(int(verdict), op=MPI.MIN) == 1
    if rank == 0:
        report(a, world, path, f"{dtype_name}, --overlap {overlap}", rows, total_tokens / slowest,
               ok)
    return ok


def check(path, dtype_name, ids, mask, out, logits, new_tokens):
    """This rank's prompts through single-process transformers, stock experts."""
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 experts_implementation="grouped_mm").eval()
    with torch.no_grad():
        if dtype_name == "fp32":
            expected = generate(stock, ids, mask, new_tokens)
            same = torch.equal(out, expected)
            diverge = (out != expected).nonzero()
            return same, ("tokens equal" if same else
                          f"tokens differ first at (prompt, position) {diverge[0].tolist()}")
        exact = first_logits(stock, ids, mask)
        stock16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                       experts_implementation="grouped_mm").eval()
        stock_err = (first_logits(stock16, ids, mask) - exact).abs().max().item()
    ours_err = (logits - exact).abs().max().item()
    bound = 2 * stock_err + 1e-3 * exact.abs().max().item()
    return ours_err <= bound, (f"first-step logits vs fp32: moe-ep bf16 {ours_err:.3g}, stock "
                               f"bf16 {stock_err:.3g}, bound {bound:.3g}")


def report(a, world, path, dtype_name, rows, tokens_per_s, ok):
    """The table: per rank, RSS before and after loading and at the end (MiB), the weights this
    rank holds (non-expert + its experts) and after-load RSS over them (the issue's bound: 1.2)."""
    print(f"hf_generate.py: W = {world}, {path}, {dtype_name}, greedy, "
          f"--new-tokens {a.new_tokens}")
    print(" rank  prompts  new  tokens/s  RSS before load  after load   peak  weights  "
          "after/weights  check")
    for r, n, new, tps, before, loaded, peak, sizes, verdict, detail in rows:
        weights = (sizes["non_expert"] + sizes["local_expert"]) / 2**20 if sizes else float("nan")
        print(f"{r:5d}  {n:7d}  {new:3d}  {tps:8.1f}  {before:15.1f}  {loaded:10.1f}  "
              f"{peak:5.0f}  {weights:7.1f}  {loaded / weights:13.3f}  {detail}")
    peaks = " ".join(f"{row[6]:.0f}" for row in rows)
    print(f"{'PASS' if ok else 'FAIL'} {tokens_per_s:.1f} tokens/s (all ranks), peak RSS per rank "
          f"{peaks} MiB")


if __name__ == "__main__":
    sys.exit(main())
