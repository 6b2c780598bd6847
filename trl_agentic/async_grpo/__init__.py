"""trl-agentic on TRL's asynchronous GRPO trainer: `AsyncAgenticGRPOConfig` and `AsyncAgenticGRPOTrainer`.

See `docs/async.md`. Needs vLLM (TRL's rollout worker requires it) and a vLLM server; `trl_agentic.async_grpo.server`
starts one.
"""

from .config import AsyncAgenticGRPOConfig
from .trainer import AsyncAgenticGRPOTrainer

__all__ = ["AsyncAgenticGRPOConfig", "AsyncAgenticGRPOTrainer"]
