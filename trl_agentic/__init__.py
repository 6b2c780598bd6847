"""trl-agentic: agentic reinforcement learning on top of TRL's GRPOTrainer.

The public API:

- [`AgenticGRPOConfig`] / [`AgenticGRPOTrainer`]: the config and trainer (subclasses of TRL's GRPO classes);
- `trl_agentic.advantages.group_advantages`: GRPO advantages over variable-size groups;
- `trl_agentic.envs`: the environment protocol additions and built-in environments.
"""

__version__ = "0.1.0"

from .config import AgenticGRPOConfig
from .trainer import AgenticGRPOTrainer

__all__ = ["AgenticGRPOConfig", "AgenticGRPOTrainer", "__version__"]
