"""`reasoning_gym`: problems from reasoning-gym's procedural generators, scored by their own
`score_answer` (the optional extra `pip install 'qarl[reasoning-gym]'`; it generates offline).

Options: `dataset` (a generator's name, e.g. "chain_sum") and that generator's parameters
(`min_terms = 2, ...`: the fields of its config, less seed and size), or `mixture`, a list of
tables `{dataset = ..., weight = ..., <parameters>}` drawn by weight (default 1). `system`
names one of reasoning-gym's system prompts (`reasoning_gym.utils.SYSTEM_PROMPTS`), or None
for none (then `task.system_prompt` applies).

Splits. Eval is a fixed pool of `eval_problems` problems generated at seeds from 2^40 on;
training problems at seeds below 2^31 drawn from (seed, step). reasoning-gym seeds item i of a
generator with `Random(seed + i)`, so the two seed ranges never share a random stream; on top
of that, a training problem whose question text is in the eval pool is dropped and another
drawn, so train and eval are disjoint by text (checked, not assumed). `examples("eval", n,
seed)` shuffles the pool by the seed and cycles through it (n > eval_problems repeats).

Reward. The answer is the text inside the last `<answer>...</answer>` (reasoning-gym's
`extract_answer`, the tag its system prompts ask for). Without the tag, with `fallback = true`
(the default), the answer is taken from the completion's last non-empty line: the text after
its last " is ", ":" or "=" (the whole line if none), stripped of spaces, `*`, backticks and
quotes and of a final period ("The sum is 7." -> "7"); with `fallback = false` there is no
answer (None, which reasoning-gym scores 0). The generator's `score_answer(answer, entry)`
gives the reward (in [0, 1]; some generators give partial credit). The entry is regenerated in
the reward worker from its source (generator, parameters, seed, size, index), so nothing but
JSON travels, and a regenerated question that differs from the prompt is an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
import re
from collections import OrderedDict
from typing import Any

from qarl.tasks.base import Example, check_split_args

INSTALL = "pip install 'qarl[reasoning-gym]'"
EVAL_SEED = 2**40  # eval pools start here; training seeds are below 2**31
MAX_CHUNKS = 50  # generator re-draws before a split is declared exhausted
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_WRAPPERS = "*`\"' "  # stripped around a fallback answer
_MARKER = re.compile(r"\sis\s|[:=]")  # the answer follows the last of these on its line


def _rg():
    """The reasoning_gym package, or ImportError naming the extra."""
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError(f"task 'reasoning_gym' needs the reasoning-gym package: {INSTALL}")
    return reasoning_gym


def extract_answer(completion: str, fallback: bool = True) -> str | None:
    """The answer in a completion: the last <answer> tag's text, else (fallback) what follows
    the last " is ", ":" or "=" of the last non-empty line (module docstring); None when there
    is none."""
    tags = _ANSWER_TAG.findall(completion)
    if tags:
        return tags[-1].strip()
    if not fallback:
        return None
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    if not lines:
        return None
    markers = list(_MARKER.finditer(lines[-1]))
    answer = lines[-1][markers[-1].end():] if markers else lines[-1]
    answer = answer.strip().strip(_WRAPPERS)
    return answer[:-1].strip(_WRAPPERS) if answer.endswith(".") else answer


def generator_params(name: str) -> list[str]:
    """Parameter names of a generator: its config's fields, less seed and size (qarl's)."""
    _, config_cls = _rg().factory.DATASETS[name]
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]


def spec_problems(spec: Any, where: str) -> list[tuple[str, str]]:
    """(option path, message) for each problem of one generator spec {dataset, [weight],
    parameters}: an unknown generator or parameter, a weight that is not > 0, or parameters
    its config's own validation rejects."""
    if not isinstance(spec, dict) or not isinstance(spec.get("dataset"), str):
        return [(where, f"{spec!r} names no generator; give {{dataset = 'chain_sum', ...}}")]
    datasets = _rg().factory.DATASETS
    name = spec["dataset"]
    if name not in datasets:
        close = difflib.get_close_matches(name, datasets, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(datasets))}"
        return [(f"{where}.dataset", f"unknown reasoning-gym generator {name!r}; {hint}")]
    weight = spec.get("weight", 1.0)
    problems = []
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        problems.append((f"{where}.weight", f"{weight!r} is not a number > 0"))
    params = {k: v for k, v in spec.items() if k not in ("dataset", "weight")}
    valid = generator_params(name)
    for key in sorted(set(params) - set(valid)):
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(valid)}"
        problems.append((f"{where}.{key}", f"not a parameter of {name!r}; {hint}"))
    if not problems:
        try:
            make_generator(name, params, seed=0, size=1)[0]
        except Exception as err:  # the generator's own checks: assert, ValueError, TypeError
            problems.append((where, f"{name!r} rejects {params}: {type(err).__name__}: {err}"))
    return problems


