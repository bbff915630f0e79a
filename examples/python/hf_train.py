"""Training a Hugging Face transformers MoE model expert-parallel through moe-ep, checked against
single-process training on the concatenated batch.

Run (any world size W that divides the model's experts):

    mpirun -n 4 --oversubscribe python examples/python/hf_train.py
    mpirun -n 2 python examples/python/hf_train.py --model mixtral --steps 10

Without --checkpoint, rank 0 writes a small seeded random checkpoint (python -m
moe_ep.transformers.make_checkpoint --small). Each rank loads only its experts
(moe_ep.transformers.from_pretrained) and trains on its own batch (--batch sequences of --seq
tokens, next-token loss; with --uneven, odd ranks one sequence more, the loss weighted by
moe_ep.torch.nn.token_weight). After backward, moe_ep.transformers.average_gradients averages the
replicated (non-expert) gradients over the ranks with an MPI allreduce and divides the expert
gradients, which live on their rank only and already hold every rank's tokens' share, by W; then
AdamW (or --optimizer sgd) steps. Every rank also trains the whole model in one process, with transformers' stock
experts, on the concatenated batch of all ranks, and checks that the losses and its final
parameters (its expert slices and every non-expert tensor) match within --tol. Last line
PASS/FAIL.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from mpi4py import MPI

import moe_ep.transformers as mt
from moe_ep.torch.nn import token_weight
from moe_ep.transformers.make_checkpoint import small_for_ranks
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging


def batch(step: int, rank: int, size: int, seq: int, vocab: int):
    """size sequences of seq tokens: a random first token, then t -> (5 t + 1) mod vocab, a rule
    the model can learn (so the loss falls)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    ids = torch.empty(size, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (size,), generator=g)
    for t in range(1, seq):
        ids[:, t] = (5 * ids[:, t - 1] + 1) % vocab
    return ids


def train(model, batches, optimizer: str, lr: float, after_backward=None, weight=1.0):
    """Optimizer steps on the given batches; returns the losses. (AdamW is nearly blind to a
    gradient's scale; SGD is not, so it also checks that the expert gradients are scaled right.)"""
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        (loss * weight).backward()
        if after_backward is not None:
            after_backward()
        opt.step()
        losses.append(loss.detach() * weight)
    return losses


def local_reference(model, stock) -> dict:
    """The stock model's tensors as this rank holds them: its experts' slices of the per-expert
    parameters, the rest whole."""
    experts = {name: m for name, m in mt.experts_modules(model)}
    out = {}
    stock_params = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        ref = stock_params[name]
        owner = name.rsplit(".", 1)[0]
        if owner in experts:
            ep = experts[owner]._moe_ep
            ref = ref[ep.start:ep.stop]
        out[name] = ref
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-moe")
    ap.add_argument("--checkpoint")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=16, help="tokens per sequence")
    ap.add_argument("--optimizer", default="adamw",
                    help="adamw or sgd (momentum 0.9); a comma list runs each in turn")
    ap.add_argument("--lr", default="1e-3", help="learning rate; a comma list: one per optimizer")
    ap.add_argument("--loader", default="moe_ep",
                    help="moe_ep: moe_ep.transformers.from_pretrained (this rank's experts only); "
                         "stock: transformers' from_pretrained(..., experts_implementation="
                         "'moe_ep'), cut at the first call; a comma list: one per optimizer")
    ap.add_argument("--uneven", action="store_true",
                    help="odd ranks get one sequence more per step (token_weight evens it out)")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args(argv)
    hf_logging.disable_progress_bar()
    optimizers, rates = a.optimizer.split(","), [float(x) for x in a.lr.split(",")]
    loaders = a.loader.split(",")
    rates *= len(optimizers) if len(rates) == 1 else 1
    loaders *= len(optimizers) if len(loaders) == 1 else 1
    if len(rates) != len(optimizers) or len(loaders) != len(optimizers) or \
            not set(optimizers) <= {"adamw", "sgd"} or not set(loaders) <= {"moe_ep", "stock"}:
        ap.error(f"--optimizer {a.optimizer!r} (adamw, sgd), --lr {a.lr!r} and --loader "
                 f"{a.loader!r} (moe_ep, stock) do not pair up")
    comm = MPI.COMM_WORLD
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = a.checkpoint or small_for_ranks(comm, a.model, tmp)
        for optimizer, lr, loader in zip(optimizers, rates, loaders):
            ok = run(comm, a, path, optimizer, lr, loader) and ok
    if comm.Get_rank() == 0 and len(optimizers) > 1:
        print(f"{'PASS' if ok else 'FAIL'}: all runs")
    return 0 if ok else 1


def run(comm, a, path: str, optimizer: str, lr: float, loader: str) -> bool:
    """Trains with moe-ep on W ranks and in one process; rank 0 reports. True when they match."""
    rank, world = comm.Get_rank(), comm.Get_size()
    if loader == "moe_ep":
        model = mt.from_pretrained(path, comm, dtype=torch.float32).train()
    else:  # every expert loaded, cut to this rank's at the first forward (after the optimizer)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     experts_implementation="moe_ep").train()
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 experts_implementation="grouped_mm").train()
    vocab = model.config.get_text_config().vocab_size

    sizes = [a.batch + (r % 2 if a.uneven else 0) for r in range(world)]
    mine = [batch(s, rank, sizes[rank], a.seq, vocab) for s in range(a.steps)]
    # Each rank's loss is the mean over its own label tokens; weighted by W * n_r / N it makes the
    # averaged gradients those of the mean over all ranks' tokens (1.0 when the counts are equal).
    weight = token_weight(sizes[rank] * (a.seq - 1), comm)
    ours = train(model, mine, optimizer, lr, lambda: mt.average_gradients(model, comm), weight)
    ours = [comm.allreduce(float(l), op=MPI.SUM) / world for l in ours]

    whole = [torch.cat([batch(s, r, sizes[r], a.seq, vocab) for r in range(world)])
             for s in range(a.steps)]
    expected = [float(l) for l in train(stock, whole, optimizer, lr)]

    loss_err = max(abs(o - e) / max(1.0, abs(e)) for o, e in zip(ours, expected))
    reference = local_reference(model, stock)
    param_err, worst = 0.0, ""
    for name, p in model.named_parameters():
        err = (p.detach() - reference[name].detach()).abs().max().item()
        if err > param_err:
            param_err, worst = err, name
    ok = loss_err <= a.tol and param_err <= a.tol and ours[-1] < ours[0]
    errs = comm.gather((loss_err, param_err, worst), root=0)
    ok = comm.allreduce(int(ok), op=MPI.MIN) == 1
    if rank == 0:
        print(f"hf_train.py: W = {world}, {path}, fp32, {optimizer} lr {lr}, {a.steps} steps, "
              f"{sizes} x {a.seq} tokens per rank per step, loader {loader}")
        print(" step   loss (moe-ep, W ranks)   loss (stock, 1 process)   diff")
        for s, (o, e) in enumerate(zip(ours, expected)):
            print(f"{s:5d}   {o:22.9g}   {e:23.9g}   {abs(o - e):9.2e}")
        for r, (le, pe, name) in enumerate(errs):
            print(f"rank {r}: worst loss difference {le:.2e}, worst parameter difference {pe:.2e}"
                  f" ({name or '-'}), bound {a.tol:g}")
        print("PASS" if ok else "FAIL")
    return ok


if __name__ == "__main__":
    sys.exit(main())
