"""Long log files read one at a time: a task where `delete_context` is needed to finish (docs/snapshots.md).

Each episode has a few log files; each file is ~150 tokens of routine lines and one line that reports `count=<n>`.
The question asks for the sum of the counts. With the per-segment completion budget of
`configs/snapshots_logsearch.yaml`, one file's content fits a segment and two do not: a rollout that reads the
second file before deleting the first runs out of budget and ends without an answer. So the policy that finishes
reads a file, writes down its count, deletes the file's content with `delete_context` (which closes the segment as a
snapshot row and restarts from the shortened conversation), and so on, then answers.

The warm-start traces (`log_search_traces`) are solved episodes laid out segment by segment, each segment's prompt
being the conversation as the rollout re-renders it after the deletions so far (deleted messages replaced by the
stub), so the SFT examples are what the policy sees in the rollout.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence

from ..rollout.context import apply_deletion, delete_context
from ..rollout.tools import ErrorPolicy, run_tool_call
from .protocol import tool_methods

__all__ = [
    "LOG_SEARCH_KEEP_SYSTEM_PROMPT",
    "LOG_SEARCH_SYSTEM_PROMPT",
    "LogSearchEnv",
    "log_search_traces",
    "make_log_rows",
    "make_logs",
]

FILE_NAMES = ("alpha.log", "beta.log", "gamma.log", "delta.log", "omega.log")
LINES_PER_FILE = 10
# The stub of `AgenticGRPOConfig.context_stub_text` (its default); the traces' later prompts use it.
DEFAULT_STUB = "[deleted]"

LOG_SEARCH_SYSTEM_PROMPT = (
    "Each log file reports one value as `count=<number>`. Your context is too short to hold two files, so work on "
    "one file at a time: read it with `read_file`, write down its count, then delete the file's content from your "
    "context with `delete_context` (messages are numbered from 0, this system message; each tool call and each tool "
    'result is a message). When you have every count, give their sum on its own line as "Answer: <number>".'
)
# Without `delete_context` (`make_log_rows(..., context_deletion=False)`): a control whose budget holds every file.
LOG_SEARCH_KEEP_SYSTEM_PROMPT = (
    "Each log file reports one value as `count=<number>`. Read each file with `read_file` and write down its count. "
    'When you have every count, give their sum on its own line as "Answer: <number>".'
)

_EVENTS = (
    "heartbeat ok",
    "cache refreshed",
    "request served",
    "connection reused",
    "queue drained",
    "config reloaded",
    "checkpoint written",
)


def make_logs(task_seed: int, names: Sequence[str]) -> tuple[dict[str, str], dict[str, int]]:
    """The files of an episode: `({name: content}, {name: count})`, determined by `task_seed`."""
    rng = random.Random(f"logs-{task_seed}")
    files, counts = {}, {}
    for name in names:
        count = rng.randint(10, 99)
        lines = [
            f"12:{minute:02d}:{rng.randint(0, 59):02d} INFO worker-{rng.randint(1, 8)} {rng.choice(_EVENTS)}"
            for minute in range(LINES_PER_FILE)
        ]
        lines[rng.randrange(2, LINES_PER_FILE - 1)] = f"12:{rng.randint(0, 9):02d}:30 INFO job finished count={count}"
        files[name], counts[name] = "\n".join(lines), count
    return files, counts


def make_log_rows(n: int, seed: int, num_files: int = 2, context_deletion: bool = True) -> list[dict]:
    """Rows of the `logsearch` task: `prompt` (system + question), `answer` (the sum), `task_seed` and `files`.

    Args:
        n (`int`): Number of tasks.
        seed (`int`): Seed of the task seeds and file choices.
        num_files (`int`, *optional*, defaults to `2`): Files per task.
        context_deletion (`bool`, *optional*, defaults to `True`): The system prompt asks to delete each file's
            content with `delete_context` after reading it; `False`: a prompt without it (every file is kept in the
            context). The problems (`task_seed`, `files`, `answer`) are the same either way.
    """
    rng = random.Random(f"log-rows-{seed}")
    rows = []
    for _ in range(n):
        task_seed = rng.randrange(2**31)
        names = rng.sample(FILE_NAMES, num_files)
        _, counts = make_logs(task_seed, names)
        listing = " and ".join(f"`{name}`" for name in names)
        question = f"What is the sum of the counts reported in {listing}?"
        rows.append(
            {
                "prompt": [
                    {
                        "role": "system",
                        "content": LOG_SEARCH_SYSTEM_PROMPT if context_deletion else LOG_SEARCH_KEEP_SYSTEM_PROMPT,
                    },
                    {"role": "user", "content": question},
                ],
                "answer": str(sum(counts.values())),
                "task_seed": task_seed,
                "files": list(names),
            }
        )
    return rows


class LogSearchEnv:
    """TRL environment with one tool, `read_file`; the files come from the row's `task_seed` and `files`."""

    def __init__(self):
        self.files: dict[str, str] = {}

    def reset(self, **row) -> None:
        """
        Starts an episode with the row's files.

        Args:
            **row: The dataset row (`task_seed`, `files`).
        """
        self.files, _ = make_logs(row["task_seed"], row["files"])

    def read_file(self, name: str) -> str:
        """
        Return the content of a log file.

        Args:
            name: The file's name, for example "alpha.log".

        Returns:
            The file's lines.
        """
        if name not in self.files:
            raise FileNotFoundError(f"No file {name!r}; the files are {sorted(self.files)}.")
        return self.files[name]


