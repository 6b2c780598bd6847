"""BFCL v4 multi-turn tasks, function docs and API classes, read from the installed `bfcl-eval` package.

`bfcl-eval` (installed with `--no-deps`) ships the four multi-turn categories as JSON-lines files, the ground-truth
call sequences (`possible_answer/`), the official function docs (`multi_turn_func_doc/`) and the stateful API classes
(`eval_checker/multi_turn_eval/func_source_code/`). Only the data files and the modules these need are used: the
package's `bfcl_eval.utils` / `bfcl_eval.constants.eval_config` are never imported, because importing them creates
`result/`, `score/` and `.file_locks/` folders next to the installed package.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("base", "miss_func", "miss_param", "long_context")

# The API classes of the four multi-turn categories (bfcl_eval.constants.executable_backend_config lists them too,
# with the web-search and memory classes of other categories).
API_CLASSES = (
    "GorillaFileSystem",
    "MathAPI",
    "MessageAPI",
    "TicketAPI",
    "TradingBot",
    "TravelAPI",
    "TwitterAPI",
    "VehicleControlAPI",
)

_VERSION_PREFIX = "BFCL_v4"


def _package_data() -> Path:
    try:
        import bfcl_eval
    except ImportError as exc:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "The BFCL suite needs the `bfcl-eval` package: pip install --no-deps 'bfcl-eval==2026.3.23'."
        ) from exc
    return Path(bfcl_eval.__file__).parent / "data"


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class BFCLTask:
    """
    One BFCL multi-turn task.

    Args:
        id (`str`):
            The official id, e.g. `"multi_turn_base_0"`.
        category (`str`):
            One of `CATEGORIES`.
        turns (`list[list[dict]]`):
            The user messages of each turn (`question` in BFCL). A `miss_func` turn that makes a held-out function
            available has no message: BFCL sends a fixed one there.
        initial_config (`dict`):
            The initial state of each API class.
        involved_classes (`list[str]`):
            API classes of the task.
        ground_truth (`list[list[str]]`):
            The ground-truth calls of each turn, as Python call strings (`"cd(folder='document')"`).
        excluded_functions (`list[str]`):
            Functions BFCL lists as excluded for the task (`excluded_function`).
        missed_functions (`dict[int, list[str]]`):
            `miss_func` only: turn index -> functions held out until that turn.
    """

    id: str
    category: str
    turns: list
    initial_config: dict
    involved_classes: list
    ground_truth: list
    excluded_functions: list = field(default_factory=list)
    missed_functions: dict = field(default_factory=dict)

    @property
    def index(self) -> int:
        """The scenario number (`multi_turn_base_17` -> 17): the same number is the same scenario in every category."""
        return int(self.id.rsplit("_", 1)[1])

    @property
    def long_context(self) -> bool:
        """Whether the API states are loaded with BFCL's long-context extensions (what the official checker does)."""
        return "long_context" in self.category

    def test_entry(self) -> dict:
        """The fields of the BFCL test entry the official checker reads."""
        return {
            "id": self.id,
            "initial_config": copy.deepcopy(self.initial_config),
            "involved_classes": list(self.involved_classes),
        }


@functools.cache
def load_tasks(category: str) -> tuple[BFCLTask, ...]:
    """
    Load the tasks of a BFCL multi-turn category with their ground truth.

    Args:
        category (`str`): One of `CATEGORIES`.

    Returns:
        `tuple[BFCLTask, ...]`: The 200 tasks, in the file's order.
    """
    if category not in CATEGORIES:
        raise ValueError(f"Unknown BFCL multi-turn category {category!r}: expected one of {list(CATEGORIES)}.")
    data = _package_data()
    entries = _read_jsonl(data / f"{_VERSION_PREFIX}_multi_turn_{category}.json")
    answers = {
        a["id"]: a["ground_truth"]
        for a in _read_jsonl(data / "possible_answer" / f"{_VERSION_PREFIX}_multi_turn_{category}.json")
    }
    tasks = []
    for entry in entries:
        tasks.append(
            BFCLTask(
                id=entry["id"],
                category=category,
                turns=entry["question"],
                initial_config=entry.get("initial_config", {}),
                involved_classes=list(entry["involved_classes"]),
                ground_truth=answers[entry["id"]],
                excluded_functions=list(entry.get("excluded_function", [])),
                missed_functions={int(k): list(v) for k, v in entry.get("missed_function", {}).items()},
            )
        )
    return tuple(tasks)


