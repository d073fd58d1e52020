"""Per-step weight sync: quantize the learner once, push codes + scales to the engine.

Also measures what the engine now decodes with, so a run shows whether updates reach the
deployed low-bit policy at all (at small learning rates most int8 codes do not move):
- `sync/changed_code_frac`: fraction of weight codes that differ from the previous push;
- `sync/scale_rel_drift`: mean |s_new - s_old| / |s_old| over the per-channel/group scales;
- `sync/seconds`, `sync/megabytes`: time of export + install (+ the engine's own quantization
  in the naive setup, where it receives full-precision weights) and the size of what was sent
  (a LoRA run, after its first push: the adapters only).
The comparison reads the engine's QuantLinear layers, so it means the same in every mode.

And checks the quantization contract (qarl/quant/contract.py) at every push: before the
engine takes a whole state, each layer's codes must come in the quantizer settings the
engine's layer decodes with (`refuse_other_settings`); after it, where `quant.sync_check` is
on (the default), the digests of what each engine replica now holds
(`Engine.weight_digests`, computed where the engine runs: a Ray actor sends digests, not
weights) must equal those of what the learner pushed, else `ContractBroken` names the replica
and the layers, before the engine samples from them. `contract/seconds` is its cost.
`contract_table` is the layer table a run checks and saves at its start.
"""

from __future__ import annotations

import time

import torch

from qarl.config import QuantSection
from qarl.quant import QWeight, export_state
from qarl.quant.contract import ContractBroken, LayerRow, layer_table, settings_mismatches
from qarl.quant.digests import digest_mismatches, state_digests


class WeightSync:
    """`adapters`: the learner's LoRA tensor names (qarl.lora.layers): after the first push,
    which gives the engine the whole (frozen) base, only those go to the engine."""

    def __init__(self, learner, engine, check: bool = True, adapters: list[str] = ()):
        self.learner, self.engine, self.check = learner, engine, check
        self.adapters = list(adapters)
        self.previous: dict[str, QWeight] = {}
        self.pushed = False

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        state = export_state(self.learner)
        if self.adapters and self.pushed:  # the frozen base is already there
            sent = {name: state[name] for name in self.adapters}
            self.engine.load_weights(sent, partial=True)
        else:  # (an engine that takes no partial state is asked for whole ones only)
            sent = state
            self.refuse_other_settings(sent)
            self.engine.load_weights(sent)
        self.pushed = True
        current = self.engine.qweights()
        seconds = time.perf_counter() - start
        megabytes = sum(v.nbytes() if isinstance(v, QWeight) else v.numel() * v.element_size()
                        for v in sent.values()) / 2**20
        metrics = {"sync/seconds": seconds, "sync/megabytes": megabytes}
        if self.check:  # the whole state: the base the engine holds must still be the learner's
            start = time.perf_counter()
            self.verify(state)
            metrics["contract/seconds"] = time.perf_counter() - start
        if self.previous and current:
            metrics.update(code_changes(self.previous, current))
        self.previous = current
        return metrics

    def refuse_other_settings(self, sent: dict) -> None:
        """Raise ContractBroken, before the engine takes `sent`, where a layer's codes come in
        other quantizer settings (format, group size, symmetry, shape, dtypes) than the codes
        it decodes with: it would run them with the wrong kernel or scales."""
        wrong = settings_mismatches(sent, self.previous or self.engine.qweights())
        if wrong:
            raise ContractBroken(
                f"the learner's quantizer settings differ from the engine's for {len(wrong)} "
                f"layer(s): {'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}. The engine "
                "would decode the learner's codes with another kernel or scale layout; the run "
                "stopped before it took them (check quant.options and what changed the layer)")

    def verify(self, state: dict) -> None:
        """Raise ContractBroken unless every engine replica holds exactly `state`."""
        expected = state_digests(state)
        replicas = self.engine.weight_digests()
        for index, held in enumerate(replicas):
            wrong = digest_mismatches(expected, held)
            if wrong:
                where = f"rollout worker {index}" if len(replicas) > 1 else "the engine"
                raise ContractBroken(
                    f"after the weight sync {where} holds other weights than the learner pushed "
                    f"for {len(wrong)} tensor(s): {', '.join(wrong[:6])}"
                    f"{' ...' if len(wrong) > 6 else ''}. It would sample from a policy the "
                    "learner is not training (a dropped or stale layer, or an engine that "
                    "changes what it is given); the run stopped before it did")

    def contract_table(self, quant: QuantSection) -> list[LayerRow]:
        """The layer table of the quantization contract: the learner's layers next to the
        engine's (qarl.quant.contract.layer_table), for the recipe's [quant]."""
        return layer_table(self.learner, self.engine.qweights(), quant.scheme, quant.align,
                           quant.include, quant.exclude, quant.contract_exempt)


def code_changes(old: dict[str, QWeight], new: dict[str, QWeight]) -> dict[str, float]:
    changed = total = 0
    drift_sum, drift_count = 0.0, 0
    for name, qw in new.items():
        before = old[name]
        # codes of sub-byte formats are packed bytes: a changed byte = a changed code pair;
        # bytes differ where their uint8 difference is not zero (one pass, no bool tensor)
        changed += int(torch.count_nonzero(qw.codes.view(torch.uint8) - before.codes.view(torch.uint8)))
        total += qw.codes.numel()
        if qw.scales is not None:
            s_old, s_new = before.scales.float(), qw.scales.float()
            # |s_new - s_old| / |s_old|, over scales that are not zero
            nonzero = s_old != 0
            rel = (s_new - s_old).abs()[nonzero] / s_old.abs()[nonzero]
            drift_sum += float(rel.sum())
            drift_count += int(nonzero.sum())
    return {"sync/changed_code_frac": changed / max(1, total),
            "sync/scale_rel_drift": drift_sum / max(1, drift_count)}
