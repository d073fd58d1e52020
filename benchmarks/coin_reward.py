"""A reward for models that solve nothing (the random-weight models of benchmarks/gpu_parts.py):
a fair coin per completion, read from its text's CRC-32, so that a group's rewards differ and
every RL step runs its update as a learning run does. Deterministic: the same text, the same
reward. `task.reward = "coin_reward:coin"` with benchmarks/ on sys.path."""

from __future__ import annotations

import zlib


def coin(prompt: str, completion: str, **fields) -> float:
    return float(zlib.crc32(completion.encode("utf-8")) & 1)
