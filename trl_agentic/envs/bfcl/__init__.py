"""BFCL v4 multi-turn as a built-in suite: tasks, environments, the official checker's reward, datasets.

Needs the `bfcl-eval` package installed with `--no-deps` (see docs/bfcl.md). Modules, one concept each:

- `data`: tasks, ground truth, function docs and API classes from the installed package;
- `schema`: tool functions whose TRL-rendered schema is the official function doc;
- `calls`: call strings as the checker reads them, ground-truth calls as tool calls;
- `checker`: the official verdict, and our per-turn partial credit;
- `env`: the environment (one class per tool group), with several user turns and checkpoints;
- `reward`: TRL reward functions;
- `dataset`: rows for TRL's multi-environment mode, train / held-out splits by scenario;
- `traces`: ground-truth conversations played through the environment;
- `evaluate`: BFCL multi-turn accuracy per category of a local model (`trl-agentic eval`).
"""

from .checker import official_verdict, turn_credit
from .data import API_CLASSES, CATEGORIES, BFCLTask, get_task, load_tasks
from .dataset import environment_factories, make_rows, select_tasks, split_scenarios
from .env import BFCLEnv, ToolGroup, environment_class, tool_group
from .reward import bfcl_reward, bfcl_turn_credit

__all__ = [
    "API_CLASSES",
    "CATEGORIES",
    "BFCLEnv",
    "BFCLTask",
    "ToolGroup",
    "bfcl_reward",
    "bfcl_turn_credit",
    "environment_class",
    "environment_factories",
    "get_task",
    "load_tasks",
    "make_rows",
    "official_verdict",
    "select_tasks",
    "split_scenarios",
    "tool_group",
    "turn_credit",
]