def _request(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def log_search_traces(rows: Sequence[dict], stub: str = DEFAULT_STUB, context_deletion: bool = True) -> list[dict]:
    """Warm-start traces of solved episodes, one trace per segment (as `trl_agentic.warmstart.tokenize_trace` reads).

    An episode is, per file: a `read_file` call, its result, then a turn that writes the count and calls
    `delete_context` on the result's message; after the last file, the answer. A segment ends with its
    `delete_context` call; the next segment's prompt is the conversation so far (the deletion's confirmation
    included) with the deleted messages replaced by `stub`, as the rollout loop re-renders it.

    With `context_deletion=False` (rows of `make_log_rows(..., context_deletion=False)`), one trace per episode that
    keeps every file: a `read_file` call, its result, then a turn that writes the count and reads the next file;
    after the last file, its count and the answer. The environment's tools only.

    Args:
        rows (`Sequence[dict]`): Rows of `make_log_rows`.
        stub (`str`, *optional*, defaults to `"[deleted]"`): `context_stub_text` of the GRPO run.
        context_deletion (`bool`, *optional*, defaults to `True`): Delete each file after reading it (above).

    Returns:
        `list[dict]`: Traces with `prompt`, `turns`, `tools` (`delete_context` first, then the environment's tools,
        the order of TRL's tool list when the trainer adds `delete_context`) and `segment` (its index).
    """
    if not context_deletion:
        return [_whole_episode_trace(row) for row in rows]
    return [trace for row in rows for trace in _episode_traces(row, stub)]


def _whole_episode_trace(row: dict) -> dict:
    env = LogSearchEnv()
    env.reset(**row)
    tools = tool_methods(env)
    _, counts = make_logs(row["task_seed"], row["files"])
    turns, note = [], ""
    for name in row["files"]:
        request = _request("read_file", {"name": name})
        outcome = run_tool_call(request, tools, {}, timeout=0, max_chars=None, policy=ErrorPolicy([], []))
        turns += [
            {"role": "assistant", "content": note, "tool_calls": [request]},
            {"role": "tool", "name": "read_file", "content": outcome.content},
        ]
        note = f"{name}: count={counts[name]}."
    total = sum(counts.values())
    terms = " + ".join(str(counts[name]) for name in row["files"])
    turns.append({"role": "assistant", "content": f"{note}\n{terms} = {total}\nAnswer: {total}"})
    return {"prompt": copy.deepcopy(list(row["prompt"])), "turns": turns, "tools": list(tools.values()), "segment": 0}


def _episode_traces(row: dict, stub: str) -> list[dict]:
    env = LogSearchEnv()
    env.reset(**row)
    tools = tool_methods(env)
    schema = [delete_context, *tools.values()]
    _, counts = make_logs(row["task_seed"], row["files"])
    conversation = copy.deepcopy(list(row["prompt"]))
    traces, start, deleted = [], len(conversation), []

    def segment(end: int) -> dict:
        before = conversation[:start]
        prompt = apply_deletion(before, deleted, stub)[0] if deleted else copy.deepcopy(before)
        turns = copy.deepcopy(conversation[start:end])
        return {"prompt": prompt, "turns": turns, "tools": schema, "segment": len(traces)}

    for name in row["files"]:
        request = _request("read_file", {"name": name})
        outcome = run_tool_call(request, tools, {}, timeout=0, max_chars=None, policy=ErrorPolicy([], []))
        conversation += [
            {"role": "assistant", "content": "", "tool_calls": [request]},
            {"role": "tool", "name": "read_file", "content": outcome.content},
        ]
        result_index = len(conversation) - 1
        conversation.append(
            {
                "role": "assistant",
                "content": f"{name}: count={counts[name]}.",
                "tool_calls": [_request("delete_context", {"message_ids": [result_index]})],
            }
        )
        traces.append(segment(len(conversation)))
        deleted.append(result_index)
        conversation.append({"role": "tool", "name": "delete_context", "content": delete_context([result_index])})
        start = len(conversation)
    total = sum(counts.values())
    terms = " + ".join(str(counts[name]) for name in row["files"])
    conversation.append({"role": "assistant", "content": f"{terms} = {total}\nAnswer: {total}"})
    traces.append(segment(len(conversation)))
    return traces
