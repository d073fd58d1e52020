"""Checkpoints: complete or ignored, with no pickles.

A checkpoint is a folder `step_000012/` (12 steps done) holding
- `model.safetensors`: the master weights (a tied weight is stored once); of a LoRA learner,
  its adapters (`<layer>.lora_A`, `.lora_B`), the frozen base being the recipe's;
- `optimizer.safetensors`: every tensor of every optimizer's state, named
  `<optimizer>.<param id>.<key>`; absent from a weights-only checkpoint (`save(...,
  optimizer_state=False)`: a run's final one under train.final_checkpoint = 'weights'), whose
  state.json says so (`"optimizer_state": false`): such a folder is whole, can be evaluated,
  exported and resumed at its own step, but holds nothing to take another optimizer step with
  (`has_optimizer_state`). A full checkpoint that lost the file is damaged, never taken for one;
- `rng.safetensors`: the global torch RNG state (`torch`) and each CUDA device's (`cuda.<i>`);
- `state.json`: the step, the trainer's own state (e.g. the count of bad steps in a row), the
  Python `random` state, and per optimizer its param groups (learning rate included) and
  non-tensor per-parameter state;
- `config.toml`: the resolved config the steps were taken with;
- `metrics.jsonl`: the run's metrics file as it was at the save (when the run keeps one).

What needs no saving, because it is a pure function of (run.seed, step): the data cursor (a
step's prompts, `phases.train_examples`), the engine's sampling generator (seeded per step),
the learning-rate schedule (`optim.learning_rate`).

Writing (`save`): every file goes to `.tmp_step_000012/` and is fsynced; the folder is
fsynced, renamed to `step_000012/`, the run folder fsynced; then the `latest` pointer (a
one-line file naming the folder) is replaced atomically the same way; last, checkpoints
beyond the newest `keep` (and any past this step: a killed run's future, redone now) are
renamed away and deleted. A process killed at any point leaves `latest` naming a complete
checkpoint (or none yet): `find(run_dir)` follows the pointer and falls back to the newest
whole folder, and names every folder that is not whole (`problem`: a file missing, cut
short or corrupt), which a resume sets aside as `damaged_step_NNNNNN` (`set_aside`) instead
of ever deleting it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qarl import jsonio
from qarl.errors import UserError
from qarl.model.loading import check_safetensors
from qarl.lora.fit import weights_problem
from qarl.lora.layers import load_adapters, lora_names

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 only
    import tomli as tomllib

PREFIX = "step_"
POINTER = "latest"
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json",
         "config.toml")
METRICS = "metrics.jsonl"


@dataclass
class RngState:
    """Every global random state a step could draw from."""

    torch_cpu: torch.Tensor  # [5056] uint8, torch.get_rng_state()
    cuda: list[torch.Tensor]  # one uint8 state per CUDA device (empty when CUDA is unused)
    python: list  # random.getstate() as JSON: [version, [625 ints], gauss_next]


def capture_rng() -> RngState:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    version, internal, gauss = random.getstate()
    return RngState(torch.get_rng_state(), cuda, [version, list(internal), gauss])


def restore_rng(rng: RngState) -> None:
    torch.set_rng_state(rng.torch_cpu)
    if rng.cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng.cuda)
    version, internal, gauss = rng.python
    random.setstate((version, tuple(internal), gauss))


def _flatten_optimizer(optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: list = []
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        state_scalars: dict[str, dict[str, Any]] = {}
        for pid, pstate in sd["state"].items():
            for key, value in pstate.items():
                if torch.is_tensor(value):
                    tensors[f"{i}.{pid}.{key}"] = value.detach().contiguous().cpu()
                else:
                    state_scalars.setdefault(str(pid), {})[key] = value
        scalars.append({"param_groups": sd["param_groups"], "scalars": state_scalars})
    return tensors, scalars


def _unflatten_optimizer(optimizers, tensors: dict, scalars: list) -> None:
    for i, (opt, meta) in enumerate(zip(optimizers, scalars)):
        state: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            opt_index, pid, key = name.split(".", 2)
            if int(opt_index) == i:
                state.setdefault(int(pid), {})[key] = value
        for pid, values in meta["scalars"].items():
            state.setdefault(int(pid), {}).update(values)
        # JSON has no tuples: give back the ones the optimizer holds (e.g. AdamW's betas).
        groups = [{k: tuple(v) if isinstance(current.get(k), tuple) else v for k, v in saved.items()}
                  for saved, current in zip(meta["param_groups"], opt.param_groups)]
        opt.load_state_dict({"state": state, "param_groups": groups})


def _master_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter; a LoRA learner's adapters only (its frozen base is rebuilt from the
    recipe: model, warm start, quantization)."""
    adapters = set(lora_names(model))
    weights = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()
               if not adapters or n in adapters}
    # Tied weights are one tensor under two names; safetensors refuses shared storage.
    seen: dict[int, str] = {}
    for name in list(weights):
        ptr = weights[name].data_ptr()
        if ptr in seen:
            del weights[name]
        seen.setdefault(ptr, name)
    return weights


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (a folder: the names it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(folder: Path) -> None:
    """Delete a folder so that no reader ever sees it half-deleted: rename it away first."""
    trash = folder.with_name(f".trash_{folder.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(folder, trash)
    shutil.rmtree(trash)


def _write_files(tmp: Path, step: int, model, optimizers, state: dict, rng: RngState,
                 config_toml: str, metrics: Path, optimizer_state: bool) -> None:
    save_file(_master_weights(model), tmp / "model.safetensors")
    opt_scalars = None
    if optimizer_state:
        opt_tensors, opt_scalars = _flatten_optimizer(optimizers)
        save_file(opt_tensors, tmp / "optimizer.safetensors")
    save_file({"torch": rng.torch_cpu, **{f"cuda.{i}": s for i, s in enumerate(rng.cuda)}},
              tmp / "rng.safetensors")
    (tmp / "config.toml").write_text(config_toml)
    if metrics.exists():
        shutil.copyfile(metrics, tmp / METRICS)
    state = {**state, "step": step, "python_random": rng.python, "optimizers": opt_scalars,
             "optimizer_state": optimizer_state}
    (tmp / "state.json").write_text(jsonio.dumps(state, indent=1))
    for path in tmp.iterdir():
        _fsync(path)
    _fsync(tmp)


def step_folder(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` of a run lives."""
    return Path(run_dir) / f"{PREFIX}{step:06d}"


def save(run_dir: Path, step: int, model: nn.Module, optimizers, state: dict, rng: RngState,
         config_toml: str, keep: int, optimizer_state: bool = True) -> Path:
    """Write checkpoint `step` of run_dir (see the module docstring), point `latest` at it,
    keep the newest `keep`. `state`: the trainer's JSON-able state. optimizer_state=False:
    a weights-only checkpoint (no optimizer.safetensors)."""
    run_dir = Path(run_dir)
    final = step_folder(run_dir, step)
    tmp = run_dir / f".tmp_{final.name}"
    for junk in [tmp, *run_dir.glob(".trash_*")]:  # left by a process killed mid-save
        shutil.rmtree(junk, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_files(tmp, step, model, optimizers, state, rng, config_toml, run_dir / METRICS,
                 optimizer_state)
    if final.exists():  # a step redone after a resume from an older pointer
        _discard(final)
    os.replace(tmp, final)
    _fsync(run_dir)
    pointer_tmp = run_dir / f".tmp_{POINTER}"
    pointer_tmp.write_text(final.name + "\n")
    _fsync(pointer_tmp)
    os.replace(pointer_tmp, run_dir / POINTER)
    _fsync(run_dir)
    # Folders past this step are a killed run's future, which this run redoes.
    kept = [f for f in _complete(run_dir) if f.name <= final.name][-keep:]
    for old in sorted(run_dir.glob(f"{PREFIX}*")):
        if old not in kept:
            _discard(old)
    return final


def step_of(folder: Path) -> int:
    """The steps done when checkpoint `folder` was saved, from its state.json."""
    return int(json.loads((Path(folder) / "state.json").read_text())["step"])


def has_optimizer_state(folder: Path) -> bool:
    """Whether checkpoint `folder` is meant to hold optimizer state: False only where its
    state.json says it was saved without (a weights-only checkpoint); a state.json that
    cannot be read counts as full, so a damaged folder is never taken for a whole one."""
    try:
        return json.loads((Path(folder) / "state.json").read_text()).get("optimizer_state") is not False
    except (OSError, ValueError, AttributeError, UnicodeDecodeError):
        return True


def _files(folder: Path) -> tuple[str, ...]:
    """The files checkpoint `folder` must hold (FILES, less the optimizer's in a weights-only
    one)."""
    if has_optimizer_state(folder):
        return FILES
    return tuple(name for name in FILES if name != "optimizer.safetensors")


def _complete(run_dir: Path) -> list[Path]:
    """Checkpoint folders with every file, oldest first."""
    found = sorted(Path(run_dir).glob(f"{PREFIX}*")) if Path(run_dir).exists() else []
    return [f for f in found if all((f / name).is_file() for name in _files(f))]


def problem(folder: Path) -> str | None:
    """Why checkpoint `folder` cannot be resumed (a missing file; a weights, optimizer or RNG
    file cut short or corrupt; a state.json or config.toml that does not parse), or None when
    it is whole. Reads the safetensors headers and the small files, not the tensors."""
    folder = Path(folder)
    files = _files(folder)
    missing = [name for name in files if not (folder / name).is_file()]
    if missing:
        return f"missing {', '.join(missing)}"
    for name in (n for n in files if n.endswith(".safetensors")):
        try:
            check_safetensors(folder / name)
        except UserError as err:
            return str(err)
    try:
        step_of(folder)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        return f"{folder / 'state.json'} is not a checkpoint state ({type(err).__name__}: {err})"
    try:
        tomllib.loads((folder / "config.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        return f"{folder / 'config.toml'} does not parse ({err})"
    return None


def find(run_dir: Path) -> tuple[Path | None, dict[Path, str]]:
    """(the checkpoint to resume from: the one `latest` names when it is whole, else the
    newest whole one, or None; {every other checkpoint folder that is not whole: why})."""
    run_dir = Path(run_dir)
    folders = sorted(run_dir.glob(f"{PREFIX}*")) if run_dir.is_dir() else []
    verdicts = {}
    for folder in folders:
        try:
            verdicts[folder] = problem(folder)
        except FileNotFoundError:  # pruned by a save in another process while being read:
            continue  # gone, not damaged (`problem` itself reports files that are missing)
    damaged = {f: why for f, why in verdicts.items() if why is not None}
    whole = [f for f, why in verdicts.items() if why is None]
    pointer = run_dir / POINTER
    if pointer.is_file():
        named = run_dir / pointer.read_text(errors="replace").strip()
        if named in whole:
            return named, damaged
    return (whole[-1] if whole else None), damaged


def latest(run_dir: Path) -> Path | None:
    """The checkpoint to resume from (`find`), or None."""
    return find(run_dir)[0]


def set_aside(folder: Path) -> Path:
    """Rename a checkpoint that cannot be resumed to `damaged_<name>` (numbered if taken), out
    of what saves clean up: qarl never deletes what it could not read."""
    for n in range(1000):
        target = folder.with_name(f"damaged_{folder.name}" + (f".{n}" if n else ""))
        if not target.exists():
            os.replace(folder, target)
            return target
    raise RuntimeError(f"cannot set {folder} aside: damaged_{folder.name}.* all taken")


def clear(run_dir: Path) -> None:
    """Remove every checkpoint of a run folder and its pointer (a run that starts over)."""
    for old in Path(run_dir).glob(f"{PREFIX}*"):
        _discard(old)
    (Path(run_dir) / POINTER).unlink(missing_ok=True)


def load_weights(folder: Path, model: nn.Module) -> None:
    """Master weights of checkpoint `folder` into `model`, every name accounted for; a file
    that is not whole or does not fit is a UserError (`weights_problem`) before any is read."""
    folder = Path(folder)
    why = weights_problem(folder, model)
    if why is not None:
        raise UserError(f"{why}: the checkpoint's config.toml builds another model than its "
                        "weights are of (copied from another run, or damaged). Nothing was "
                        f"deleted; move {folder.name} out of {folder.parent} to resume from an "
                        "earlier checkpoint, or start over with --run.resume=false")
    weights = load_file(folder / "model.safetensors")
    if lora_names(model):  # a LoRA learner: exactly its adapters
        load_adapters(model, weights)
    else:
        model.load_state_dict(weights, strict=False)


def load(folder: Path, model: nn.Module, optimizers) -> tuple[dict, RngState]:
    """Restore master weights and optimizer state in place (a weights-only checkpoint leaves
    the optimizers as they are: state["optimizer_state"] is False); return the trainer state
    (the step included) and the RNG state saved with them (restore it with `restore_rng`)."""
    folder = Path(folder)
    load_weights(folder, model)
    state = json.loads((folder / "state.json").read_text())
    scalars = state.pop("optimizers")
    if state.setdefault("optimizer_state", True):
        _unflatten_optimizer(optimizers, load_file(folder / "optimizer.safetensors"), scalars)
    saved = load_file(folder / "rng.safetensors")
    cuda = [saved[f"cuda.{i}"] for i in range(len(saved) - 1)]
    return state, RngState(saved["torch"], cuda, state.pop("python_random"))


def keep_old_metrics(run_dir: Path) -> Path | None:
    """A run starting at step 0 in a folder whose metrics file has no checkpoint behind it (its
    run was stopped before the first save) keeps that file as metrics.<n>.old.jsonl; returns
    where, or None when there was none."""
    old = Path(run_dir) / METRICS
    if not old.is_file():
        return None
    n = 1 + max((int(p.name.split(".")[1]) for p in Path(run_dir).glob("metrics.*.old.jsonl")
                 if p.name.split(".")[1].isdigit()), default=0)
    target = old.with_name(f"metrics.{n}.old.jsonl")
    os.replace(old, target)
    return target


def restore_metrics(folder: Path, run_dir: Path) -> None:
    """Put back the run's metrics file as it was when checkpoint `folder` was saved: rows a
    killed run wrote after it are dropped (the resumed run writes them again)."""
    saved, target = Path(folder) / METRICS, Path(run_dir) / METRICS
    if saved.exists():
        tmp = target.with_name(f".tmp_{METRICS}")
        shutil.copyfile(saved, tmp)
        os.replace(tmp, target)
    else:
        target.unlink(missing_ok=True)
