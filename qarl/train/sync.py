"""Per-step weight sync: quantize the learner once, push codes + scales to the engine.

Also measures what the engine now decodes with, so a run shows whether updates reach the
deployed low-bit policy at all (at small learning rates most int8 codes do not move):
- `sync/changed_code_frac`: fraction of weight codes that differ from the previous push,
  and `sync/changed_code_frac/<kind>` per kind of layer (`layer_kind`: q_proj ... down_proj,
  lm_head where quantized), out of the same per-layer counts (`benchmarks/code_change.py`
  reads them against the learning rate);
- `sync/scale_rel_drift`: mean |s_new - s_old| / |s_old| over the per-channel/group scales;
- `sync/seconds`, `sync/megabytes`: time of export + install (+ the engine's own quantization
  in the naive setup, where it receives full-precision weights) and the size of what was sent
  (a LoRA run, after its first push: the adapters only; a delta: the delta);
- `sync/full_megabytes`: the size of the whole state, what a whole push sends;
  `sync/delta`: 1 when the push was a delta.
Where deltas are off the comparison reads the engine's QuantLinear layers, so it means the
same in every mode; with deltas, the QWeights of the learner's previous push, which the
engine holds (the digests say so).

Deltas (`quant.sync_delta`, resolved by `sync_deltas`: by default where a push crosses
machines): where the engine takes them (`Engine.delta_loader`: the local engine, and Ray
workers of it), each push after the first sends only the codes and scales that changed
since the previous push (`qarl.quant.delta`), and every other tensor whole. A push is whole instead when a replica holds another version
than the previous push (`DeltaLoader.versions`: a new or restarted engine, one that missed a
push), when a layer's layout changed, when the delta is not smaller than the whole state,
and when the deltas since the last whole push would add up to more bytes of codes and
scales than that push held: so a restarted Ray actor, which replays the last whole push and
the deltas since, never replays more than two whole pushes, and the object store holds no
more. The learner side keeps the QWeights of its previous push (the base of the next delta):
the learner's own cached codes, held until the push after its next quantization. A LoRA run
pushes its adapters after the first push, never a delta of the frozen codes.

And checks the quantization contract (qarl/quant/contract.py) at every push: before the
engine takes a whole state, each layer's codes must come in the quantizer settings the
engine's layer decodes with (`refuse_other_settings`); after it, where `quant.sync_check` is
on (the default), the digests of what each engine replica now holds
(`Engine.weight_digests`, computed where the engine runs: a Ray actor sends digests, not
weights) must equal those of what the learner pushed, else `ContractBroken` names the replica
and the layers, before the engine samples from them: after a delta, as after a whole push,
the whole state is compared. `contract/seconds` is its cost.
`contract_table` is the layer table a run checks and saves at its start.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from qarl import native
from qarl.config import QuantSection, RunConfig
from qarl.native import bytes as native_bytes
from qarl.quant import SCHEMES, QWeight, export_state
from qarl.quant.contract import ContractBroken, LayerRow, layer_table, settings_mismatches
from qarl.quant.delta import StateDelta, encode_state, tensors_bytes
from qarl.quant.digests import digest_mismatches, hashing_once, state_digests
from qarl.rollout import ENGINES

class WeightSync:
    """`adapters`: the learner's LoRA tensor names (qarl.lora.layers): after the first push,
    which gives the engine the whole (frozen) base, only those go to the engine. `delta`:
    push deltas where the engine takes them (module docstring)."""

    def __init__(self, learner, engine, check: bool = True, adapters: list[str] = (),
                 delta: bool = False):
        self.learner, self.engine, self.check = learner, engine, check
        self.adapters = list(adapters)
        self.delta = delta and not self.adapters and engine.delta_loader() is not None
        self.previous: dict[str, QWeight] = {}  # what the engine decoded with before this push
        self.pushed = False
        self.version = 0  # the weight version of the last push (deltas)
        self.chain_bytes = 0  # deltas' codes and scales since the last whole push
        self.whole_bytes = 0  # that whole push's codes and scales

    def push(self) -> dict[str, float]:
        start = time.perf_counter()
        state = export_state(self.learner)
        loader = self.engine.delta_loader() if self.delta else None
        delta = self.encode(state, loader) if loader is not None else None
        changes, measuring = {}, 0.0
        if self.delta:  # the engine holds the QWeights pushed (the digests check it): reading
            # them back from Ray actors would move the whole state the other way
            current = {k.removesuffix(".weight"): v for k, v in state.items()
                       if isinstance(v, QWeight)}
            if self.previous:  # before a delta patches them (in this process, in place)
                measuring = time.perf_counter()
                changes = code_changes(self.previous, current, None if delta is None else {
                    k.removesuffix(".weight"): d.parts["codes"].changed
                    for k, d in delta.qweights.items() if "codes" in d.parts})
                measuring = time.perf_counter() - measuring  # not the sync's own time
        if delta is not None:
            sent = delta.nbytes()
            loader.load_delta(delta)
            self.chain_bytes += delta.qweight_bytes()
        elif self.adapters and self.pushed:  # the frozen base is already there
            adapters = {name: state[name] for name in self.adapters}
            sent = state_bytes(adapters)
            self.engine.load_weights(adapters, partial=True)
        else:  # (an engine that takes no partial state is asked for whole ones only)
            sent = state_bytes(state)
            self.refuse_other_settings(state)
            if loader is None:
                self.engine.load_weights(state)
            else:
                loader.load_versioned(state, self.version + 1)
                self.chain_bytes = 0
                self.whole_bytes = state_bytes(current)
        self.pushed, self.version = True, self.version + 1
        if not self.delta:
            current = self.engine.qweights()
        seconds = time.perf_counter() - start - measuring
        if not self.delta and self.previous and current:
            changes = code_changes(self.previous, current)
        metrics = {"sync/seconds": seconds, "sync/megabytes": sent / 2**20,
                   "sync/full_megabytes": state_bytes(state) / 2**20,
                   "sync/delta": float(delta is not None), **changes}
        if self.check:  # the whole state: the base the engine holds must still be the learner's
            start = time.perf_counter()
            self.verify(state)
            metrics["contract/seconds"] = time.perf_counter() - start
        self.previous = current
        return metrics

    def encode(self, state: dict, loader) -> StateDelta | None:
        """The delta from the previous push to `state`, where one may be sent (module
        docstring); None for a whole push."""
        if not self.previous or any(v != self.version for v in loader.versions()):
            return None
        held = {f"{name}.weight": qw for name, qw in self.previous.items()}
        delta = encode_state(held, state, self.version, self.version + 1)
        if delta is None or delta.nbytes() >= state_bytes(state):
            return None
        if self.chain_bytes + delta.qweight_bytes() > self.whole_bytes:
            return None  # a restart would replay more than a whole push: anchor again
        return delta

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
        with hashing_once():  # an engine in this process holds the pushed tensors themselves
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

    def describe(self) -> str:
        """One line for the run's log: how the pushes travel."""
        if self.adapters:
            return "weight sync: the whole state once, then the LoRA adapters alone"
        if self.delta:
            return ("weight sync: deltas of the codes and scales after a whole first push "
                    "(quant.sync_delta)")
        return "weight sync: the whole state every step"

    def contract_table(self, quant: QuantSection) -> list[LayerRow]:
        """The layer table of the quantization contract: the learner's layers next to the
        engine's (qarl.quant.contract.layer_table), for the recipe's [quant]."""
        return layer_table(self.learner, self.engine.qweights(), quant.scheme, quant.align,
                           quant.include, quant.exclude, quant.contract_exempt)