@functools.cache
def _tasks_by_id() -> dict[str, BFCLTask]:
    return {task.id: task for category in CATEGORIES for task in load_tasks(category)}


def get_task(task_id: str) -> BFCLTask:
    """The task with this official id (e.g. `"multi_turn_miss_param_3"`)."""
    try:
        return _tasks_by_id()[task_id]
    except KeyError:
        raise KeyError(f"No BFCL multi-turn task with id {task_id!r}.") from None


def category_of(task_id: str) -> str:
    """The category of a task id: `"multi_turn_long_context_5"` -> `"long_context"`."""
    return task_id[len("multi_turn_") :].rsplit("_", 1)[0]


@functools.cache
def function_docs(class_name: str) -> tuple[dict, ...]:
    """
    The official function docs of an API class (`multi_turn_func_doc/<file>.json`), one dict per function.

    Args:
        class_name (`str`): One of `API_CLASSES`.
    """
    from bfcl_eval.constants.executable_backend_config import MULTI_TURN_FUNC_DOC_FILE_MAPPING

    path = _package_data() / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]
    return tuple(_read_jsonl(path))


def api_class(class_name: str) -> type:
    """The API class (e.g. `GorillaFileSystem`) from the package's `func_source_code`."""
    from bfcl_eval.constants.executable_backend_config import CLASS_FILE_PATH_MAPPING

    if class_name not in API_CLASSES:
        raise ValueError(f"Unknown BFCL multi-turn API class {class_name!r}: expected one of {list(API_CLASSES)}.")
    return getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name]), class_name)


def build_api_instances(task: BFCLTask) -> dict[str, object]:
    """
    Instantiate the task's API classes in their initial state, as the official checker does
    (`multi_turn_utils.execute_multi_turn_func_call`): a fresh instance per class, then, for stateful classes,
    `_load_scenario(deepcopy(initial_config[class]), long_context=...)`.

    Args:
        task ([`BFCLTask`]): The task.

    Returns:
        `dict[str, object]`: Instances by class name.
    """
    from bfcl_eval.constants.executable_backend_config import STATELESS_CLASSES

    instances = {}
    # A long-context scenario is read from `long_context`'s module-level dicts, which a verdict in another thread
    # (the asynchronous worker runs rollouts in threads) changes while it replays the calls: read under its lock.
    with _module_state_lock if task.long_context else contextlib.nullcontext():
        for class_name in task.involved_classes:
            instance = api_class(class_name)()
            if class_name not in STATELESS_CLASSES:
                config = copy.deepcopy(task.initial_config.get(class_name, {}))
                instance._load_scenario(config, long_context=task.long_context)
                if task.long_context:
                    # `_load_scenario` merges `long_context`'s module-level dicts by reference (TravelAPI's extension
                    # credit cards and bookings): a booking charged the card of every later episode, past a rollback.
                    instance = copy.deepcopy(instance)
            instances[class_name] = instance
    return instances


_module_state_lock = threading.RLock()  # re-entrant: an episode may be built inside `long_context_module_state_kept`


@contextlib.contextmanager
def long_context_module_state_kept():
    """Restore, on exit, the contents of `bfcl_eval`'s `long_context` module-level lists and dicts, in place (the API
    modules import them by name). The checker's own instances share them (see `build_api_instances`), so each replay
    of a long-context conversation charged its bookings to every later episode and verdict. Serialised: the state is
    global."""
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

    with _module_state_lock:
        saved = {
            name: copy.deepcopy(value)
            for name, value in vars(long_context).items()
            if not name.startswith("_") and isinstance(value, (dict, list))
        }
        try:
            yield
        finally:
            for name, value in saved.items():
                current = getattr(long_context, name)
                if isinstance(current, dict):
                    current.clear()
                    current.update(value)
                else:
                    current[:] = value
