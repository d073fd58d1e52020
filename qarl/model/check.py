"""What makes a path unusable as a model, found without loading it (recipe checks run this
before any work): the folder's config.json, its tokenizer files and the headers of its weight
files (no tensor data is read), or a `.gguf` file's header.

`model_problems(path)` lists every problem of one path, each naming the file and the fix
(`source_problems` also of a zoo model's prepared copy; `check_model` raises them);
the weight-file check is `loading.check_safetensors`, which loading runs too (so a file cut
short is named, not reported as the safetensors library's error).
"""

from __future__ import annotations

import json
from pathlib import Path

from qarl.errors import UserError
from qarl.model.loading import (
    GGUF_MAGIC, INDEX_FILE, WEIGHTS_FILE, check_safetensors, model_config_from_hf,
)


def _weights_problems(folder: Path) -> list[str]:
    single, index = folder / WEIGHTS_FILE, folder / INDEX_FILE
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            files = [folder / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            return [f"{index} is not a safetensors index (a JSON object with a 'weight_map'): "
                    f"{err}; rewrite it with save_pretrained"]
    else:
        return [f"{folder} holds no {WEIGHTS_FILE} or {INDEX_FILE}; a model folder has its "
                "weights as safetensors (qarl never unpickles .bin / .pt files)"]
    problems = []
    for file in files:
        try:
            if not file.is_file():
                raise UserError(f"{file}, listed in {INDEX_FILE}, does not exist")
            check_safetensors(file)
        except UserError as err:
            problems.append(str(err))
    return problems


def _gguf_problems(file: Path) -> list[str]:
    if not file.is_file():
        return [f"{file} is not a file"]
    with file.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        return [f"{file} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); "
                "give a .gguf model file or a Hugging Face model folder"]
    try:
        from gguf import GGUFReader

        GGUFReader(str(file))
    except Exception as err:  # the reader's errors on a damaged file have no common type
        return [f"{file} is a damaged GGUF file ({type(err).__name__}: {err}); download or "
                "convert it again"]
    return []


def model_problems(path: Path) -> list[str]:
    """Every reason `path` (a HF model folder or a .gguf file) cannot be loaded as a model,
    each naming the file and what to do; [] when it looks loadable."""
    path = Path(path)
    if path.suffix == ".gguf":
        return _gguf_problems(path)
    if not path.is_dir():
        return [f"{path} is a file, not a model folder or a .gguf file; pass a folder holding "
                f"config.json and {WEIGHTS_FILE}, or a .gguf file"]
    problems = []
    config = path / "config.json"
    try:
        model_config_from_hf(json.loads(config.read_text()), source=path)
    except FileNotFoundError:
        problems.append(f"{path} has no config.json: it is not a model folder (one holds "
                        f"config.json, {WEIGHTS_FILE} and tokenizer files, as save_pretrained "
                        "writes them)")
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        problems.append(f"{config} is not JSON ({err}); rewrite it with save_pretrained")
    except (ValueError, KeyError, TypeError) as err:
        problems.append(str(err))
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        problems.append(f"{path} has no tokenizer.json or tokenizer_config.json; save the "
                        "tokenizer into the folder too (tokenizer.save_pretrained)")
    return problems + _weights_problems(path)


def source_problems(name_or_path: str | Path) -> list[str]:
    """`model_problems` of a model path, or of a zoo model's prepared copy (with how to prepare
    it again); [] for a zoo name not prepared yet (qarl prepares it on first use) and for a
    path that does not exist (`check_model` and the recipe's model check name that)."""
    from qarl.model.zoo import ZOO, is_prepared, model_folder

    path = Path(name_or_path).expanduser()
    if path.exists():
        return model_problems(path)
    name = str(name_or_path)
    if name not in ZOO or not is_prepared(name):
        return []
    return [f"{text}; the zoo's copy of {name!r} is damaged: prepare it again with qarl models "
            f"--prepare {name} --force" for text in model_problems(model_folder(name))]


def check_model(name_or_path: str | Path) -> None:
    """Raise one UserError naming every reason a zoo name, model folder or `.gguf` file cannot
    be loaded (`source_problems`; a zoo name not prepared yet passes)."""
    from qarl.model.zoo import ZOO, unknown_model

    if not Path(name_or_path).expanduser().exists() and str(name_or_path) not in ZOO:
        raise unknown_model(name_or_path)
    problems = source_problems(name_or_path)
    if problems:
        raise UserError("; ".join(problems))