def option_problems(options: dict[str, Any]) -> list[tuple[str, str]]:
    """(option path, message) for every problem of the task's options, or one naming the
    extra when reasoning-gym is not installed."""
    try:
        rg = _rg()
    except ImportError as err:
        return [("", str(err))]
    own = {"eval_problems", "system", "fallback", "mixture", "dataset"}
    problems = []
    if ("dataset" in options) == ("mixture" in options):
        return [("", "give either dataset (a generator and its parameters) or mixture (a list "
                     "of {dataset, weight, parameters}), not both or neither")]
    if "mixture" in options:
        mixture = options["mixture"]
        if not isinstance(mixture, list) or not mixture:
            return [("mixture", f"{mixture!r} is not a non-empty list of tables")]
        extra = sorted(set(options) - own)
        problems += [(key, "a generator parameter goes inside its mixture entry") for key in extra]
        for i, spec in enumerate(mixture):
            problems += spec_problems(spec, f"mixture.{i}")
    else:
        spec = {k: v for k, v in options.items() if k not in own - {"dataset"}}
        problems += [(path.partition(".")[2], message)
                     for path, message in spec_problems(spec, "spec")]
    n = options.get("eval_problems", 200)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        problems.append(("eval_problems", f"{n!r} is not an integer >= 1"))
    system = options.get("system", "default")
    if system is not None and system not in rg.utils.SYSTEM_PROMPTS:
        problems.append(("system", f"{system!r} is not one of reasoning-gym's system prompts "
                                   f"({', '.join(sorted(rg.utils.SYSTEM_PROMPTS))})"))
    if not isinstance(options.get("fallback", True), bool):
        problems.append(("fallback", f"{options['fallback']!r} is not true or false"))
    return problems


def make_generator(name: str, params: dict[str, Any], seed: int, size: int):
    """A reasoning-gym dataset (`ds[i]` is problem i) with these parameters."""
    return _rg().create_dataset(name, seed=seed, size=size, **params)


