"""sft.seed: one warm start for every run seed of a comparison."""

from __future__ import annotations

from qarl.config import load_config
from qarl.train.sft import sft_key


def test_sft_seed_shares_one_warm_start_across_run_seeds():
    """sft.seed fixes the warm start (its cache key and data order) whatever run.seed is;
    unset, each run seed has its own, as before."""
    key = lambda **o: sft_key(load_config("tiny", o))  # noqa: E731
    assert key(**{"run.seed": 0}) != key(**{"run.seed": 1})
    assert key(**{"run.seed": 0, "sft.seed": 7}) == key(**{"run.seed": 1, "sft.seed": 7})
    assert key(**{"run.seed": 7}) == key(**{"run.seed": 0, "sft.seed": 7})
