"""[dist] on a Ray cluster that qarl joins (`dist.address`), with two nodes on this machine:
a head without CPUs and a worker node with three, so every actor must go to the worker node,
as on a real cluster where the trainer's machine has no room left."""

from __future__ import annotations

import signal

import pytest
from safetensors.torch import load_file

from qarl.train import train
from qarl.train.checkpoint import latest
from rank_weights import FLOAT_BACKWARD, assert_weights_agree

OVERRIDES = {"train.steps": 3, "rollout.batch_size": 16, "train.micro_batch_size": 4,
             "eval.size": 4, "eval.full_precision": False, **FLOAT_BACKWARD}


@pytest.fixture
def two_node_cluster():
    """A head node with 0 CPUs and a worker node with 3 (2 rollout workers + 1 learner rank),
    started on this machine; its address, for dist.address."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    # starting Ray nodes from this process installs Ray's own SIGTERM / SIGINT handlers here
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    cluster.add_node(num_cpus=3)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def test_a_run_on_a_joined_cluster_places_everything_on_its_workers(two_node_cluster, tmp_path):
    """dist.address = the cluster's address, 2 rollout workers and learner rank 1 placed by
    Ray: the actors can only run on the worker node (the head has no CPUs: a rank that found no
    room would end the run at the join timeout), the run ends, and its master weights are
    as close to a one-process run's as rank_weights.py allows."""
    base = {**OVERRIDES, "run.output_dir": str(tmp_path)}
    train("tiny", {**base, "run.name": "cluster", "dist.address": two_node_cluster,
                   "dist.rollout_workers": 2, "dist.learner_ranks": 2,
                   "dist.learner_placement": "ray"})
    train("tiny", {**base, "run.name": "one"})
    cluster = load_file(latest(tmp_path / "cluster") / "model.safetensors")
    one = load_file(latest(tmp_path / "one") / "model.safetensors")
    assert cluster.keys() == one.keys()
    assert_weights_agree(one, cluster)
