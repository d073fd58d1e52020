"""Checkpoints: master weights, optimizer state and the step, with no pickles.

A checkpoint is a folder `step_000012/` holding `model.safetensors` (the master weights; a
tied weight is stored once), `optimizer.safetensors` (every tensor of every optimizer's state,
flattened to names `<optimizer>.<param id>.<key>`) and `state.json` (the step; the caller's
`state` dict, which for the trainer is the wall-clock `time` of the save; per optimizer, its
param groups and non-tensor per-parameter state). Nothing else is saved: no RNG state and no
data cursor, because the trainer derives each step's prompts and sampling seed from
(run.seed, step). A run folder keeps the newest `keep` checkpoints; `latest(run_dir)` finds
the one to resume from. Writes go to a temporary folder renamed into place, so a run killed
mid-save never leaves a half checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

PREFIX = "step_"


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
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save(run_dir: Path, step: int, model: nn.Module, optimizers, state: dict, keep: int = 2) -> Path:
    run_dir = Path(run_dir)
    final = run_dir / f"{PREFIX}{step:06d}"
    tmp = run_dir / f".tmp_{PREFIX}{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}
    # Tied weights are one tensor under two names; safetensors refuses shared storage.
    seen: dict[int, str] = {}
    for name in list(weights):
        ptr = weights[name].data_ptr()
        if ptr in seen:
            del weights[name]
        seen.setdefault(ptr, name)
    save_file(weights, tmp / "model.safetensors")
    opt_tensors, opt_scalars = _flatten_optimizer(optimizers)
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "step": step, "optimizers": opt_scalars}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(run_dir.glob(f"{PREFIX}*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def clear(run_dir: Path) -> None:
    """Remove every checkpoint of a run folder (a run that starts over)."""
    for old in Path(run_dir).glob(f"{PREFIX}*"):
        shutil.rmtree(old, ignore_errors=True)


def latest(run_dir: Path) -> Path | None:
    found = sorted(Path(run_dir).glob(f"{PREFIX}*")) if Path(run_dir).exists() else []
    return found[-1] if found else None


def load_weights(folder: Path, model: nn.Module) -> None:
    """Master weights of checkpoint `folder` into `model`, every name accounted for."""
    folder = Path(folder)
    weights = load_file(folder / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    parameters = dict(model.named_parameters())
    missing = [n for n in missing if n in parameters]
    tied = {n for n in missing if n == "lm_head.weight"}
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"checkpoint {folder} does not fit this model: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}; was it written by another recipe's model?"
        )


def load(folder: Path, model: nn.Module, optimizers) -> dict:
    """Restore master weights and optimizer state in place; return the trainer state."""
    folder = Path(folder)
    load_weights(folder, model)
    state = json.loads((folder / "state.json").read_text())
    _unflatten_optimizer(optimizers, load_file(folder / "optimizer.safetensors"), state.pop("optimizers"))
    return state
