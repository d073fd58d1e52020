"""What a short `tiny` run computes, as hashes: for checking that a change of structure
changed no behaviour.

Runs `qarl.train("tiny")` for a few steps in a temporary folder and prints JSON with the
SHA-256 of the final master weights (every parameter's bytes, in name order) and of
`metrics.jsonl` with every time-dependent field removed (`time/*`, `speed/*`, wall clocks).
Two commits that compute the same thing print the same hashes on the same machine; the
hashes depend on this CPU's kernels, so compare runs of one machine, not a stored value.

    .venv/bin/python benchmarks/fingerprint.py --steps 6
    .venv/bin/python benchmarks/fingerprint.py --steps 6 --set quant.scheme=w4a16-int4 \
        --set quant.align=fake
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

TIMED = ("time/", "speed/")  # and every */seconds key (sync/seconds, contract/seconds, ...)


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items()
            if not k.startswith(TIMED) and not k.endswith("/seconds")
            and k not in ("time", "wall", "elapsed_s")}


def fingerprint(steps: int, seed: int, overrides: list[str]) -> dict:
    import torch
    from safetensors.torch import load_file

    import qarl
    from qarl.config import parse_overrides

    with tempfile.TemporaryDirectory() as out:
        summary = qarl.train("tiny", overrides={
            "train.steps": steps, "run.seed": seed, "run.output_dir": out, "run.name": "fp",
            "train.checkpoint_every": 0,
            **parse_overrides([f"--{o}" for o in overrides]),  # values as on the command line
        })
        run_dir = Path(out) / "fp"
        records = [_untimed(json.loads(line))
                   for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
        checkpoint = sorted(run_dir.glob("step_*"))[-1]
        weights = load_file(str(checkpoint / "model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].contiguous().view(torch.uint8).numpy().tobytes())
    metrics = json.dumps(records, sort_keys=True).encode()
    return {
        "steps": steps, "seed": seed, "overrides": overrides,
        "weights_sha256": digest.hexdigest(),
        "metrics_sha256": hashlib.sha256(metrics).hexdigest(),
        "metrics_records": len(records),
        "final_eval_accuracy": summary["after"].get("eval/accuracy_quantized"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override, e.g. --set quant.scheme=w4a16-int4")
    args = parser.parse_args()
    print(json.dumps(fingerprint(args.steps, args.seed, args.set), indent=1))


if __name__ == "__main__":
    main()
