"""The decoder: Llama / Qwen2 / Qwen3 dense transformers and Qwen3-MoE (sparse MLPs in
`qarl.model.moe`), with HF parameter names.

Parameter names match Hugging Face (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`)
so a HF state dict loads with no renaming. Every projection is a plain `nn.Linear`: the
quantization package swaps them; this module knows nothing about quantization or RL.

`forward` returns hidden states, not logits, so callers can apply `lm_head` in chunks
(a [N, L, vocab] fp32 tensor for a 49k vocabulary is the largest thing in a training step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import ContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qarl.model.cache import KVCache, SharedPrefixCache
from qarl.model.config import ModelConfig
from qarl.model.mlp import MLP
from qarl.model.moe import Routing, SparseMoeBlock, routing_scope
from qarl.model.packing import Packing, SharedPrompts


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # y = w * x / sqrt(mean(x^2) + eps), computed in fp32 as HF does, cast back after.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> Tensor:  # [head_dim / 2] float32
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def positions_from_mask(mask: Tensor) -> Tensor:  # mask [N, S] bool -> [N, S] int64
    """RoPE positions that skip left padding: row b's first real token has position 0. The
    one rule for the engine and the learner, so both rotate every token by the same angle."""
    return (mask.long().cumsum(dim=1) - 1).clamp_min(0)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [B, H, T, D]; cos/sin: [B, 1, T, D]. Non-interleaved (HF "rotate_half") layout.
    return x * cos + rotate_half(x) * sin


def attention_mask(
    key_mask: Tensor | None, query_start: int, num_queries: int, num_keys: int, device
) -> Tensor | None:  # [B or 1, 1, T, S] bool, True = may attend
    """Causal mask for queries at cache slots query_start.. over keys 0..num_keys-1, and
    padding: keys where key_mask [B, S] is False are never attended. A padding query attends
    to itself only, so no row is empty (its output is never used)."""
    if key_mask is None and query_start == 0 and num_queries == num_keys:
        return None  # plain causal: SDPA's is_causal path
    q_slot = torch.arange(query_start, query_start + num_queries, device=device)
    k_slot = torch.arange(num_keys, device=device)
    mask = (k_slot[None, :] <= q_slot[:, None])[None, None]  # [1, 1, T, S]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :num_keys]
        mask = mask | (k_slot[None, :] == q_slot[:, None])[None, None]
    return mask


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.q_proj = nn.Linear(d, config.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, cache_start: int,
                packing: Packing | SharedPrompts | None = None):
        # x: [B, T, hidden], or [n, hidden] under `packing` (rows back to [B, T] for attention)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if isinstance(packing, SharedPrompts):
            return self.o_proj(packing.attention(self.attend, q, k, v, cache, layer))
        return self.o_proj(self.attend(q, k, v, cos, sin, mask, cache, layer, cache_start, packing))

    def attend(self, q, k, v, cos, sin, mask, cache: KVCache | None, layer: int,
               cache_start: int, packing: Packing | None) -> Tensor:
        """Attention of projected q, k, v ([B, T, heads x D], or [n, ...] under `packing`):
        [B, T, heads x D], or [n, ...], the input of o_proj."""
        if packing is not None:
            q, k, v = packing.pad(q), packing.pad(k), packing.pad(v)
        B, T = q.shape[:2]
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(layer, k, v, cache_start)  # [B, Hkv, S, D]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(B, T, -1)
        return out if packing is None else packing.pack(out)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if layer in config.moe_layers:
            self.mlp = SparseMoeBlock(config, moe_index=config.moe_layers.index(layer))
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, mask, cache, layer, cache_start, packing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer, cache_start,
                               packing)
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_forward(
    embed: Callable, layers: Sequence[Callable], norm: Callable, rope: Callable,
    input_ids: Tensor,  # [B, T] int64
    positions: Tensor,  # [B, T] int64 RoPE positions
    cache: KVCache | None, cache_start: int, key_mask: Tensor | None,
    packing: Packing | None = None,
) -> Tensor:  # [B, T, hidden], or [n, hidden] under packing
    """Embed, run each layer (`layer(x, cos, sin, mask, cache, i, cache_start)`) in order, then
    the final norm. `CausalLM.forward` passes its own modules; the rollout engine passes its
    decode plan's per-layer steps (`qarl.rollout.plan`), which compute each Block's math on
    packed weights. `packing`: only those positions (`Packing`; the layers take it as a last
    argument)."""
    B, T = input_ids.shape
    if packing is None:
        x, extra = embed(input_ids), ()
    else:
        x, extra = embed(input_ids.reshape(-1).index_select(0, packing.index)), (packing,)
    cos, sin = rope(positions, x.dtype)
    mask = attention_mask(key_mask, cache_start, T, cache_start + T, input_ids.device)
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, mask, cache, i, cache_start, *extra)
    return norm(x)


@contextmanager
def checkpointed_layers(model: nn.Module, context: Callable[[], ContextManager] | None
                        ) -> Iterator[None]:
    """Gradient checkpointing of `model`'s decoder layers while inside (`context` None: off):
    a forward with gradients keeps only each layer's input and recomputes the layer in
    backward, inside `context()` (and the forward's routing scope), so the recompute runs the
    same computation as the forward. Activation memory of a forward: one layer's instead of
    every layer's; cost: one more forward of the layers in backward."""
    before = model.recompute_context
    model.recompute_context = context
    try:
        yield
    finally:
        model.recompute_context = before


@contextmanager
def _recompute_context(context: Callable[[], ContextManager],
                       routing: Routing | None) -> Iterator[None]:
    with routing_scope(routing), context():
        yield


def _recomputed(layer: nn.Module, context: Callable[[], ContextManager], *args):
    return checkpoint(layer, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), context()))


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder-only language model. `model(...)` gives hidden states; `lm_head` gives logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain fp32 attribute, not a buffer: `.to(torch.bfloat16)` must not round the RoPE
        # frequencies (HF keeps them fp32 too); moved to the positions' device on use.
        self.inv_freq = rope_inverse_frequencies(config)  # [head_dim / 2] float32
        # Gradient checkpointing (`checkpointed_layers`): None = off; else the context each
        # decoder layer's recompute in backward runs in (the gradient pass's own).
        self.recompute_context: Callable[[], ContextManager] | None = None

    def rope(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        # positions: [B, T] int64 -> cos, sin: [B, 1, T, head_dim]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: Tensor,  # [B, T] int64
        positions: Tensor | None = None,  # [B, T] int64 RoPE positions; default 0..T-1
        cache: KVCache | None = None,
        cache_start: int = 0,  # cache slot of input_ids[:, 0]
        key_mask: Tensor | None = None,  # [B, S] bool over slots 0..S-1; False = padding
        routing: Routing | None = None,  # MoE: experts to use, and where the chosen ones go
        packed: Tensor | None = None,  # [B, T] bool: compute only these positions (`Packing`)
        prompts: tuple[Tensor, Tensor, Tensor] | None = None,  # forward_shared: [G x P + n, H]
    ) -> Tensor:  # [B, T, hidden], or [n, hidden]: the `packed` positions, row-major
        if prompts is not None:  # through __call__, so a sharded model's hooks gather weights
            return self._shared_pass(*prompts, input_ids, positions, key_mask, packed, cache)
        B, T = input_ids.shape
        if packed is not None and self.config.moe_layers:
            raise ValueError("a packed forward needs a dense model: a MoE layer routes [B, T] "
                             "rows; call it without `packed`")
        if positions is None:
            positions = torch.arange(cache_start, cache_start + T, device=input_ids.device).expand(B, T)
        body = self.model
        layers = self._layers(routing)
        with routing_scope(routing):
            return decoder_forward(body.embed_tokens, layers, body.norm, self.rope,
                                   input_ids, positions, cache, cache_start, key_mask,
                                   None if packed is None else Packing.of(
                                       packed, None if key_mask is None else
                                       key_mask[:, cache_start : cache_start + T]))

    def _layers(self, routing: Routing | None) -> Sequence[Callable]:
        """The decoder layers, each under gradient checkpointing where that is on."""
        if self.recompute_context is None or not torch.is_grad_enabled():
            return self.model.layers
        context = partial(_recompute_context, self.recompute_context, routing)
        return [partial(_recomputed, layer, context) for layer in self.model.layers]

    def forward_shared(
        self,
        prompt_ids: Tensor,  # [G, P] int64: the distinct prompts
        prompt_positions: Tensor,  # [G, P] int64
        prompt_mask: Tensor,  # [G, P] bool; False = padding
        input_ids: Tensor,  # [B, T] int64: each row's continuation after its prompt
        positions: Tensor,  # [B, T] int64
        key_mask: Tensor,  # [B, P + T] bool over each row's prompt and continuation
        packed: Tensor,  # [B, T] bool: the continuation positions to compute (`Packing`)
        cache: SharedPrefixCache,  # rows[b]: the prompt of row b
    ) -> tuple[Tensor, Tensor]:  # ([G, P, hidden], [n, hidden]: the packed positions)
        """The prompts' forward into `cache`, then the continuation's over it, as one pass
        (`SharedPrompts`): the values of `self(prompt_ids, ..., cache=cache)` and of
        `self(input_ids, ..., cache=cache, cache_start=P, packed=packed)` up to GEMM
        rounding, each per-token op run once on both parts' tokens. A dense model's only (a
        MoE block routes [B, T] rows)."""
        hidden = self(input_ids, positions=positions, cache=cache, key_mask=key_mask,
                      packed=packed, prompts=(prompt_ids, prompt_positions, prompt_mask))
        # split here, outside forward: FSDP hooks a module's outputs, and views of them would
        # lose the hook to any in-place op
        G, P = prompt_ids.shape
        return hidden[: G * P].view(G, P, -1), hidden[G * P :]

    def _shared_pass(self, prompt_ids, prompt_positions, prompt_mask, input_ids, positions,
                     key_mask, packed, cache) -> Tensor:  # [G x P + n, hidden]
        if self.config.moe_layers:
            raise ValueError("a shared-prompt forward needs a dense model: a MoE layer routes "
                             "[B, T] rows; run the prompts, then the continuation")
        (G, P), T = prompt_ids.shape, input_ids.shape[1]
        device = input_ids.device
        packing = Packing.of(packed, key_mask[:, P : P + T])
        body = self.model
        x = torch.cat([body.embed_tokens(prompt_ids).reshape(G * P, -1),
                       body.embed_tokens(input_ids.reshape(-1).index_select(0, packing.index))])
        shared = SharedPrompts(
            prompts=(G, P),
            fill=(*self.rope(prompt_positions, x.dtype),
                  attention_mask(prompt_mask, 0, P, P, device)),
            rest=(*self.rope(positions, x.dtype), attention_mask(key_mask, P, T, P + T, device)),
            packing=packing)
        for i, layer in enumerate(self._layers(None)):
            x = layer(x, None, None, None, cache, i, 0, shared)
        return body.norm(x)

    def logits(self, input_ids: Tensor, **kwargs) -> Tensor:  # [B, T, vocab]
        return self.lm_head(self(input_ids, **kwargs))

    def new_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        c = self.config
        dtype = dtype or self.model.embed_tokens.weight.dtype
        device = self.model.embed_tokens.weight.device
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, max_len, c.head_dim, dtype, device)
