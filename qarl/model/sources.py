"""Where a model and its tokenizer come from: a zoo name, a Hugging Face folder or a `.gguf` file.

The zoo builds its models with loading.py and tokenizer.py, so resolving a zoo name sits above
all three: an existing path is read as given, a zoo name is prepared once under `$QARL_HOME`
and then read as a folder.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qarl.model.decoder import CausalLM, rope_inverse_frequencies
from qarl.model.loading import model_config_from_hf, read_hf_config, read_model
from qarl.model.tokenizer import Tokenizer, read_tokenizer
from qarl.model.zoo import resolve


def load_model(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A `CausalLM` from a zoo name, a HF model folder or a `.gguf` file, weights in `dtype`."""
    return read_model(resolve(name_or_path), dtype)


def load_skeleton(name_or_path: str | Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """The `CausalLM` of a zoo name or HF model folder with every weight on the meta device:
    its structure and config, no memory, no weights read (an FSDP rank that takes its shards
    from rank 0). A `.gguf` file keeps its config beside its weights: loaded whole."""
    path = resolve(name_or_path)
    if path.suffix == ".gguf":
        return read_model(path, dtype)
    config = model_config_from_hf(read_hf_config(path), source=path)
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    model.inv_freq = rope_inverse_frequencies(config)  # a plain fp32 attribute, as build_model
    return model.eval()


def load_tokenizer(name_or_path: str | Path) -> Tokenizer:
    """The tokenizer of a zoo name, a HF model folder or a `.gguf` file."""
    return read_tokenizer(resolve(name_or_path))
