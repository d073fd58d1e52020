"""Optimization: the RL update's steps, batches, optimizer and checkpoints, and the SFT warm
start."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from qarl.config.section import CHECK, SPEED
from qarl.config.section import SECTION as _SECTION

# The optimizers and learning-rate schedules qarl.train.learner.optim implements (it dispatches on
# these names; they live here so the schema and the code hold one tuple).
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("constant", "cosine", "linear")
# The learner's gradient-pass dtypes (qarl.train.learner.precision resolves "auto")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
# What the straight-through backward of a quantized learner multiplies (qarl.train.learner.precision
# resolves "auto" to one of qarl.quant.linear.BACKWARDS)
QUANT_BACKWARDS = ("auto", "float", "codes")
# Where the learner's logp values come from (qarl.train.policy.make_replayer builds the pass)
LOGP_PATHS = ("decode", "forward")


class TrainSection(BaseModel):
    """Optimization: steps, batch split, optimizer, schedule, checkpoints."""

    model_config = _SECTION

    steps: int = Field(..., ge=1, description="Optimizer steps (one rollout batch each).")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Sequences per forward/backward pass; rollout.batch_size must be a multiple "
        "of it (groups may span micro-batches). The loss is aggregated over the whole batch, "
        "so it sets memory, not the update.",
        json_schema_extra=SPEED,
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass over each rollout batch (verl's "
        "ppo_mini_batch_size, TRL's steps_per_generation): its rows in this many consecutive "
        "equal parts, each a whole number of micro-batches, one step each; with algo.epochs, "
        "epochs x mini_batches steps per rollout batch. Every step after the first is "
        "off-policy (the ratio of logp to old_logp leaves 1, so the losses' clips act) and "
        "costs one pass for logp's value: the decode-path replay of the whole batch, or the "
        "forward of the step's own rows (train.logp_path; docs/learner.md).",
    )
    optimizer: Literal[OPTIMIZERS] = Field(
        "adamw",
        description="'adamw', or 'muon' (torch.optim.Muon on 2-D weight matrices, AdamW on the "
        "rest).",
    )
    lr: float = Field(
        ...,
        ge=0,
        description="Peak learning rate. 0 is a dry run: every phase runs, the weights (and so "
        "the engine's codes) never change.",
    )
    min_lr: float = Field(
        0.0, ge=0, description="Floor of the cosine/linear decay; at most lr."
    )
    lr_schedule: Literal[SCHEDULES] = Field(
        "constant", description="Decay after warmup: to min_lr at the last step, or none."
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear warmup to lr over this many steps (step i, from 0, uses "
        "lr * (i + 1) / warmup_steps); at most steps."
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.999],
        min_length=2,
        max_length=2,
        description="AdamW (beta1, beta2), each in [0, 1).",
    )
    compute_dtype: Literal[COMPUTE_DTYPES] = Field(
        "auto", description="Dtype of the learner's gradient pass: its forward under autocast "
        "and the straight-through backward's GEMMs. Master weights, optimizer state and every "
        "logp value (old_logp, the ratio's numerator: the exact replay) stay as they are, so it "
        "changes gradients only, by bf16 rounding. 'auto': bfloat16 on CUDA and on CPUs with "
        "AMX-BF16, float32 on other CPUs (with AVX512-BF16 alone a bf16 pass gains little "
        "over fp32 by oneDNN; without bf16 arithmetic it is emulated, slower). "
        "docs/learner.md; measured by benchmarks/step_time.py.",
        json_schema_extra=SPEED)
    quant_backward: Literal[QUANT_BACKWARDS] = Field(
        "auto", description="What the straight-through backward of the learner's quantized "
        "layers multiplies: 'float', the upstream gradient g with the dequantized weight and "
        "activations in the gradient pass's dtype; 'codes', g with the codes the forward ran "
        "on. w8a8-int8 (SwitchBack, Wortsman et al. 2023): dL/dx as an int8 GEMM of g, "
        "quantized per row, with the weight codes (g's int8 rounding: about 1% of dL/dx's "
        "norm), dL/dW as a GEMM of g with the int8 activation codes; w4a16-int4 and "
        "w4a16-nvfp4: dL/dW with the bf16 activations their kernel takes, dL/dx in float. "
        "dL/dW's GEMM runs in bf16 where the CPU has bf16 arithmetic or on CUDA (the codes are "
        "exact in bf16: g's rounding only), else fp32. Forward values, old_logp and the ratio "
        "are unchanged. 'auto': 'codes' for a kernel-aligned learner with a float32 gradient "
        "pass where those GEMMs are the faster ones (int8 where its GEMM is torch._int_mm on "
        "VNNI or qarl.native's: AMX, VNNI or AVX2; W4A16 on a CPU with bf16 arithmetic), "
        "'float' elsewhere. docs/learner.md, 'The backward on codes'.",
        json_schema_extra=SPEED)
    logp_path: Literal[LOGP_PATHS] = Field(
        "decode", description="Where every logp value the losses read comes from (old_logp, "
        "and logp's value at each optimizer step after the first): 'decode', the learner's "
        "replay of the sampled tokens on the engine's own decode path in the batch's sampled "
        "shape (exact under kernel alignment and full-precision rollouts: old_logp equals the "
        "sampler's bit for bit); 'forward', the learner's teacher-forced forward without grad, "
        "micro_batch_size rows at a time (the pass verl's compute_log_prob and TRL take; a "
        "little cheaper than a decode-path replay; where the gradient pass is fp32 and no "
        "LoRA adapter trains, it computes the same bits as the gradient forward, so the first "
        "micro-batch's old_logp are the values of the update's first gradient forward, run "
        "ahead, and a later step reads the value of its own gradient forward; else a later "
        "step runs it on its own rows), for naive and fake alignment only, where no pass of "
        "the learner is exact. docs/learner.md.")
    device: str = Field(
        "cpu", description="Where the learner (master weights, optimizer state, gradients), "
        "the local engine, the replay, the weight sync and evaluation run: 'cpu', 'cuda' or "
        "'cuda:N'; refused at load where this machine has no such device. Checkpoints are "
        "written and read through the CPU, so a run resumes on another device. The CUDA path "
        "is checked by benchmarks/gpu_check.sh (docs/training.md, 'Devices').")
    gradient_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward pass "
        "instead of keeping them (the gradient pass's own precision and GEMM library): less "
        "activation memory for one more forward of the layers per micro-batch. The update "
        "is the same. Peak memory: benchmarks/step_time.py --rounds.",
        json_schema_extra=SPEED)
    grad_clip: float = Field(1.0, ge=0, description="Global gradient-norm clip; 0 = off.")
    checkpoint_every: int = Field(
        0, ge=0, description="Save a checkpoint every this many steps; 0 = only at the end."
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="Most recent checkpoints kept in the run folder."
    )
    final_checkpoint: Literal["full", "weights"] = Field(
        "full", description="What the checkpoint of the run's last step holds: 'full', "
        "everything a resume needs (master weights, optimizer state, RNG state), so the run can "
        "later go on with a larger train.steps; 'weights', the same without the optimizer "
        "state (a third of the size under AdamW), so "
        "the run can be evaluated and exported but not extended. Checkpoints before the last "
        "step, and one saved by a stop signal or monitor.early_stop, are always full: a killed "
        "or stopped run resumes either way (docs/training.md, 'Reliability').")
    audit_fraction: float = Field(
        0.125, ge=0, le=1, description="Where the learner's replay of the sampled tokens is "
        "exact by construction (kernel alignment, or scheme 'none'; the local engine; a dense "
        "model), old_logp is the sampler's logprobs and only this fraction of each step's rows "
        "(at least one) is replayed to check it; any difference switches the run to full "
        "replay. 1.0 replays every row, as naive / fake alignment always do (docs/contract.md).",
        json_schema_extra=CHECK)
    audit_full_every: int = Field(
        8, ge=0, description="... and the whole batch is replayed every this many steps, from "
        "step 0; 0 = never.", json_schema_extra=CHECK)
    max_bad_steps: int = Field(
        3, ge=1, description="Abort after this many steps in a row whose loss or gradient was "
        "not finite (each such step is skipped: weights and optimizer state untouched)."
    )
    async_rollouts: bool = Field(
        False, description="One-step-off-policy rollouts (verl's one_step_off_policy, AReaL's "
        "max_head_offpolicyness = 1): a background thread has the engines generate the next "
        "step's batch with the weights they hold while the learner rewards, replays and "
        "updates on this one, and the weight push waits for that generation. The batch of "
        "step t >= 1 is then sampled by the weights of step t - 1 (train.async_staleness): "
        "old_logp is the learner's replay at its current weights on every row, so the "
        "mismatch metrics, the rollout corrections and TBPO's band see the staleness "
        "(`async/staleness`). Checkpoints hold the batch already generated, so a resumed run "
        "continues bit for bit. Not with rollout.engine = 'vllm' in this process (Ray "
        "rollout workers of it are fine). docs/training.md, 'One-step-off-policy rollouts'; "
        "measured by benchmarks/async_rollouts.py.")
    async_staleness: int = Field(
        1, ge=0, le=1, description="With train.async_rollouts: how many weight versions the "
        "sampler of a step's batch is behind the learner. 1: one step off policy, generation "
        "overlapping the update; 0: the same background path with no overlap (each batch "
        "generated with the current weights, then trained on), which gives the synchronous "
        "run's weights bit for bit.")


class SftSection(BaseModel):
    """Optional supervised warm start on the task's reference answers, before RL."""

    model_config = _SECTION

    steps: int = Field(0, ge=0, description="SFT optimizer steps; 0 = no warm start.")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate (constant, AdamW).")
    batch_size: int = Field(16, ge=1, description="Prompt + answer sequences per SFT step.")
    seed: int | None = Field(
        None, ge=0,
        description="Seed of the warm start's data order; default: run.seed. Set, every seed "
        "of a comparison starts RL from the same warm-started model (trained once, with every "
        "core, before its runs start; cached).",
    )
