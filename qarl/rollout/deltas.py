"""`EngineDeltas`: the `DeltaLoader` of an engine that holds its model in this process (the
local engine, also inside a Ray actor): a delta is written into the codes and scales its
quantized layers hold (its own copy, taken at the whole push before), in place (`qarl.quant.delta.apply_delta`), and installed as new
QWeights, so its decode plan repacks them as after a whole push. The engine keeps the label
of the version it holds (`weight_version`), which any unlabelled push (`load_weights`)
clears."""

from __future__ import annotations

import torch

from qarl.quant.delta import StateDelta, apply_delta, owned
from qarl.rollout.protocol import StaleWeights


class EngineDeltas:
    """`DeltaLoader` over an engine with `model`, `load_weights` and `weight_version`."""

    crosses_machines = False  # the engine is in this process

    def __init__(self, engine):
        self.engine = engine

    def versions(self) -> list[int | None]:
        return [self.engine.weight_version]

    def load_versioned(self, state: dict, version: int) -> None:
        """A whole push, its codes and scales copied: the ones deltas patch are the engine's."""
        self.engine.load_weights(owned(state))
        self.engine.weight_version = version

    def load_delta(self, delta: StateDelta) -> None:
        held = self.engine.weight_version
        if held == delta.version:
            return  # already there (a resubmitted push)
        if held != delta.base:
            raise StaleWeights(
                f"a weight delta from version {delta.base} to {delta.version} reached an engine "
                f"that holds version {held}; push it a whole state instead")
        with torch.no_grad():
            apply_delta(self.engine.model, delta)
        self.engine.weight_version = delta.version
