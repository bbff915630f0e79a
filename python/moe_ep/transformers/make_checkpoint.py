"""A seeded random Hugging Face checkpoint of a MoE family, without the hub.

    python -m moe_ep.transformers.make_checkpoint --model qwen3-moe --layers 2 --out DIR

builds the transformers config of the family at the real model's widths (the overrides below
shrink it), initialises the model from a seed (torch.manual_seed, then from_config in the
requested dtype: no fp32 copy first) and writes it with save_pretrained as safetensors. In
transformers 5 save_pretrained writes the experts in the legacy per-expert layout
(model.layers.0.mlp.experts.3.gate_proj.weight) except for families stored fused (GPT-OSS);
moe_ep.transformers.from_pretrained reads both. The last line printed gives the sizes, also
written to DIR/moe_ep_sizes.json: non-expert bytes and expert bytes (the experts modules'
per-expert parameters), which the loader's memory bound is stated in.

Families and their defaults (the real models):
  qwen3-moe    Qwen3-30B-A3B:   H 2048, 128 experts, top-8, expert FFN 768, 32 heads (4 KV,
                                head_dim 128), vocab 151936
  mixtral      Mixtral-8x7B:    H 4096, 8 experts, top-2, expert FFN 14336, 32 heads (8 KV),
                                vocab 32000
  olmoe        OLMoE-1B-7B:     H 2048, 64 experts, top-8, expert FFN 1024, 16 heads,
                                vocab 50304
  deepseek-v3  DeepSeek-V3:     H 7168, 256 routed experts + 1 shared, top-8, expert FFN 2048,
                                MLA (q_lora 1536, kv_lora 512), 128 heads, vocab 129280; the
                                first min(3, layers - 1) layers dense, so at least one is MoE
  gpt-oss      GPT-OSS-20B:     H 2880, 32 experts, top-4, expert FFN 2880, 64 heads (8 KV,
                                head_dim 64), vocab 201088, alternating sliding/full attention
--small: 2 layers, H 64, 8 experts, top-2, expert FFN 32, 4 heads (2 KV, head_dim 16), vocab
512 (the tests' size); explicit options override it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

FAMILIES = ("qwen3-moe", "mixtral", "olmoe", "deepseek-v3", "gpt-oss")

# The real models' widths, as config fields (what the config classes' defaults lack).
_REAL: Dict[str, dict] = {
    "qwen3-moe": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_local_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, vocab_size=151936, norm_topk_prob=True,
                      rms_norm_eps=1e-6, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                    num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=32000, rms_norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "olmoe": dict(hidden_size=2048, intermediate_size=1024, num_experts=64, num_experts_per_tok=8,
                  num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                  rms_norm_eps=1e-5),
    "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, n_group=8, topk_group=4, vocab_size=129280),
    "gpt-oss": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                    num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, vocab_size=201088, sliding_window=128),
}

# Each option's config field per family (None: the family has no such field).
_EXPERTS_FIELD = {"qwen3-moe": "num_local_experts", "mixtral": "num_local_experts",
                  "olmoe": "num_experts", "deepseek-v3": "n_routed_experts",
                  "gpt-oss": "num_local_experts"}
_MOE_FFN_FIELD = {"qwen3-moe": "moe_intermediate_size", "mixtral": "intermediate_size",
                  "olmoe": "intermediate_size", "deepseek-v3": "moe_intermediate_size",
                  "gpt-oss": "intermediate_size"}
_DENSE_FFN_FIELD = {"qwen3-moe": "intermediate_size", "deepseek-v3": "intermediate_size"}

SMALL = dict(layers=2, hidden=64, experts=8, top_k=2, moe_ffn=32, ffn=128, heads=4, kv_heads=2,
             head_dim=16, vocab=512)


def _config_class(model: str):
    import transformers

    return {"qwen3-moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
            "olmoe": transformers.OlmoeConfig, "deepseek-v3": transformers.DeepseekV3Config,
            "gpt-oss": transformers.GptOssConfig}[model]


def build_config(model: str, layers: int, *, hidden: Optional[int] = None,
                 experts: Optional[int] = None, top_k: Optional[int] = None,
                 moe_ffn: Optional[int] = None, ffn: Optional[int] = None,
                 heads: Optional[int] = None, kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, vocab: Optional[int] = None,
                 tie_embeddings: bool = False):
    """The transformers config of family `model` (one of FAMILIES) with `layers` decoder layers:
    the real model's widths, each given option overriding its field."""
    if model not in FAMILIES:
        from moe_ep import InvalidArgumentError

        raise InvalidArgumentError(f"make_checkpoint: model = {model!r} is not one of {FAMILIES}")
    if layers < 1:
        from moe_ep import InvalidArgumentError

        raise InvalidArgumentError(f"make_checkpoint: layers = {layers} must be >= 1")
    fields = dict(_REAL[model])
    fields["num_hidden_layers"] = layers
    fields["tie_word_embeddings"] = bool(tie_embeddings)
    if hidden is not None:
        fields["hidden_size"] = hidden
    if experts is not None:
        fields[_EXPERTS_FIELD[model]] = experts
    if top_k is not None:
        fields["num_experts_per_tok"] = top_k
    if moe_ffn is not None:
        fields[_MOE_FFN_FIELD[model]] = moe_ffn
    if ffn is not None and model in _DENSE_FFN_FIELD:
        fields[_DENSE_FFN_FIELD[model]] = ffn
    if heads is not None:
        fields["num_attention_heads"] = heads
        fields["num_key_value_heads"] = min(fields["num_key_value_heads"], heads)
    if kv_heads is not None:
        fields["num_key_value_heads"] = kv_heads
    if vocab is not None:
        fields["vocab_size"] = vocab
    if model == "deepseek-v3":
        # MLA: head_dim sets the per-head widths (nope 2x, rope 1x, value 2x); at least one MoE
        # layer; the routing groups must split the experts evenly.
        fields["first_k_dense_replace"] = min(3, layers - 1)
        fields["num_key_value_heads"] = fields["num_attention_heads"]  # MLA: one KV per head
        if head_dim is not None:
            fields.update(qk_nope_head_dim=2 * head_dim, qk_rope_head_dim=head_dim,
                          v_head_dim=2 * head_dim, head_dim=head_dim,
                          kv_lora_rank=4 * head_dim, q_lora_rank=8 * head_dim)
        e = fields["n_routed_experts"]
        if e % fields["n_group"] or e // fields["n_group"] < 2 \
                or fields["topk_group"] * (e // fields["n_group"]) < fields["num_experts_per_tok"]:
            fields.update(n_group=1, topk_group=1)
    elif head_dim is not None:
        fields["head_dim"] = head_dim
    if model == "gpt-oss":
        fields["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(layers)]
    return _config_class(model)(**fields)


def _dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


def sizes(model) -> Dict[str, int]:
    """Bytes of the model's parameters and persistent buffers (shared storage counted once):
    expert (the experts modules' per-expert parameters) and non-expert (everything else)."""
    from moe_ep.transformers._experts import expert_param_names, experts_modules

    expert_ids = set()
    for _, module in experts_modules(model):
        for p in expert_param_names(module):
            expert_ids.add(id(getattr(module, p)))
    seen = set()
    expert = non_expert = 0
    for _, t in list(model.named_parameters()) + list(model.state_dict(keep_vars=True).items()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in expert_ids:
            expert += t.numel() * t.element_size()
        else:
            non_expert += t.numel() * t.element_size()
    return {"non_expert_bytes": non_expert, "expert_bytes": expert}


def make_checkpoint(model: str, layers: int, out: str, *, dtype: str = "bf16", seed: int = 0,
                    max_shard_size: str = "50GB", **widths) -> Dict[str, object]:
    """Writes the checkpoint (config.json, model*.safetensors, moe_ep_sizes.json) into out;
    returns what moe_ep_sizes.json holds."""
    import torch
    from transformers import AutoModelForCausalLM

    config = build_config(model, layers, **widths)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config, dtype=_dtype(dtype))
    info: Dict[str, object] = dict(model=model, layers=layers, dtype=dtype, seed=seed,
                                   num_experts=config.num_local_experts, **sizes(net))
    os.makedirs(out, exist_ok=True)
    net.save_pretrained(out, max_shard_size=max_shard_size)
    with open(os.path.join(out, "moe_ep_sizes.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    return info


def small_for_ranks(comm, model: str, directory: str) -> str:
    """A small fp32 checkpoint of the family (--small) that rank 0 of comm writes under
    directory; returns its path on every rank (the examples' and tests' checkpoint)."""
    path = os.path.join(directory, model)
    if comm.Get_rank() == 0:
        widths = dict(SMALL)
        make_checkpoint(model, widths.pop("layers"), path, dtype="fp32", **widths)
    return comm.bcast(path, root=0)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moe_ep.transformers.make_checkpoint",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=FAMILIES)
    ap.add_argument("--layers", type=int, help="decoder layers (default 2)")
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--small", action="store_true",
                    help="the tests' size: 2 layers, H 64, 8 experts, top-2, vocab 512")
    ap.add_argument("--hidden", type=int, help="hidden size H")
    ap.add_argument("--experts", type=int, help="routed experts E")
    ap.add_argument("--top-k", type=int, help="experts per token")
    ap.add_argument("--moe-ffn", type=int, help="each expert's FFN width")
    ap.add_argument("--ffn", type=int, help="the dense MLP's FFN width (qwen3-moe, deepseek-v3)")
    ap.add_argument("--vocab", type=int, help="vocabulary size")
    ap.add_argument("--heads", type=int, help="attention heads")
    ap.add_argument("--kv-heads", type=int, help="key/value heads")
    ap.add_argument("--head-dim", type=int, help="per-head width (deepseek-v3: the rope part)")
    ap.add_argument("--tie-embeddings", action="store_true",
                    help="tie lm_head to the input embeddings (not saved twice)")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default="50GB",
                    help="save_pretrained's max_shard_size (smaller: several files and an index)")
    args = ap.parse_args(argv)

    widths = dict(SMALL) if args.small else {}
    layers = widths.pop("layers", 2)
    if args.layers is not None:
        layers = args.layers
    for key in ("hidden", "experts", "top_k", "moe_ffn", "ffn", "heads", "kv_heads", "head_dim",
                "vocab"):
        value = getattr(args, key)
        if value is not None:
            widths[key] = value
    info = make_checkpoint(args.model, layers, args.out, dtype=args.dtype, seed=args.seed,
                           max_shard_size=args.max_shard_size,
                           tie_embeddings=args.tie_embeddings, **widths)
    print(f"{args.out}: {args.model}, {layers} layers, {info['num_experts']} experts, "
          f"{args.dtype}, seed {args.seed}")
    print(f"non-expert bytes {info['non_expert_bytes']}, expert bytes {info['expert_bytes']} "
          f"({info['non_expert_bytes'] / 2**20:.1f} MiB + {info['expert_bytes'] / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
