"""`qarl ARGS...` in a subprocess of test_reliability.py, with one optional test hook:

QARL_TEST_SLOW_DECODE=STEP:MARKER  in RL step STEP (0-based), every decode step first writes
MARKER and sleeps 0.5 s: a generation slow enough to be stopped in the middle of.
"""

import os
import sys
import time
from pathlib import Path

import qarl.rollout.engine as engine
import qarl.train.trainer as trainer
from qarl.cli import main

hook = os.environ.get("QARL_TEST_SLOW_DECODE")
if hook:
    slow_step, marker = hook.split(":", 1)
    current = {}
    real_rl_step, real_decode = trainer.rl_step, engine.decode_one_token

    def rl_step(policy, data, config, step):
        current["step"] = step
        return real_rl_step(policy, data, config, step)

    def decode_one_token(*args, **kwargs):
        if current.get("step") == int(slow_step):
            Path(marker).touch()
            time.sleep(0.5)
        return real_decode(*args, **kwargs)

    trainer.rl_step, engine.decode_one_token = rl_step, decode_one_token

sys.exit(main(sys.argv[1:]))
