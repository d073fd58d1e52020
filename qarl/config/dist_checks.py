"""The checks of the [dist] section (docs/distributed.md), run with the others by
`qarl.config.checks.run_checks`: a recipe that cannot be spread as it asks fails at load time."""

from __future__ import annotations

import importlib.util

from qarl.config.errors import Problem


def dist_is_possible(dist, rollout, train) -> list[Problem]:
    """[dist]: Ray (the `qarl[ray]` extra) for rollout_workers > 1 and for Ray-placed learner
    ranks; an address only with something to place there; at most one rollout worker per
    sequence and one learner rank per micro-batch of a step; cpus_per_rank only for Ray ranks."""
    problems = []
    ray_ranks = dist.learner_placement == "ray" and dist.learner_ranks > 1
    on_ray = dist.rollout_workers > 1 or ray_ranks
    if dist.address is not None and not on_ray:
        problems.append(Problem("dist.address", f"is {dist.address!r} but rollout_workers is 1 "
                                "and no learner rank is placed by Ray, so nothing would run on "
                                "Ray; raise rollout_workers, set learner_placement = 'ray' with "
                                "learner_ranks > 1, or remove the address"))
    if on_ray and importlib.util.find_spec("ray") is None:
        key, value = (("dist.rollout_workers", dist.rollout_workers) if dist.rollout_workers > 1
                      else ("dist.learner_placement", "'ray'"))
        problems.append(Problem(key, f"{value} needs Ray, which is not installed; pip install "
                                "'qarl[ray]' (or run in this process: rollout_workers = 1, "
                                "learner_placement = 'local')"))
    if dist.learner_placement == "ray" and dist.learner_ranks == 1:
        problems.append(Problem("dist.learner_placement", "'ray' but learner_ranks is 1: the "
                                "only rank is this process; raise learner_ranks or use 'local'"))
    if dist.cpus_per_rank != 1 and dist.learner_placement != "ray":
        problems.append(Problem("dist.cpus_per_rank", f"{dist.cpus_per_rank} applies to "
                                "Ray-placed learner ranks only (local ranks share this machine's "
                                "cores); set learner_placement = 'ray' or remove it"))
    if dist.rollout_workers > rollout.batch_size:
        problems.append(Problem("dist.rollout_workers", f"{dist.rollout_workers} is more than "
                                f"the {rollout.batch_size} sequences of a step "
                                "(rollout.batch_size); lower it"))
    # the micro-batches of one optimizer step (of a mini-batch: train.mini_batches); where the
    # batch does not split into them, batch_is_whole_micro_batches says so and nothing here
    # would add to it
    per_step = train.micro_batch_size * max(1, train.mini_batches)
    if rollout.batch_size % per_step:
        return problems
    micro_batches = rollout.batch_size // per_step
    if dist.learner_ranks > micro_batches:
        problems.append(Problem("dist.learner_ranks", f"{dist.learner_ranks} is more than the "
                                f"{micro_batches} micro-batches of an optimizer step "
                                "(rollout.batch_size / train.micro_batch_size / "
                                "train.mini_batches); lower it or the micro-batch size"))
    return problems + fsdp_fits(dist, micro_batches, train)


def fsdp_fits(dist, micro_batches: int, train) -> list[Problem]:
    """learner_strategy = 'fsdp': several ranks, the same number of micro-batches on each
    (forward and backward are collectives), and AdamW (Muon needs whole matrices)."""
    if dist.learner_strategy != "fsdp":
        return []
    if dist.learner_ranks == 1:
        return [Problem("dist.learner_strategy", "'fsdp' but learner_ranks is 1: there is "
                        "nothing to shard over; raise learner_ranks or use 'replicate'")]
    problems = []
    if micro_batches % dist.learner_ranks:
        problems.append(Problem("dist.learner_strategy", f"'fsdp' needs the {micro_batches} "
                                "micro-batches of an optimizer step (rollout.batch_size / "
                                "train.micro_batch_size / train.mini_batches) to be a "
                                "multiple of learner_ranks "
                                f"({dist.learner_ranks}): every rank runs as many; change "
                                "one of them"))
    if train.optimizer != "adamw":
        problems.append(Problem("dist.learner_strategy", f"'fsdp' with train.optimizer = "
                                f"{train.optimizer!r}: Muon orthogonalizes whole matrices, "
                                "which FSDP shards; use 'adamw' or learner_strategy = "
                                "'replicate'"))
    return problems
