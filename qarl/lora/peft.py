"""LoRA adapters as PEFT folders: written from a model's adapters, read back as a start.

A PEFT LoRA folder is `adapter_config.json` (peft_type "LORA", r, lora_alpha, target_modules,
...) and `adapter_model.safetensors` holding, per adapted module M (its name on disk, e.g.
Mixtral's `block_sparse_moe.experts.E.w1`), `base_model.model.M.lora_A.weight` [r, in] and
`base_model.model.M.lora_B.weight` [out, r]: what `peft.PeftModel.from_pretrained` loads onto
the base model. The delta is (lora_alpha / r) * B A, as qarl's `LoraLayer` computes it.

`target_modules` is the list of leaf names (`q_proj`, ...) when the adapted layers are every
layer with those leaf names, else the full module names (PEFT matches either): a recipe that
leaves some layers out does not target them on load. Reading checks everything before any
tensor is copied: the folder's files, the options qarl does not implement (DoRA, rsLoRA,
fan_in_fan_out, a bias), rank and alpha against the recipe, and each tensor against the
model's layer (name and shape); every problem names the fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from qarl.errors import UserError
from qarl.model.loading import check_safetensors
from qarl.model.names import name_in_memory, name_on_disk
from qarl.quant import QuantLinear
from qarl.lora.layers import adapter_state, load_adapters, lora_layers

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
PARTS = {"lora_A": "lora_A.weight", "lora_B": "lora_B.weight"}
# PEFT options whose non-default value means arithmetic qarl's LoraLayer does not run
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none"}


def target_modules(adapted: list[str], linears: list[str]) -> list[str]:
    """Leaf names when they select exactly `adapted` among `linears`, else the full names."""
    leaves = sorted({name.rpartition(".")[2] for name in adapted})
    chosen = [n for n in linears if n.rpartition(".")[2] in leaves]
    return leaves if sorted(chosen) == sorted(adapted) else sorted(adapted)


def write_peft(model: nn.Module, out: Path, base_model: str, family: str,
               dropout: float = 0.0) -> Path:
    """The model's adapters as a PEFT folder `out` (created); returns it."""
    layers = lora_layers(model)
    if not layers:
        raise UserError("this policy has no LoRA adapters (lora.rank = 0): export it with "
                        "--format hf or compressed-tensors")
    ranks = {layer.rank for layer in layers.values()}
    scalings = {layer.scaling for layer in layers.values()}
    if len(ranks) != 1 or len(scalings) != 1:
        raise UserError(f"adapters of several ranks {sorted(ranks)} / scales {sorted(scalings)}: "
                        "a PEFT folder holds one r and lora_alpha")
    rank, scaling = ranks.pop(), scalings.pop()
    disk = {name: name_on_disk(family, name) for name in layers}
    linears = [name_on_disk(family, n) for n, m in model.named_modules()
               if isinstance(m, nn.Linear | QuantLinear)]
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": rank, "lora_alpha": scaling * rank, "lora_dropout": dropout,
        "target_modules": target_modules(list(disk.values()), linears), "bias": "none",
        "fan_in_fan_out": False, "use_dora": False, "use_rslora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }
    tensors = {f"{PREFIX}{disk[name]}.{PARTS[p]}": getattr(layer, p).detach().float().contiguous().cpu()
               for name, layer in layers.items() for p in PARTS}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    return out


def read_config(folder: str | Path) -> dict:
    """adapter_config.json of a PEFT LoRA folder whose options qarl runs; UserError else."""
    folder = Path(folder)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise UserError(f"{folder} has no {name}: lora.init_from takes a PEFT LoRA adapter "
                            f"folder ({CONFIG_FILE} + {WEIGHTS_FILE}, as `qarl export --format "
                            f"peft` or peft's save_pretrained writes)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{folder / CONFIG_FILE} is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"{folder / CONFIG_FILE} holds a JSON {type(config).__name__}, not the "
                        "object of a PEFT adapter config; write the folder again with `qarl "
                        "export --format peft` or peft's save_pretrained")
    if config.get("peft_type") != "LORA":
        raise UserError(f"{folder} holds a {config.get('peft_type')!r} adapter; lora.init_from "
                        "takes LoRA adapters only")
    for key, plain in UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None):
            raise UserError(f"{folder}: {key} = {config[key]!r} is not implemented by qarl's "
                            f"LoRA layers (they compute (alpha / r) B A x on the layer's input); "
                            f"use an adapter saved with {key} = {plain!r}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise UserError(f"{folder}: per-layer ranks or alphas (rank_pattern / alpha_pattern) are "
                        "not implemented; use an adapter with one r and lora_alpha")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0) or not (
            alpha is None or isinstance(alpha, int | float) and not isinstance(alpha, bool)):
        raise UserError(f"{folder / CONFIG_FILE}: r = {rank!r}, lora_alpha = {alpha!r}; a LoRA "
                        "adapter has a whole r of at least 1 and a numeric lora_alpha: correct "
                        "them to the values it was trained with")
    check_safetensors(folder / WEIGHTS_FILE)  # the header, not the tensors: a cut copy is named
    return config


