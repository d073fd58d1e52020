"""Per-step weight sync: quantize the learner once, push codes + scales to the engine.

Also measures what the engine now decodes with, so a run shows whether updates reach the
deployed low-bit policy at all (at small learning rates most int8 codes do not move):
- `sync/changed_code_frac`: fraction of weight codes that differ from the previous push;
- `sync/scale_rel_drift`: mean |s_new - s_old| / |s_old| over the per-channel/group scales;
- `sync/seconds`, `sync/megabytes`: time of export + install (+ the engine's own quantization
  in the naive setup, where it receives full-precision weights).
The comparison reads the engine's QuantLinear layers, so it means the same in every mode.
"""

from __future__ import annotations

import time

import torch

from qarl.quant import QWeight, export_state


class WeightSync:
    def __init__(self, learner, engine):
        self.learner, self.engine = learner, engine
        self.previous: dict[str, QWeight] = {}

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        state = export_state(self.learner)
        self.engine.load_weights(state)
        current = self.engine.qweights()
        seconds = time.perf_counter() - start
        megabytes = sum(v.nbytes() if isinstance(v, QWeight) else v.numel() * v.element_size()
                        for v in state.values()) / 2**20
        metrics = {"sync/seconds": seconds, "sync/megabytes": megabytes}
        if self.previous and current:
            metrics.update(code_changes(self.previous, current))
        self.previous = current
        return metrics


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