def sync_deltas(config: RunConfig, engine) -> bool:
    """`quant.sync_delta` resolved for `engine`: whether the run's pushes may be deltas.
    'auto': where deltas apply (the recipe checks refuse true elsewhere: `sync_delta_fits`)
    and a push crosses machines (`DeltaLoader.crosses_machines`: Ray rollout workers on other
    nodes). On one machine a whole push is a copy through shared memory, or in the learner's
    own process a hand-over by reference, that the delta's encoding does not beat
    (benchmarks/sync_delta.py); a delta also makes the in-process engine keep its own copy of
    the codes."""
    quant = config.quant
    applies = (not SCHEMES[quant.scheme].is_identity and quant.align != "naive"
               and ENGINES[config.rollout.engine].deltas and not config.lora.rank)
    if quant.sync_delta == "auto":
        loader = engine.delta_loader() if applies else None
        return loader is not None and loader.crosses_machines
    return quant.sync_delta and applies


def state_bytes(state: dict) -> int:
    """Bytes of a pushed state: its QWeights serialized, its tensors' bytes (a tied weight
    once)."""
    return (sum(v.nbytes() for v in state.values() if isinstance(v, QWeight))
            + tensors_bytes(v for v in state.values() if not isinstance(v, QWeight)))


def layer_kind(name: str) -> str:
    """The kind of a quantized layer, its module name's last part: `q_proj`, `k_proj`,
    `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj`, `lm_head` (a MoE's experts count
    with the dense projections of their name; its router, where quantized, is `gate`)."""
    return name.rpartition(".")[2]