def config_problems(folder: str | Path, rank: int, alpha: float) -> list[str]:
    """What keeps a PEFT folder from starting a run of this rank and alpha (empty: nothing)."""
    try:
        config = read_config(folder)
    except UserError as err:
        return [str(err)]
    problems = []
    if config.get("r") != rank:
        problems.append(f"{folder} is an adapter of rank {config.get('r')}, the recipe's "
                        f"lora.rank is {rank}: set lora.rank = {config.get('r')}")
    if config.get("lora_alpha") is not None and float(config["lora_alpha"]) != float(alpha):
        problems.append(f"{folder} has lora_alpha = {config['lora_alpha']}, the recipe's alpha "
                        f"is {alpha:g}: set lora.alpha = {config['lora_alpha']}")
    return problems


def adapter_shapes(folder: str | Path, family: str) -> dict[str, tuple[int, ...]]:
    """{`<module in memory>.lora_A` / `.lora_B`: shape} from the file's header (no data read)."""
    shapes = {}
    check_safetensors(Path(folder) / WEIGHTS_FILE)
    with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as handle:
        for key in handle.keys():
            shapes[_memory_name(key, family, folder)] = tuple(handle.get_slice(key).get_shape())
    return shapes


def fit_problems(folder: str | Path, family: str, model: nn.Module) -> list[str]:
    """Where the adapter's tensors do not fit the model's LoRA layers (names and shapes)."""
    own = {name: tuple(t.shape) for name, t in adapter_state(model).items()}
    theirs = adapter_shapes(folder, family)
    problems = []
    extra, missing = sorted(set(theirs) - set(own)), sorted(set(own) - set(theirs))
    if extra:
        problems.append(f"{folder} adapts {len(extra)} tensor(s) this recipe's model has no LoRA "
                        f"layer for (e.g. {extra[0]}): is it an adapter of another base model, "
                        "or of layers lora.include / exclude leave out?")
    if missing:
        problems.append(f"{folder} has no adapter for {len(missing)} targeted tensor(s) (e.g. "
                        f"{missing[0]}); set lora.include / exclude to the adapter's target modules")
    wrong = [f"{k}: {theirs[k]} vs {own[k]}" for k in sorted(set(own) & set(theirs))
             if theirs[k] != own[k]]
    if wrong:
        problems.append(f"{folder}'s tensor shapes do not fit this model ({len(wrong)}, e.g. "
                        f"{wrong[0]}): it was trained on another base model")
    return problems


def import_peft(model: nn.Module, folder: str | Path, family: str) -> None:
    """Load a PEFT LoRA folder into the model's LoRA layers (`attach_lora` first); UserError,
    before anything is copied, where it does not fit."""
    problems = fit_problems(folder, family, model)
    if problems:
        raise UserError("lora.init_from: " + "; ".join(problems))
    state: dict[str, Tensor] = {}
    with safe_open(str(Path(folder) / WEIGHTS_FILE), framework="pt") as handle:
        for key in handle.keys():
            state[_memory_name(key, family, folder)] = handle.get_tensor(key).float()
    load_adapters(model, state)


def _memory_name(key: str, family: str, folder) -> str:
    # base_model.model.<module>.lora_A.weight -> <module in memory>.lora_A
    for part, suffix in PARTS.items():
        if key.startswith(PREFIX) and key.endswith("." + suffix):
            module = key[len(PREFIX):-len(suffix) - 1]
            return f"{name_in_memory(family, module)}.{part}"
    raise UserError(f"{Path(folder) / WEIGHTS_FILE} holds {key!r}, not a LoRA tensor "
                    f"({PREFIX}<module>.lora_A.weight / .lora_B.weight); was it saved by peft?")
