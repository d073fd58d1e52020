"""The `reasoning_gym` task's reward as reward workers load it (`ReasoningGymTask.reward_spec`):
importing this module imports reasoning-gym, about a second, so a worker pays it while it
starts, before any call's deadline runs."""

import reasoning_gym  # noqa: F401  (imported for its cost, see above)

from qarl.tasks.reasoning_gym_task import reasoning_gym_reward as reward

__all__ = ["reward"]
