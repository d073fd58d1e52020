"""`export_run`: a run's (or a checkpoint's) policy as a folder another stack loads.

Where the policy is read from (the layout qarl/train/checkpoint.py writes): a checkpoint
folder `step_NNNNNN/` holds the master weights (`model.safetensors`, a tied weight stored
once) and the resolved config the steps were taken with (`config.toml`); a run folder names
its checkpoint to resume from in the one-line file `latest`. Only safetensors and TOML are
read, nothing is unpickled.

Formats:
- `hf`: the full-precision master weights in the run's master dtype, as a Hugging Face folder
  (config.json, model.safetensors, tokenizer files, generation_config.json when the base model
  has one) that `transformers.AutoModelForCausalLM.from_pretrained` loads. Of a LoRA run
  (`[lora]` rank > 0, whose checkpoints hold the adapters only): the adapters merged into the
  base's weights (W + (alpha / r) B A), or with `merge=False` the base alone.
- `compressed-tensors`: the master weights quantized by qarl's own quantizer with the run's
  scheme, options and layer selection (the codes the engine computed from these weights),
  written in compressed-tensors' layout with its `quantization_config`: what vLLM serves. Of
  a LoRA run: its frozen base, the codes the engine served the adapters on.
- `peft`: a LoRA run's adapters as a PEFT folder (`qarl.lora.peft`), which `peft` loads onto
  the base exported as `hf` (merge=False) or `compressed-tensors`.

A LoRA run's base is the recipe's model, or the warm-started one where the recipe has [sft]
steps: the caller passes it (`base`; `qarl export` builds it with the run's warm start).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from qarl.errors import UserError
from qarl.export.compressed_tensors import WEIGHTS_FILE, ct_state, quantization_config
from qarl.lora.peft import write_peft
from qarl.model import DTYPES, CausalLM, load_model, load_skeleton, load_tokenizer, save_model
from qarl.model.check import check_model
from qarl.model.names import state_on_disk
from qarl.model.zoo import resolve
from qarl.quant import SCHEMES, QWeight, export_state, quantize_model
from qarl.quant.apply import FUSED_GROUPS
from qarl.lora.layers import attach_lora, default_alpha, load_adapters, remove_adapters
from qarl.lora.fit import weights_problem

FORMATS = ("hf", "compressed-tensors", "peft")
CONFIG_FILE = "config.toml"  # the resolved config a checkpoint was trained with
POINTER = "latest"  # a run folder's one-line file naming its newest complete checkpoint
GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class RunPolicy:
    """What an export needs from a run: its checkpoint and the recipe keys that built it."""

    checkpoint: Path
    model_name: str  # zoo name or path of the base model (architecture, tokenizer)
    master_dtype: str
    scheme: str
    options: dict = field(default_factory=dict)
    include: list[str] | None = None
    exclude: list[str] | None = None
    lora: dict = field(default_factory=dict)  # the run's [lora] section ({} or rank 0: none)

    @property
    def lora_rank(self) -> int:
        return int(self.lora.get("rank", 0))


def find_checkpoint(src: str | Path) -> Path:
    """`src` itself when it is a checkpoint folder; for a run folder, the checkpoint its
    `latest` pointer names."""
    src = Path(src)
    if (src / WEIGHTS_FILE).is_file() and (src / CONFIG_FILE).is_file():
        return src
    pointer = src / POINTER
    if pointer.is_file():
        named = src / pointer.read_text().strip()
        if (named / WEIGHTS_FILE).is_file() and (named / CONFIG_FILE).is_file():
            return named
    raise UserError(
        f"{src} is neither a checkpoint folder (step_NNNNNN/ with {WEIGHTS_FILE} and "
        f"{CONFIG_FILE}) nor a run folder whose '{POINTER}' file names one; pass the folder "
        f"`qarl train` printed as 'run folder', or one of its step_NNNNNN folders"
    )


def read_run(src: str | Path) -> RunPolicy:
    """The checkpoint of `src` and the model / quant keys of the config it was trained with;
    a config.toml that does not parse or lacks them is a UserError naming the file."""
    checkpoint = find_checkpoint(src)
    path = checkpoint / CONFIG_FILE
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} does not parse ({err}): the checkpoint's recipe is damaged; "
                        f"copy the run folder's config.toml (the recipe the run started with) "
                        f"over it, or export another step_NNNNNN folder of the run") from None
    model, quant, lora = config.get("model"), config.get("quant", {}), config.get("lora", {})
    if not (isinstance(model, dict) and isinstance(model.get("name"), str)
            and model.get("master_dtype", "float32") in DTYPES
            and isinstance(quant, dict) and isinstance(quant.get("options", {}), dict)
            and isinstance(lora, dict)):
        raise UserError(f"{path} is not the recipe of a qarl checkpoint: it needs [model] name "
                        f"and master_dtype (one of {sorted(DTYPES)}), and [quant] and [lora] "
                        "tables; copy the run folder's config.toml over it, or export another "
                        "step_NNNNNN folder of the run")
    try:
        check_model(model["name"])
    except UserError as err:
        raise UserError(f"{path} trains model.name {model['name']!r}, which cannot be loaded "
                        f"here: {err}") from None
    return RunPolicy(checkpoint, model["name"], model.get("master_dtype", "float32"),
                     quant.get("scheme", "w8a8-int8"), quant.get("options", {}),
                     quant.get("include"), quant.get("exclude"), lora)


def load_master(policy: RunPolicy, base: CausalLM | None = None) -> CausalLM:
    """The base model's architecture holding the checkpoint's master weights, every name
    accounted for (a tied lm_head is stored once, as the embedding). A LoRA run's: `base`
    (default: the recipe's model) with its adapters attached and loaded (full-precision
    layers: `qarl.lora.layers.LoraLinear`). Weights that are not whole or do not fit are a
    UserError, found from the file's header before the model loads."""
    dtype = DTYPES[policy.master_dtype]
    skeleton = _with_adapters(base if base is not None else load_skeleton(policy.model_name),
                              policy)
    why = weights_problem(policy.checkpoint, skeleton)
    if why is not None:
        raise UserError(f"{why}, though {policy.checkpoint / CONFIG_FILE} names model "
                        f"{policy.model_name!r} with lora.rank = {policy.lora_rank}: the "
                        "folder holds another run's weights, or is damaged; export another "
                        "step_NNNNNN folder of the run")
    model = skeleton if base is not None else _with_adapters(
        load_model(policy.model_name, dtype=dtype), policy)
    weights = load_file(policy.checkpoint / WEIGHTS_FILE)
    if policy.lora_rank:
        load_adapters(model, weights)
    else:
        model.load_state_dict(weights, strict=False)
    return model


