"""Read and write `CausalLM` weights: Hugging Face folders and GGUF files.

Paths `read_model` accepts (`qarl.model.load_model` also takes zoo names, see sources.py):
- a folder with `config.json` and `model.safetensors`, or sharded weights listed in
  `model.safetensors.index.json` (what `save_pretrained` writes);
- a `.gguf` file, read with transformers' GGUF reader (the `gguf` package dequantizes).
Checkpoint names are mapped to the decoder's where a family stores them apart (Mixtral's
experts, `qarl.model.names`), both ways.

Only safetensors and GGUF are read: nothing is ever unpickled (`torch.load`).
Tied embeddings: the file stores the embedding once and `lm_head` shares it, as in HF.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from qarl.errors import UserError
from qarl.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from qarl.model.decoder import CausalLM, rope_inverse_frequencies
from qarl.model.names import state_in_memory, state_on_disk

# master dtypes by the names recipes use (model.master_dtype)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GGUF_MAGIC = b"GGUF"
_MAX_HEADER = 100 * 2**20  # safetensors refuses larger headers too
# Keys some checkpoints carry that are recomputed, never learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json keys that describe the file, not the model; dropped on load, save_model
# writes `dtype` afresh.
_METADATA_KEYS = ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "_model_name_or_path")
# Keys whose other values would change the computation: key -> accepted values (first =
# default). Checked, then dropped: they hold nothing a supported model can vary.
_REQUIRED_VALUES = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "use_sliding_window": (False,),
    "pretraining_tp": (1,),
}


def read_model(path: Path, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A `CausalLM` from a HF model folder or a `.gguf` file, weights in `dtype`."""
    if path.suffix == ".gguf":
        hf_config, state = read_gguf(path, dtype)
        return build_model(model_config_from_hf(hf_config, source=path), state, dtype, source=path)
    config = model_config_from_hf(read_hf_config(path), source=path)  # before reading weights
    return build_model(config, state_in_memory(config.family, read_safetensors(path)), dtype, source=path)


