"""How a forward lays out its tokens: `Packing` (only some positions of [B, T] rows, packed
into one run) and `SharedPrompts` (distinct prompts and their rows' continuations in one
pass). Per-token ops run on the laid-out tokens; attention alone needs rows
(`qarl.model.decoder.Attention`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qarl.model.cache import SharedPrefixCache


@dataclass(frozen=True)
class Packing:
    """The [B, T] positions a forward computes, packed row-major into one run of n tokens.

    Every per-token op (the projections, the MLP, the norms: most of a layer's FLOPs) runs on
    the n packed tokens only; attention alone needs rows, so it scatters queries, keys and
    values back to [B, T] (other slots zero, never attended: the key mask marks them padding,
    or causality puts them after every packed query) and packs its output again. That is
    verl's "remove padding": a batch of responses of very different lengths (long RL rollouts
    padded to the longest) computes its real tokens, not B x T. Per-token ops are row-wise in
    every format (activation quantizers scale per token or per group of one token), so only
    GEMM rounding differs from the padded pass."""

    index: Tensor  # [n] int64: b * width + t of each computed position, ascending
    batch: int
    width: int

    @classmethod
    def of(cls, keep: Tensor, real: Tensor | None = None) -> "Packing":
        """keep: [B, T] bool, the positions to compute; real: [B, T] bool, the positions that
        are not padding (None: all). A kept position's queries attend every real position
        before it, so each of those must be kept too."""
        if real is not None:
            after = keep.flip(1).cummax(1).values.flip(1)  # [B, T]: at or before a kept one
            holes = real & after & ~keep
            if bool(holes.any()):
                b, t = (int(i) for i in holes.nonzero()[0])
                raise ValueError(
                    f"packed forward: row {b} keeps a position after its position {t}, which "
                    "is neither kept nor padding, so attention would read keys never computed; "
                    "keep every real position before the last kept one of its row")
        return cls(keep.reshape(-1).nonzero().squeeze(1), keep.shape[0], keep.shape[1])

    def pack(self, x: Tensor) -> Tensor:  # [B, T, F] -> [n, F]
        return x.reshape(self.batch * self.width, -1).index_select(0, self.index)

    def pad(self, x: Tensor) -> Tensor:  # [n, F] -> [B, T, F], zeros elsewhere
        out = x.new_zeros(self.batch * self.width, x.shape[-1])
        return out.index_copy(0, self.index, x).view(self.batch, self.width, -1)


@dataclass(frozen=True)
class SharedPrompts:
    """One forward of the distinct prompts and of every row's continuation after its prompt
    (`CausalLM.forward_shared`): the tokens of both, [G x P prompt tokens; n packed
    continuation tokens], go through every per-token op (the projections, the MLP, the
    norms) together, so each layer's weights meet one GEMM of G x P + n rows where a prompt
    forward and a continuation forward over a `SharedPrefixCache` meet two smaller ones (and
    a learner's backward computes each weight's gradient once per micro-batch, at the larger
    height: benchmarks/roofline.py times the update). Attention alone runs per part: the
    prompts among themselves, filling the cache, then the continuation over its prompt's keys
    and its own. Per-token ops are row-wise in every format, so only GEMM rounding differs
    from the two forwards."""

    prompts: tuple[int, int]  # (G, P)
    fill: tuple[Tensor, Tensor, Tensor | None]  # the prompts' cos, sin, attention mask
    rest: tuple[Tensor, Tensor, Tensor | None]  # the continuation's
    packing: Packing  # the continuation's computed positions

    @property
    def prompt_tokens(self) -> int:
        return self.prompts[0] * self.prompts[1]

    def attention(self, attend: Callable, q: Tensor, k: Tensor, v: Tensor,
                  cache: SharedPrefixCache, layer: int) -> Tensor:
        """`attend` (Attention.attend) of each part; their outputs in the tokens' order."""
        (G, P), n = self.prompts, self.prompt_tokens
        # split, not slices: its backward writes each gradient once into one tensor, where
        # two slices' would each fill a zero tensor of all the tokens and then add them
        parts = [t.split([n, t.shape[0] - n]) for t in (q, k, v)]
        fill = attend(*(first.view(G, P, -1) for first, _ in parts), *self.fill, cache, layer,
                      0, None)  # [G, P, heads x D]
        rest = attend(*(second for _, second in parts), *self.rest, cache, layer, P,
                      self.packing)
        return torch.cat([fill.reshape(n, -1), rest])