def code_changes(old: dict[str, QWeight], new: dict[str, QWeight],
                 changed: dict[str, int] | None = None) -> dict[str, float]:
    """Fraction of codes in `new` that differ from `old` (layer name -> QWeight), over every
    layer and per `layer_kind`, and the mean relative drift of the scales. `changed`: the
    changed codes per layer where a delta counted them already (a layer it omits: none)."""
    changed_by_kind: dict[str, int] = {}
    total_by_kind: dict[str, int] = {}
    drift_sum, drift_count = 0.0, 0
    scales_old: list[Tensor] = []
    scales_new: list[Tensor] = []
    for name, qw in new.items():
        before = old[name]
        kind = layer_kind(name)
        # codes of sub-byte formats are packed bytes: a changed byte = a changed code pair;
        # bytes differ where their uint8 difference is not zero (one pass, no bool tensor;
        # on the CPU qarl.native compares them in place)
        if changed is None and native.available() and qw.codes.is_cpu and before.codes.is_cpu:
            moved = native_bytes.count_changed_bytes(qw.codes, before.codes)
        elif changed is None:
            moved = int(torch.count_nonzero(
                qw.codes.view(torch.uint8) - before.codes.view(torch.uint8)))
        else:
            moved = changed.get(name, 0)
        changed_by_kind[kind] = changed_by_kind.get(kind, 0) + moved
        total_by_kind[kind] = total_by_kind.get(kind, 0) + qw.codes.numel()
        if qw.scales is not None:
            scales_old.append(before.scales.reshape(-1).float())
            scales_new.append(qw.scales.reshape(-1).float())
    if scales_old:  # every layer's scales at once: a few ops, not a few per layer
        s_old, s_new = torch.cat(scales_old), torch.cat(scales_new)
        # |s_new - s_old| / |s_old|, over scales that are not zero
        nonzero = s_old != 0
        rel = (s_new - s_old).abs()[nonzero] / s_old.abs()[nonzero]
        drift_sum, drift_count = float(rel.sum()), int(nonzero.sum())
    metrics = {"sync/changed_code_frac": sum(changed_by_kind.values())
               / max(1, sum(total_by_kind.values())),
               "sync/scale_rel_drift": drift_sum / max(1, drift_count)}
    metrics.update({f"sync/changed_code_frac/{kind}": changed_by_kind[kind] / max(1, total)
                    for kind, total in total_by_kind.items()})
    return metrics