def read_hf_config(folder: Path) -> dict:
    """The parsed `config.json` of a model folder, with a clear error when it is not one."""
    if not folder.is_dir():
        raise UserError(
            f"{folder} is a file, not a model folder or a .gguf file; pass a folder holding "
            f"config.json and {WEIGHTS_FILE}, or a .gguf file"
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserError(
            f"{folder} has no config.json: a model folder must contain config.json and "
            f"{WEIGHTS_FILE} (or {INDEX_FILE} with its shards), as save_pretrained writes"
        )
    try:
        return json.loads(config_file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{config_file} is not JSON ({err}); rewrite it with save_pretrained") from None


def model_config_from_hf(hf_config: dict, source: Path) -> ModelConfig:
    """`ModelConfig.from_hf`, filling `architectures` from `model_type` when it is absent
    (configs written by `PretrainedConfig.save_pretrained` or read from GGUF lack it)."""
    hf_config = {k: v for k, v in hf_config.items() if k not in _METADATA_KEYS}
    unsupported = {k: hf_config[k] for k, ok in _REQUIRED_VALUES.items() if hf_config.get(k, ok[0]) not in ok}
    if unsupported:
        raise UserError(
            f"cannot load {source}: config.json sets {unsupported}, which qarl's decoder does not "
            f"implement (supported: {_REQUIRED_VALUES})"
        )
    hf_config = {k: v for k, v in hf_config.items() if k not in _REQUIRED_VALUES}
    by_family = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
    if not hf_config.get("architectures") and hf_config.get("model_type") in by_family:
        hf_config["architectures"] = [by_family[hf_config["model_type"]]]
    try:
        return ModelConfig.from_hf(hf_config)
    except (ValueError, KeyError) as err:
        raise UserError(f"cannot load {source}: {err}") from err


def read_safetensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a folder's `model.safetensors` or of the shards its index lists."""
    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file():
        check_safetensors(single)
        return load_file(single)
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, Tensor] = {}
        for shard in shards:
            check_safetensors(folder / shard)
            state.update(load_file(folder / shard))
        return state
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = (
        f"; found {pickles}, which qarl never unpickles: convert them to safetensors first"
        if pickles else ""
    )
    raise UserError(f"{folder} has config.json but neither {WEIGHTS_FILE} nor {INDEX_FILE}{hint}")


def check_safetensors(file: Path) -> None:
    """Raise UserError unless `file` is a whole safetensors file: an 8-byte header length, a
    JSON header, and as many bytes after it as its tensors' offsets say (no data is read)."""
    safetensors_shapes(file)


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the header of `file`, a whole safetensors file (UserError
    otherwise, as `check_safetensors`); no tensor data is read."""
    if not file.is_file():
        raise UserError(f"{file} does not exist; a model folder lists only files it holds")
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if n is None or n > min(size - 8, _MAX_HEADER):
            raise UserError(f"{file} is not a safetensors file (its {size} bytes hold no "
                            "valid header); rewrite it with safetensors' save_file / "
                            "save_pretrained, or point at the folder of a whole model")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise UserError(f"{file} has a corrupt safetensors header ({err}); rewrite the "
                            "file") from None
    if not isinstance(header, dict):
        raise UserError(f"{file} has a corrupt safetensors header (a JSON "
                        f"{type(header).__name__}, not an object); rewrite the file")
    ends = [t["data_offsets"][1] for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict) and "data_offsets" in t]
    need = 8 + n + max(ends, default=0)
    if size < need:
        raise UserError(f"{file} is cut short: {size} bytes where its header describes {need} "
                        "(an interrupted copy or download?); copy or convert it again")
    return {k: tuple(t.get("shape", ())) for k, t in header.items()
            if k != "__metadata__" and isinstance(t, dict)}


def check_weight_names(config: ModelConfig, state: dict[str, Tensor], source: Path) -> dict[str, Tensor]:
    """The state with ignorable keys dropped; raises listing missing or unexpected names."""
    with torch.device("meta"):
        expected = set(CausalLM(config).state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # stored once, as the embedding
    state = {
        k: v for k, v in state.items()
        if not k.endswith(_IGNORED_SUFFIXES) and not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights of {source} do not fit a {config.family} model with this config.json: "
            f"{len(missing)} missing (e.g. {missing[:5]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:5]}); check that config.json belongs to these weights"
        )
    return state


def build_model(config: ModelConfig, state: dict[str, Tensor], dtype: torch.dtype, source: Path) -> CausalLM:
    """A `CausalLM` holding `state` (HF names) in `dtype`, built without a random init."""
    state = check_weight_names(config, state, source)
    with torch.device("meta"):
        model = CausalLM(config)
    for name, tensor in state.items():
        shape = model.get_parameter(name).shape
        if tensor.shape != shape:
            raise ValueError(
                f"weight {name} of {source} has shape {list(tensor.shape)}, the config implies "
                f"{list(shape)}; check that config.json belongs to these weights"
            )
    model.load_state_dict({k: v.to(dtype).contiguous() for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # RoPE frequencies stay float32 whatever `dtype` is, as in HF.
    model.inv_freq = rope_inverse_frequencies(config)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"build_model left tensors uninitialised: {left}; update build_model")
    return model.eval()


def save_model(model: CausalLM, folder: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` (tied embedding stored once), loadable by
    `load_model` and by transformers' `AutoModelForCausalLM.from_pretrained`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = model.config.to_hf()
    hf_config["dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    state = state_on_disk(model.config.family, state)
    tensors = {k: v.detach().contiguous() for k, v in sorted(state.items())}
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    return folder


def read_gguf(path: Path, dtype: torch.dtype) -> tuple[dict, dict[str, Tensor]]:
    """(HF config dict, dequantized state dict with HF names) of a `.gguf` file."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise UserError(f"{path} is not a GGUF file (it starts with {magic!r}, not "
                        f"{GGUF_MAGIC!r}); give a .gguf model file or a Hugging Face folder")
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as err:  # transformers names the GGUF architecture it cannot read
        raise UserError(f"cannot read {path}: {err}; qarl runs {sorted(SUPPORTED_ARCHITECTURES)}") from err
    except Exception as err:  # a damaged file fails inside the gguf reader, in any type
        raise UserError(f"{path} is a damaged GGUF file ({type(err).__name__}: {err}); "
                        "download or convert it again") from err
    model_config_from_hf(hf_config.to_diff_dict(), source=path)  # fail early on unsupported families
    # transformers maps GGUF tensor names to HF names through a model instance; a meta
    # one costs no memory.
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf_model, torch_dtype=dtype)
    return hf_config.to_diff_dict(), parsed["tensors"]
