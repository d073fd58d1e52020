"""Sparse upcycling: a dense decoder -> a mixture-of-experts decoder computing the same function.

Every dense MLP is copied into E identical experts (expert width = the dense
intermediate_size) and gets a router `mlp.gate` [E, hidden] drawn N(0, router_std^2) from one
seeded generator (layers in order). Routing is top-k with the k probabilities renormalized
(norm_topk_prob), so for every token
    y = sum_{e in S} w_e * expert_e(x) = (sum_{e in S} w_e) * mlp(x) = mlp(x)
in exact arithmetic: the upcycled model equals the dense one up to float rounding (the k
weighted copies summed, sum w_e = 1 within an ulp), whatever the router says. Training then
makes the experts differ; until it does, the router's gradient is zero (the output does not
depend on the weights, only on their sum).

Family: a Llama model becomes Mixtral (Llama attention + MoE MLPs); a Qwen3 model becomes
Qwen3-MoE. Llama does not become Qwen3-MoE: that family adds RMSNorm on q and k, a different
function.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from qarl.model.config import ModelConfig
from qarl.model.decoder import CausalLM
from qarl.model.loading import build_model

UPCYCLED_FAMILY = {"llama": "mixtral", "qwen3": "qwen3_moe"}
_DENSE_MLP = re.compile(r"(model\.layers\.\d+\.mlp)\.(gate_proj|up_proj|down_proj)\.weight")


def upcycled_config(config: ModelConfig, num_experts: int, top_k: int) -> ModelConfig:
    """`config` with a MoE MLP of `num_experts` experts as wide as its dense MLP in every layer."""
    if config.family not in UPCYCLED_FAMILY:
        raise ValueError(f"cannot upcycle a {config.family} model; upcycling turns "
                         f"{sorted(UPCYCLED_FAMILY)} models into {UPCYCLED_FAMILY}")
    moe = copy.deepcopy(config)
    moe.family = UPCYCLED_FAMILY[config.family]
    moe.num_experts, moe.num_experts_per_tok = num_experts, top_k
    moe.moe_intermediate_size, moe.norm_topk_prob = config.intermediate_size, True
    moe.decoder_sparse_step, moe.mlp_only_layers = 1, []
    moe.__post_init__()  # validate the MoE fields set above
    return moe


def upcycle(dense: CausalLM, num_experts: int, top_k: int, seed: int,
            router_std: float = 0.02) -> CausalLM:
    """The MoE model of `dense` (module docstring): experts copied, routers seeded; `dense`
    is left unchanged and shares no storage with the result."""
    config = upcycled_config(dense.config, num_experts, top_k)
    dtype = dense.model.embed_tokens.weight.dtype
    state = {}
    for name, tensor in dense.state_dict().items():
        match = _DENSE_MLP.fullmatch(name)
        if match is None:
            state[name] = tensor.detach().clone()
            continue
        for e in range(num_experts):
            state[f"{match[1]}.experts.{e}.{match[2]}.weight"] = tensor.detach().clone()
    generator = torch.Generator().manual_seed(seed)
    for layer in config.moe_layers:
        router = torch.randn(num_experts, config.hidden_size, generator=generator) * router_std
        state[f"model.layers.{layer}.mlp.gate.weight"] = router.to(dtype)  # [E, hidden]
    return build_model(config, state, dtype, source=Path("<upcycled>"))
