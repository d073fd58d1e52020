"""A `fake` learner's replay (old_logp) with its blocks fused on the layers' own GEMMs vs each
layer's own forward, and vs a teacher-forced forward, interleaved in one process on one rollout
batch: one JSON object.

    .venv/bin/python benchmarks/fake_replay.py                    # recipes/tbpo.toml, 3 repeats
    .venv/bin/python benchmarks/fake_replay.py --recipe default --override quant.align=fake

The recipe's SFT warm start is trained first where the cache lacks it (`qarl sft RECIPE` does
it alone; 22 min for tbpo on 2 Zen 3 cores). "fused" is the trainer's replayer
(`qarl.rollout.prepack`: fused fake blocks); "own" a replayer of the same learner with block
fusion off (every layer's own `Block.forward`, what ran before fake blocks fused). "forward" is
no replay at all: the learner's teacher-forced pass without grad, micro_batch_size rows at a
time (`train.logp_path = 'forward'`: `qarl.train.logprobs.ForwardScorer`, the value verl's
`compute_log_prob` and TRL take). The logprob columns say how far the three are apart and
from the sampler's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from qarl.config import load_config
from qarl.native import machine
from qarl.native.memory import tune_allocator
from qarl.rollout import LocalEngine
from qarl.train.logprobs import ForwardScorer
from qarl.train.setup import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import sampling_params, train_examples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tbpo")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--repeats", type=int, default=3, help="replays per arm")
    args = parser.parse_args()
    tune_allocator()
    overrides = dict(item.split("=", 1) for item in args.override)
    with tempfile.TemporaryDirectory() as out:
        config = load_config(args.recipe, {**overrides, "run.output_dir": out,
                                           "run.resume": False, "eval.size": 8})
        if config.quant.align != "fake":
            raise SystemExit(f"recipe {args.recipe!r} has quant.align={config.quant.align!r}; "
                             f"add --override quant.align=fake")
        with open_run(config, learner=warm_start(config)) as (_, policy, data):
            result = measure(config, policy, data, args.repeats)
    print(json.dumps({**result, "recipe": args.recipe, "overrides": overrides,
                      "threads": torch.get_num_threads(), "machine": machine(),
                      "unit": "seconds per replay of the batch; |dlogp| in nats per token"},
                     indent=1))


def measure(config, policy, data, repeats: int) -> dict:
    policy.sync.push()
    sampling = sampling_params(config.rollout)
    group = config.rollout.group_size
    examples = train_examples(data.task, config.run.seed, 0, config.rollout.batch_size // group)
    prompts = [ids for ids in data.prompts.encode_prompts(examples) for _ in range(group)]
    batch = policy.engine.generate(prompts, sampling, seed=config.run.seed)
    fused = policy.learner.replayer  # the trainer's: fused fake blocks
    own = LocalEngine(fused.model, eos_token_ids=fused.eos_token_ids,
                      pad_token_id=fused.pad_token_id, max_context=fused.max_context,
                      fuse_blocks=False)  # every layer's own forward

    scorer = ForwardScorer(fused.model, config.train.micro_batch_size)  # train.logp_path
    runs = {"fused": lambda: fused.score(batch, sampling),
            "own": lambda: own.score(batch, sampling),
            "forward": lambda: scorer.score_routing(batch, sampling)[0]}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    logp = {}
    for i in range(repeats):
        names = list(runs)[:: 1 if i % 2 else -1]  # alternate which arm goes first
        for name in names:
            fused.release_caches()  # packs built anew, as for each step's new weights
            own.release_caches()
            start = time.perf_counter()
            logp[name] = runs[name]()
            seconds[name].append(round(time.perf_counter() - start, 2))
    mask = batch.response_mask

    def apart(a, b) -> float:
        return round(float((a - b)[mask].abs().mean()), 5)

    return {"seconds": seconds, "rows": batch.num_sequences,
            "prompt_len": batch.prompt_ids.shape[1], "response_len": batch.response_ids.shape[1],
            "tokens": int(mask.sum()), "describe": fused.describe()["model.layers.0"],
            "fused_vs_own": apart(logp["fused"], logp["own"]),
            "fused_vs_sampler": apart(logp["fused"], batch.rollout_logp),
            "own_vs_sampler": apart(logp["own"], batch.rollout_logp),
            "forward_vs_fused": apart(logp["forward"], logp["fused"]),
            "forward_vs_sampler": apart(logp["forward"], batch.rollout_logp)}


if __name__ == "__main__":
    main()