class ReasoningGymTask:
    """reasoning-gym generators as a qarl task; see the module docstring."""

    option_problems = staticmethod(option_problems)  # the config check of open options

    def __init__(self, dataset: str | None = None, mixture: list[dict] | None = None,
                 eval_problems: int = 200, system: str | None = "default",
                 fallback: bool = True, **params: Any) -> None:
        options = {"eval_problems": eval_problems, "system": system, "fallback": fallback,
                   **params, **({"dataset": dataset} if dataset is not None else {}),
                   **({"mixture": mixture} if mixture is not None else {})}
        problems = option_problems(options)
        if problems:
            raise ValueError("invalid options for task 'reasoning_gym': " + "; ".join(
                f"{path}: {message}" if path else message for path, message in problems))
        specs = mixture if mixture is not None else [{"dataset": dataset, **params}]
        self.specs = [({k: v for k, v in s.items() if k not in ("dataset", "weight")},
                       s["dataset"], float(s.get("weight", 1.0))) for s in specs]
        self.name = "reasoning_gym"
        self.reward_spec = "qarl.tasks.reasoning_gym_reward:reward"  # imports reasoning-gym
        self.eval_problems, self.fallback = eval_problems, fallback
        self.system = None if system is None else _rg().utils.SYSTEM_PROMPTS[system]
        self._eval: list[Example] | None = None

    def _draw(self, picks: list[int], seed_of, keep) -> list[Example]:
        """One example per pick (a generator's index), generated in chunks at seeds
        `seed_of(generator, chunk)`, skipping those `keep` refuses."""
        out: list[Example | None] = [None] * len(picks)
        for g, (params, name, _) in enumerate(self.specs):
            slots = [i for i, pick in enumerate(picks) if pick == g]
            chunk = 0
            while slots:
                if chunk == MAX_CHUNKS:
                    raise ValueError(
                        f"reasoning-gym {name!r} {params} gave too few new problems in "
                        f"{MAX_CHUNKS} draws: its problem space is nearly all in the eval pool; "
                        "lower eval_problems or widen the generator's parameters")
                seed, size = seed_of(g, chunk), len(slots)
                ds = make_generator(name, params, seed, size)
                for index in range(size):
                    example = self._example(ds[index], name, params, seed, size, index)
                    if keep(example):
                        out[slots.pop(0)] = example
                chunk += 1
        return out  # type: ignore[return-value]

    def _example(self, entry: dict, name: str, params: dict, seed: int, size: int,
                 index: int) -> Example:
        source = {"dataset": name, "params": params, "seed": seed, "size": size, "index": index}
        return Example(prompt=entry["question"], answer=str(entry["answer"]), system=self.system,
                       fields={"source": source, "fallback": self.fallback})

    def _picks(self, rng: random.Random, n: int) -> list[int]:
        weights = [w for _, _, w in self.specs]
        return rng.choices(range(len(self.specs)), weights=weights, k=n)

    def eval_pool(self) -> list[Example]:
        """The fixed eval problems (generated once)."""
        if self._eval is None:
            picks = self._picks(random.Random("eval"), self.eval_problems)
            self._eval = self._draw(picks, lambda g, chunk: EVAL_SEED + 2**20 * g + chunk,
                                    lambda ex: True)
        return self._eval

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        check_split_args(split, n)
        pool = self.eval_pool()
        if split == "eval":
            order = list(pool)
            random.Random(f"eval:{seed}").shuffle(order)
            return [order[i % len(order)] for i in range(n)]
        held_out = {ex.prompt for ex in pool}
        rng = random.Random(f"train:{seed}")
        return self._draw(self._picks(rng, n),
                          lambda g, chunk: random.Random(f"{seed}:{g}:{chunk}").getrandbits(31),
                          lambda ex: ex.prompt not in held_out)

    def reward(self, prompt: str, completion: str, **fields: Any) -> float | None:
        return reasoning_gym_reward(prompt, completion, **fields)

    def reference_completion(self, example: Example) -> str:
        """The gold answer in the answer tag (for warm-start SFT)."""
        return f"<answer>{example.answer}</answer>"


_GENERATORS: OrderedDict[str, Any] = OrderedDict()  # a worker's recent generators, by source


def _entry(source: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(the generator, the problem) a source names, regenerated; generators are cached per
    seed and size."""
    key = json.dumps({k: v for k, v in source.items() if k != "index"}, sort_keys=True)
    if key not in _GENERATORS:
        _GENERATORS[key] = make_generator(source["dataset"], source["params"], source["seed"],
                                          source["size"])
        while len(_GENERATORS) > 16:
            _GENERATORS.popitem(last=False)
    generator = _GENERATORS[key]
    return generator, generator[source["index"]]


def reasoning_gym_reward(prompt: str, completion: str, source: dict[str, Any],
                         fallback: bool = True, **fields: Any) -> float:
    """The generator's own `score_answer` on the answer extracted from `completion`."""
    generator, entry = _entry(source)
    if entry["question"] != prompt:
        raise ValueError(f"reasoning-gym {source['dataset']!r} regenerated another problem "
                         f"for {source}: its generation is not deterministic in the seed")
    return float(generator.score_answer(answer=extract_answer(completion, fallback),
                                        entry=entry))
