"""The reference policy of the KL term (algo.kl_coef > 0): the learner as the run starts.

`Reference.of` freezes a copy of the learner model made before any update (after the warm
start, in the learner's alignment mode, with its LoRA adapters as they start) and scores a
step's samples with the same value pass as the learner's old_logp (`make_replayer`: the
engine's decode path, or the forward under train.logp_path = 'forward'), under the sampler's
kept sets where it truncated. So the reference runs in the precision of the policy it is a
copy of:

- `kernel`: the deployed quantized policy at step 0, computed by the rollout kernels (the
  same function as the engine that sampled step 0; its masters are released, the codes kept);
- `fake`: the learner's fake-quantized forward at step 0;
- `naive`, or the identity scheme: the full-precision masters at step 0.

A resumed run rebuilds it the same way (the warm start is a pure function of the recipe), and
`digest` lets the checkpoint hold which reference its steps were taken against
(docs/learner.md#the-reference-policy). The cost in memory and time: the `ref_logp` phase and
one frozen model copy, measured by benchmarks/step_time.py with an `algo.kl_coef` arm.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

import torch
from torch import Tensor

from qarl.model.decoder import CausalLM
from qarl.quant.apply import quant_layers, release_masters
from qarl.types import RolloutBatch, SamplingParams


class Reference:
    """A frozen policy that scores sampled tokens: `logp(batch, sampling)` -> [N, L]."""

    def __init__(self, model: CausalLM, scorer, routing_replay: bool = False):
        self.model, self.scorer, self.routing_replay = model, scorer, routing_replay
        self.digest = weights_digest(model)

    @classmethod
    def of(cls, learner: CausalLM, make_scorer: Callable[[CausalLM], object],
           routing_replay: bool = False) -> "Reference":
        """A frozen copy of `learner` scored by `make_scorer(copy)` (the learner's value pass
        around the copy). Kernel-mode quantized layers keep only their codes."""
        frozen = copy.deepcopy(learner).requires_grad_(False).eval()
        layers = quant_layers(frozen).values()
        if layers and all(layer.mode == "kernel" for layer in layers):
            release_masters(frozen)  # kernel layers compute from their codes alone
        return cls(frozen, make_scorer(frozen), routing_replay)

    def logp(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        """The reference's logprobs of the batch's response tokens, [N, L] float32, 0 on
        padding."""
        with torch.no_grad():
            return self.scorer.score_routing(batch, sampling, replay=self.routing_replay)[0]

    def release_caches(self) -> None:
        self.scorer.release_caches()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over the model's tensors (parameters and buffers: codes and scales of quantized
    layers), by name, in name order."""
    h = hashlib.sha256()
    for name, tensor in sorted({**dict(model.named_parameters()),
                                **dict(model.named_buffers())}.items()):
        h.update(name.encode())
        data = tensor.detach().cpu().contiguous()
        h.update(str((data.dtype, tuple(data.shape))).encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