def _with_adapters(model: CausalLM, policy: RunPolicy) -> CausalLM:
    """`model` with the run's LoRA adapters attached (zeros), where it has [lora]."""
    if policy.lora_rank:  # the resolved config holds every [lora] key but a default alpha
        lora, rank = policy.lora, policy.lora_rank
        attach_lora(model, rank, float(lora.get("alpha", default_alpha(rank))), 0.0,
                    lora["include"], lora["exclude"], "zeros")
    return model


def export_run(src: str | Path, out: str | Path, format: str, scheme: str | None = None,
               merge: bool = True, base: CausalLM | None = None) -> Path:
    """Write the policy of run or checkpoint folder `src` into the new folder `out` as `format`
    ("hf", "compressed-tensors" or "peft"); `scheme` replaces the run's quant.scheme
    (compressed-tensors only; the run's quant.options then apply only when it is the run's own
    scheme). A LoRA run: `merge` (hf) merges the adapters into the weights, else the base
    alone is written; `base` is its base model (default: the recipe's model)."""
    if format not in FORMATS:
        raise UserError(f"unknown export format {format!r}; valid: {list(FORMATS)}")
    if scheme is not None and format != "compressed-tensors":
        raise UserError(f"--scheme applies to --format compressed-tensors; the {format} format "
                        "writes " + ("the full-precision master weights" if format == "hf" else
                                     "the adapters, in full precision") + ", drop --scheme")
    if not merge and format != "hf":
        raise UserError(f"--base-only applies to --format hf; the {format} format writes "
                        + ("a LoRA run's base already" if format == "compressed-tensors" else
                           "the adapters alone") + ", drop --base-only")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; export into a new (or empty) folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} exists and is not empty; export into a new folder")
    blocked = next((p for p in out.parents if p.exists()), None)
    if blocked is not None and not blocked.is_dir():
        raise UserError(f"cannot create {out}: {blocked} is a file; export elsewhere")
    policy = read_run(src)
    if format == "peft" and not policy.lora_rank:
        raise UserError(f"{policy.checkpoint} is a full fine-tuning run (lora.rank = 0): it has "
                        "no adapter to write; use --format hf or compressed-tensors")
    if not merge and not policy.lora_rank:
        raise UserError(f"{policy.checkpoint} is a full fine-tuning run (lora.rank = 0): all "
                        "its weights are trained, there is no base apart from adapters to "
                        "write; drop --base-only")
    model = load_master(policy, base)
    if format == "peft":
        return write_peft(model, out, policy.model_name, model.config.family,
                          float(policy.lora.get("dropout", 0.0)))
    remove_adapters(model, merge=merge and format == "hf")
    if format == "hf":
        save_model(model, out)
    else:
        write_compressed_tensors(model, policy, scheme or policy.scheme, out)
    copy_tokenizer(policy.model_name, out)
    return out


