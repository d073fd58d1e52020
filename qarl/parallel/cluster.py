"""Joining a Ray cluster: a local one started here by default, or one that already runs."""

from __future__ import annotations

import os
import signal

import ray


def connect(address: str | None) -> None:
    """Make sure this process is connected to Ray. `address` None starts a local cluster with
    the machine's CPUs (no dashboard); "auto" joins the cluster `ray start` runs on this
    machine; "ray://host:port" joins a remote one through Ray Client. A process already
    connected (a test's session, a notebook) is left as it is."""
    if ray.is_initialized():
        return
    # ray.init replaces the SIGTERM handler with one that exits at once: keep the trainer's,
    # which saves a checkpoint first (qarl.train.signals)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if address is None:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
