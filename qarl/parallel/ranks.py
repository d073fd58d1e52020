"""`RankGroup`: the collectives of one update over the learner ranks (`torch.distributed`, gloo).

With `dist.learner_ranks = M > 1` the trainer process is rank 0 and M - 1 followers run the
follower body the trainer hands to `qarl.parallel.launch` (`qarl.train.learner.follow`). Every rank
computes its share of the step's micro-batches (micro-batch j on rank j mod M); the loss is
normalized by the WHOLE batch's token / sequence counts (`global_counts`), so the gradients of
all micro-batches add up to the one-rank gradient. `RankGroup` is what makes the one update
(`qarl.train.learner.update.update_policy`) run on ranks: the same methods a one-process run gets from
`qarl.train.learner.update.SOLO` (identities there), here collectives:

- `micro_batches` (this rank's share), `sum_gradients` (an `all_reduce` of one flat buffer
  with `dist.learner_strategy = "replicate"`; nothing with "fsdp", whose backward
  reduce-scatters), `all_true`, `sum_floats`, `sum_metrics`;
- `clip_gradients` and `local` (an FSDP gradient or weight is a DTensor shard: its norm is a
  collective, and a finiteness check reads the local shard).

Only the order of the floating-point sums differs from one rank (docs/distributed.md). A rank
that dies breaks the next collective: `LearnerRankDied` names it when it can.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Followers wait in a broadcast while rank 0 generates, scores and evaluates, which can take
# hours on a CPU; a dead rank is noticed by its closed connection, not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(hours=24)


class LearnerRankDied(RuntimeError):
    """A learner rank stopped answering (its process died): the run cannot go on."""


@dataclass
class RankGroup:
    """This process's place among the learner ranks, and the collectives of one update."""

    rank: int
    world: int
    members: tuple = ()  # rank 0: the followers (launch.LocalRank / RayRank), to name a dead one
    lockstep: bool = False  # FSDP: every rank runs every backward (backward is a collective)

    def micro_batches(self, starts: range) -> range:
        """The micro-batch start rows this rank computes: every world-th, from its rank."""
        return starts[self.rank :: self.world]

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Replace every parameter's gradient by its sum over the ranks (fp32 flat buffer);
        a parameter without a gradient on every rank keeps none. FSDP ranks (lockstep):
        nothing to do, their backward reduce-scattered the sums."""
        if self.lockstep:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params])  # [total parameters] float32
        self._all_reduce(has_grad, dist.ReduceOp.MAX)
        self._all_reduce(flat, dist.ReduceOp.SUM)
        offset = 0
        for p, present in zip(params, has_grad.tolist()):
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype) if present else None
            offset += n

    def clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip to `max_norm` (0 = off) and return the total norm before clipping; an FSDP
        gradient's norm is a collective over its shards."""
        if max_norm > 0:
            return _full_float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        grads = [p.grad for p in params]
        if isinstance(grads[0], DTensor):
            return _full_float(torch.nn.utils.get_total_norm(grads))
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor: an FSDP DTensor's local shard, else the tensor."""
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64)."""
        t = torch.tensor(values, dtype=torch.float64)
        self._all_reduce(t, dist.ReduceOp.SUM)
        return t.tolist()

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        """Per-key sums of every rank's metric dict (ranks may miss keys: a rank that stopped
        at a non-finite loss saw fewer micro-batches)."""
        gathered: list = [None] * self.world
        self.call(dist.all_gather_object, gathered, totals)
        keys = sorted({k for d in gathered for k in d})
        return {k: sum(d.get(k, 0.0) for d in gathered) for k in keys}

    def all_true(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32)
        self._all_reduce(t, dist.ReduceOp.MIN)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank (pickled: the ranks are this run's own processes)."""
        box = [obj]
        self.call(dist.broadcast_object_list, box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors) -> None:
        """Rank 0's values of `tensors` (same shapes on every rank), in place."""
        for t in tensors:
            self.call(dist.broadcast, t, src=0)

    def _all_reduce(self, tensor: torch.Tensor, op) -> None:
        self.call(dist.all_reduce, tensor, op=op)

    def call(self, collective, *args, **kwargs) -> None:
        """Run a torch.distributed collective; a dead rank becomes LearnerRankDied."""
        try:
            collective(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as error:
            raise LearnerRankDied(self._who_died(error)) from error

    def _who_died(self, error: BaseException, settle_s: float = 10.0) -> str:
        """Name the dead follower(s). The collective can fail a moment before the death is
        visible (the process not yet reaped, Ray not yet told): look again for `settle_s`."""
        deadline = time.monotonic() + settle_s
        while True:
            dead = [(r, reason) for r, m in enumerate(self.members, start=1)
                    if (reason := m.exit_reason()) is not None]
            if dead or not self.members or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if dead:
            ranks = ", ".join(f"rank {r} ({reason})" for r, reason in dead)
            return (f"learner {ranks} of {self.world} died; its error, if any, is above (a "
                    "Ray-placed rank's: in the Ray logs, /tmp/ray/session_latest/logs)")
        return (f"rank {self.rank}'s collective failed ({str(error).splitlines()[0]}); another "
                f"learner rank of {self.world} is gone")


def _full_float(norm: torch.Tensor) -> float:
    """A norm as a float; an FSDP gradient norm is a DTensor: its full value."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def share_state(group: RankGroup, model: torch.nn.Module, optimizers: list) -> None:
    """Replicated ranks: rank 0's weights (every state-dict entry) and optimizer state on
    every rank (a follower's `model` and `optimizers` take them)."""
    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    group.broadcast_tensors(state.values())
    opt_states = group.broadcast([opt.state_dict() for opt in optimizers])
    if group.rank != 0:
        model.load_state_dict(state)
        for opt, opt_state in zip(optimizers, opt_states):
            opt.load_state_dict(opt_state)


def join_group(rank: int, world: int, init) -> None:
    """Join the learner ranks' process group (gloo). `init`: the rendezvous file's path (local
    ranks), or (host, port) of the TCP store rank 0 opened (Ray-placed ranks)."""
    if isinstance(init, str):
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=COLLECTIVE_TIMEOUT)
        return
    host, port = init
    store = dist.TCPStore(host, port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)


def leave_group() -> None:
    """Leave the process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()