def quantized_state(model: CausalLM, policy: RunPolicy, scheme: str) -> dict[str, torch.Tensor | QWeight]:
    """export_state of `model` quantized as the run's engine is (kernel mode, its layers)."""
    if scheme not in SCHEMES:
        raise UserError(f"unknown scheme {scheme!r}; valid: {sorted(SCHEMES)}")
    if SCHEMES[scheme].is_identity:
        raise UserError(f"scheme {scheme!r} is full precision: there is nothing to write as "
                         f"compressed-tensors; use --format hf")
    options = policy.options if scheme == policy.scheme else {}
    quantize_model(model, scheme, mode="kernel", include=policy.include, exclude=policy.exclude,
                   **options)
    return export_state(model)


def write_compressed_tensors(model: CausalLM, policy: RunPolicy, scheme: str, out: Path) -> None:
    """config.json with quantization_config and model.safetensors in compressed-tensors'
    layout; everything is converted (and refused, when it cannot be written) before a file
    is written."""
    state = quantized_state(model, policy, scheme)
    warn_split_global_scales(state)
    state = state_on_disk(model.config.family, state)  # Mixtral's expert names
    tensors, config = ct_state(state), quantization_config(state)
    hf = model.config.to_hf()
    hf["dtype"] = policy.master_dtype
    # A quantized lm_head is its own tensor: tying it to the embedding would drop its codes.
    hf["tie_word_embeddings"] = hf["tie_word_embeddings"] and not isinstance(state.get("lm_head.weight"), QWeight)
    hf["quantization_config"] = config
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    save_file(unshared(tensors), out / WEIGHTS_FILE, metadata={"format": "pt"})


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, a second name for the same memory (a tied lm_head) copied:
    safetensors stores no shared memory."""
    seen, out = set(), {}
    for name, t in sorted(tensors.items()):
        t = t.detach().contiguous()
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return out


def warn_split_global_scales(state: dict[str, torch.Tensor | QWeight]) -> None:
    """vLLM fuses q/k/v and gate/up and decodes the fused NVFP4 layer with one global scale.
    qarl's quantizer gives a fused group one (`Scheme.group_scaled`), so this warns only for
    a state quantized otherwise (e.g. a group split by quant.include / exclude). The file
    itself is exact: say so, and where."""
    split = []
    for name, qw in state.items():
        if not (isinstance(qw, QWeight) and qw.global_scale is not None):
            continue
        module = name.removesuffix(".weight")
        for group in FUSED_GROUPS:
            if module.endswith("." + group[0]):
                parent = module.removesuffix(group[0])
                scales = {float(state[f"{parent}{m}.weight"].global_scale) for m in group
                          if isinstance(state.get(f"{parent}{m}.weight"), QWeight)}
                if len(scales) > 1:
                    split.append(parent + "/".join(group))
    if split:
        warnings.warn(
            f"{len(split)} fused layer group(s) (e.g. {split[0]}) hold NVFP4 weights with "
            f"different global scales; vLLM decodes a fused group with one (the largest), so "
            f"it would not serve exactly these codes there. compressed-tensors' own decoder "
            f"reads the file exactly.", stacklevel=3)


def copy_tokenizer(model_name: str, out: Path) -> None:
    """The base model's tokenizer files, and its generation_config.json when it has one."""
    load_tokenizer(model_name).hf.save_pretrained(out)
    source = resolve(model_name)
    if source.is_dir() and (source / GENERATION_CONFIG).is_file():
        shutil.copyfile(source / GENERATION_CONFIG, out / GENERATION_CONFIG)
