"""The [dist] section of a recipe: how a run spreads over processes and machines
(docs/distributed.md), imported by schema.py into `RunConfig.dist`;
the same conventions hold (strict, frozen, every field described once).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qarl.config.section import SPEED
from qarl.config.section import SECTION as _SECTION


class DistSection(BaseModel):
    """Scale-out: rollout engines as Ray actors (the `qarl[ray]` extra), a data-parallel learner
    over torch.distributed (docs/distributed.md). The defaults run everything in this one
    process, without Ray."""

    model_config = _SECTION

    rollout_workers: int = Field(
        1, ge=1, description="Rollout engines, each in a Ray actor; each step's prompts are split "
        "into contiguous shards over them and the results joined in prompt order (the same tokens "
        "as one engine). 1 = the engine runs in this process and Ray is not used.",
        json_schema_extra=SPEED,
    )
    learner_ranks: int = Field(
        1, ge=1, description="Learner processes joined by torch.distributed (gloo); each takes "
        "its share of the micro-batches and the gradients are summed, so M ranks make the update "
        "of one within float rounding. 1 = the learner runs in this process.",
        json_schema_extra=SPEED,
    )
    learner_strategy: Literal["replicate", "fsdp"] = Field(
        "replicate", description="How learner ranks hold the learner: 'replicate' = every rank "
        "the whole weights and optimizer state, gradients all-reduced; 'fsdp' = FSDP2 shards "
        "of the weights, gradients and AdamW state (1/M each), gathered per decoder block, for "
        "dense learners whose training state does not fit one rank. Same update either way.",
        json_schema_extra=SPEED,
    )
    learner_placement: Literal["local", "ray"] = Field(
        "local", description="Where learner ranks 1..M-1 run: 'local' = processes this one "
        "starts on this machine (no Ray needed); 'ray' = Ray actors the cluster places "
        "(spread over its machines), joined to rank 0 over TCP. Rank 0 is always this process.",
        json_schema_extra=SPEED,
    )
    cpus_per_rank: int = Field(
        1, ge=1, description="CPUs each Ray-placed learner rank reserves (its torch threads); "
        "with learner_placement = 'ray' only.",
    )
    address: str | None = Field(
        None, min_length=1, description="Ray cluster the rollout workers and Ray-placed learner "
        "ranks run on: 'auto' (the one `ray start` runs on this machine) or 'ray://host:port'. "
        "Default: start a local Ray with this machine's CPUs.",
    )
