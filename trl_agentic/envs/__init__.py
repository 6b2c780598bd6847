"""Tool environments for TRL's `environment_factory`, with the checkpoint protocol used for rollback."""

from .calculator import (
    SYSTEM_PROMPT,
    CalculatorEnv,
    answer_reward,
    make_arithmetic_tasks,
    tool_call_reward,
    tool_use_reward,
)
from .errors import (
    CodeError,
    SandboxCrashed,
    SandboxError,
    SandboxMemoryError,
    SandboxRestoreError,
    SandboxTimeout,
    SandboxUnavailable,
)
from .protocol import check_checkpointable, checkpoint_env, restore_env, tool_methods
from .python_sandbox import PythonSandboxEnv

__all__ = [
    "SYSTEM_PROMPT",
    "CalculatorEnv",
    "CodeError",
    "PythonSandboxEnv",
    "SandboxCrashed",
    "SandboxError",
    "SandboxMemoryError",
    "SandboxRestoreError",
    "SandboxTimeout",
    "SandboxUnavailable",
    "answer_reward",
    "check_checkpointable",
    "checkpoint_env",
    "make_arithmetic_tasks",
    "restore_env",
    "tool_call_reward",
    "tool_methods",
    "tool_use_reward",
]
