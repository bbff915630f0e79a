"""Hugging Face transformers MoE models, expert-parallel through moe-ep (pip install .[transformers]).

Importing this module registers the experts implementation "moe_ep", so

    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_ep")

runs every MoE layer as dispatch_v2 -> this rank's experts -> combine_v2 (each rank keeps only
its experts' slices, cut at the first call), and

    model = moe_ep.transformers.from_pretrained(path, comm)

builds the model without its expert weights and reads only this rank's experts from the
safetensors checkpoint. lockstep(model, comm) lets ranks run their own sequences (data-parallel
attention) with different lengths and token counts, 0 included. set_overlap(model) runs each MoE
layer as two micro-batches whose dispatch and combine travel while the other's experts compute. docs/design.md ("Real models").
"""

from moe_ep.transformers._experts import (
    IMPLEMENTATION,
    average_gradients,
    expert_param_names,
    expert_parameters,
    experts_modules,
    is_experts_module,
    moe_ep_experts_forward,
    register,
    set_overlap,
    shard_experts,
)
from moe_ep.transformers._loader import from_pretrained
from moe_ep.transformers._lockstep import lockstep

register()

__all__ = [
    "IMPLEMENTATION",
    "average_gradients",
    "expert_param_names",
    "expert_parameters",
    "experts_modules",
    "from_pretrained",
    "is_experts_module",
    "set_overlap",
    "lockstep",
    "moe_ep_experts_forward",
    "register",
    "shard_experts",
]
