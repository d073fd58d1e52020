"""Warm-start SFT: teach a fresh model the task's answer format before RL.

The `tiny` zoo model starts from random weights, so RL from scratch would see reward 0 on
every sample. A few hundred steps of cross-entropy on the task's reference completions
(prompt tokens masked out) give it a nonzero success rate. The result is cached under
`$QARL_HOME/sft/<hash of everything that shapes it>/`, so tests and repeated runs pay once.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from qarl.config import RunConfig
from qarl.errors import UserError
from qarl.model import DTYPES, CausalLM, load_model, load_tokenizer, save_model
from qarl.model.loading import check_safetensors
from qarl.model.tokenizer import read_chat_template
from qarl.paths import cache_lock, qarl_home
from qarl.rollout.engine import left_pad
from qarl.train.learner.logprobs import response_logprobs
from qarl.train.signals import check_stop
from qarl.types import RolloutBatch


def sft_seed(config: RunConfig) -> int:
    """The warm start's seed: sft.seed, or the run's."""
    return config.run.seed if config.sft.seed is None else config.sft.seed


def sft_key(config: RunConfig) -> str:
    task = config.task.model_dump(include={"name", "dataset", "options", "system_prompt",
                                           "chat_template"})
    if isinstance(config.task.chat_template, str):  # the template's text, not its file's name
        task["chat_template"] = read_chat_template(config.task.chat_template)
    shape = {
        "model": config.model.name, "dtype": config.model.master_dtype, "task": task,
        "sft": config.sft.model_dump(exclude={"seed"}), "seed": sft_seed(config), "version": 1,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sft_folder(config: RunConfig) -> Path:
    """The warm start's cache entry, `$QARL_HOME/sft/<sft_key>`: ready once it holds
    model.safetensors."""
    return qarl_home() / "sft" / sft_key(config)


def teacher_batch(encoder, examples, tokenizer, end_id: int) -> RolloutBatch:
    """Prompt ids (templated by `encoder`, a PromptEncoder; left-padded as the engine pads)
    + reference completion ids + end token (right-padded), as a RolloutBatch."""
    prompts = encoder.encode_prompts(examples)
    answers = [tokenizer.encode(encoder.task.reference_completion(ex)) + [end_id] for ex in examples]
    pad, L = tokenizer.pad_token_id, max(map(len, answers))
    prompt_ids, prompt_mask = left_pad(prompts, len(tokenizer.hf), pad)  # [N, P] each
    response_ids = torch.tensor([a + [pad] * (L - len(a)) for a in answers])  # [N, L]
    response_mask = torch.tensor([[True] * len(a) + [False] * (L - len(a)) for a in answers])
    return RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask,
                        torch.zeros(response_ids.shape), [])


def chat_end_id(tokenizer) -> int:
    """The token that closes an assistant turn (ChatML `<|im_end|>` when it is an EOS)."""
    im_end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    return im_end if im_end in tokenizer.eos_token_ids else tokenizer.eos_token_ids[0]


def run_sft(config: RunConfig, model: CausalLM, log=print) -> CausalLM:
    from qarl.train.data import prompt_side

    tokenizer = load_tokenizer(config.model.name)
    task, encoder = prompt_side(config, tokenizer)
    end_id = chat_end_id(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=config.sft.lr)
    model.train()
    for step in range(config.sft.steps):
        check_stop()  # SIGTERM / SIGINT end a warm start between steps (nothing is cached)
        seed = random.Random(f"sft:{sft_seed(config)}:{step}").getrandbits(31)
        batch = teacher_batch(encoder, task.examples("train", config.sft.batch_size, seed), tokenizer, end_id)
        logp, _ = response_logprobs(model, batch)
        # cross-entropy on the completion tokens only: -mean log p(y_t | prompt, y_<t)
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(1, config.sft.steps // 5) == 0:
            log(f"sft step {step + 1}/{config.sft.steps}: loss {loss.item():.4f}")
    return model.eval()


def warm_start(config: RunConfig, log=print) -> CausalLM | None:
    """The warm-started model (cached), or None when the recipe has no SFT steps."""
    if config.sft.steps == 0:
        return None
    folder = sft_folder(config)
    dtype = DTYPES[config.model.master_dtype]
    if not (folder / "model.safetensors").exists():
        with cache_lock(folder, check_stop):  # two runs of one warm start: one trains, one waits
            if not (folder / "model.safetensors").exists():
                shutil.rmtree(folder, ignore_errors=True)  # an older qarl's unfinished folder
                torch.manual_seed(sft_seed(config))
                model = run_sft(config, load_model(config.model.name, dtype=dtype), log)
                tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
                try:
                    save_model(model, tmp)
                    tmp.chmod(0o755)
                    os.replace(tmp, folder)
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)
    try:
        check_safetensors(folder / "model.safetensors")
    except UserError as err:
        raise UserError(f"the cached warm start {folder} is damaged ({err}); delete that folder "
                        "and run again: the warm start is trained anew") from None
    return load_model(folder, dtype=dtype)
