"""RL algorithms as pure torch functions: losses, rollout corrections, advantages, KL estimators.

Imports only torch and `qarl.types`; no config reads, logging or I/O. See README.md here for
the table of losses and corrections and the micro-batch contract.
"""

from qarl.algo.advantages import ADVANTAGE_MODES, GroupInfo, group_advantages, overlong_penalty
from qarl.algo.aggregation import AGGREGATIONS, aggregate
from qarl.algo.common import UnknownNameError, metrics_to_floats
from qarl.algo.corrections import (
    CORRECTIONS,
    Correction,
    apply_corrections,
    compose,
    correction_params,
    validate_correction_params,
)
from qarl.algo.kl import KL_ESTIMATORS, kl_terms
from qarl.algo.losses import LOSSES, global_counts, loss_params, validate_loss_params
from qarl.algo.params import RUNTIME_KWARGS

__all__ = [
    "ADVANTAGE_MODES",
    "AGGREGATIONS",
    "CORRECTIONS",
    "Correction",
    "GroupInfo",
    "KL_ESTIMATORS",
    "LOSSES",
    "RUNTIME_KWARGS",
    "UnknownNameError",
    "aggregate",
    "apply_corrections",
    "compose",
    "correction_params",
    "global_counts",
    "group_advantages",
    "kl_terms",
    "loss_params",
    "metrics_to_floats",
    "overlong_penalty",
    "validate_correction_params",
    "validate_loss_params",
]
