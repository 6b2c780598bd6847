"""Scripted-generation backend and test environments for driving `AgenticRolloutLoop` token-exactly."""

from __future__ import annotations

from trl_agentic.rollout.loop import AgenticRolloutLoop, LoopConfig
from trl_agentic.rollout.parsing import parse_tool_calls


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call><|im_end|>"


class ScriptBackend:
    """Generation replaced by a script: each `generate` call pops one list of strings (one per context).

    Token ids come from the real tiny tokenizer; sampling log-probs are deterministic (-0.01·(k+1) for the k-th
    token of a generated turn), so tests can predict every id, mask and log-prob of the final trajectory.
    """

    max_completion_length = 100_000
    max_model_len = 1_000_000
    max_iterations = 10
    multi_process = False

    def __init__(self, tokenizer, script: list[list[str]]):
        self.tok = tokenizer
        self.script = list(script)
        self.calls: list[list[list[int]]] = []
        self.stop_token_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self.new_environments: list = []
        self.parse_tools: list = []  # per parse call: the tool names the loop passed (None: the row's initial tools)

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    @staticmethod
    def lps(ids: list[int]) -> list[float]:
        return [-0.01 * (k + 1) for k in range(len(ids))]

    def generate(self, contexts):
        self.calls.append([list(c) for c in contexts])
        outputs = self.script.pop(0)
        assert len(outputs) == len(contexts), (outputs, len(contexts))
        ids = [self.enc(s) for s in outputs]
        return ids, [self.lps(x) for x in ids]

    def parse(self, ids, prefix, row, tools=None):
        self.parse_tools.append(None if tools is None else [fn.__name__ for fn in tools])
        parsed = parse_tool_calls(self.tok.decode(ids, skip_special_tokens=True))
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = parsed.calls
        return message

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages):
        return self.enc("".join(f"<R>{m['content']}</R>" for m in tool_messages) + "<|im_start|>")

    def hint_ids(self, hint):
        return self.enc(f"<H>{hint}</H>")

    def user_turn_ids(self, content):
        return self.enc(f"<U>{content}</U><|im_start|>")

    def new_environment(self, row, old):
        env = type(old)()
        self.new_environments.append((row, old, env))
        return env

    def render_prompt(self, messages, row, tools=None):
        return self.enc("|".join(f"{m['role']}:{m['content']}" for m in messages) + "<|im_start|>")

    def any_rank(self, flag, error=None):
        if error is not None:
            raise error
        return flag


class LedgerEnv:
    """A stateful tool environment: `add` appends to a log before it validates, so a failed call leaves side effects
    that only a restore can undo."""

    def __init__(self):
        self.total = 0
        self.log: list = []

    def reset(self, **kwargs):
        self.total, self.log = 0, []

    def add(self, n: int) -> str:
        """
        Add a number to the running total.

        Args:
            n: The number to add.
        """
        self.log.append(n)
        if not isinstance(n, int):
            raise TypeError(f"n must be an integer, got {type(n).__name__}")
        self.total += n
        return str(self.total)


def start(backend: ScriptBackend, first_turns: list[str], prompt: str = "user: go"):
    """TRL's inputs to `_tool_call_loop` after the first turn: prompts, prompt ids, completion ids, completions, logprobs."""
    n = len(first_turns)
    prompts = [[{"role": "user", "content": prompt}] for _ in range(n)]
    prompt_ids = [backend.enc(prompt + "<|im_start|>") for _ in range(n)]
    completion_ids = [backend.enc(t) for t in first_turns]
    completions = [[backend.parse(ids, None, i)] for i, ids in enumerate(completion_ids)]
    logprobs = [backend.lps(ids) for ids in completion_ids]
    return prompts, prompt_ids, completion_ids, completions, logprobs


def run_loop(backend, first_turns, envs, config: LoopConfig, group_ids=None):
    prompts, prompt_ids, completion_ids, completions, logprobs = start(backend, first_turns)
    sync_tools = [{"add": env.add} for env in envs]
    loop = AgenticRolloutLoop(backend, config)
    trl_tuple, result = loop.run(
        prompts,
        prompt_ids,
        completion_ids,
        completions,
        logprobs,
        sync_tools,
        [{} for _ in envs],
        envs,
        group_ids=group_ids,
    )
    return prompts, prompt_ids, trl_tuple, result


# --- context snapshots (tests/test_snapshots.py, tests/test_trainer_snapshots.py) ---------------------------------


def calls(*pairs: tuple[str, dict]) -> str:
    """One assistant turn with several tool calls: `calls(("add", {"n": 1}), ("delete_context", {...}))`."""
    import json

    blocks = "".join(f"<tool_call>{json.dumps({'name': n, 'arguments': a})}</tool_call>" for n, a in pairs)
    return blocks + "<|im_end|>"


class NoLogprobBackend(ScriptBackend):
    """Like transformers generation in TRL: no sampling log-probs (`logprobs=None` everywhere)."""

    def generate(self, contexts):
        ids, _ = super().generate(contexts)
        return ids, None


class GiveUpParseBackend(ScriptBackend):
    """Parses like TRL's `parse_response` on a turn with a malformed block: it gives up and returns plain text, so
    the loop's own parser finds the valid calls next to the parse errors."""

    def parse(self, ids, prefix, row, tools=None):
        message = super().parse(ids, prefix, row, tools)
        if parse_tool_calls(self.tok.decode(ids, skip_special_tokens=True)).errors:
            message.pop("tool_calls", None)
        return message


def run_tools_loop(backend, first_turns, tools, config: LoopConfig, envs=None, logprobs=True, prompts=None):
    """Run the loop with explicit per-rollout tool dicts. Returns `(prompts, prompt_ids, trl_tuple, result)`.

    `prompts`, when given, replaces the default one-user-message conversation (rendered like `render_prompt`).
    """
    p, prompt_ids, completion_ids, completions, lps = start(backend, first_turns)
    if prompts is not None:
        p = [list(m) for m in prompts]
        prompt_ids = [backend.render_prompt(m, i) for i, m in enumerate(p)]
    loop = AgenticRolloutLoop(backend, config)
    trl_tuple, result = loop.run(
        p,
        prompt_ids,
        completion_ids,
        completions,
        lps if logprobs else None,
        tools,
        [{} for _ in tools],
        envs,
    )
    return p, prompt_ids, trl_tuple, result


def thousandth_bonus(segment: dict) -> float:
    """A per-segment reward term (`snapshot_reward_func`) of +0.001: a tiny reward difference (issue 35, item 1)."""
    return 0.001


def context_length_penalty(segment: dict) -> float:
    """A per-segment reward term (`snapshot_reward_func`): -0.001 per token of the segment's prompt + completion."""
    return -0.001 * (len(segment["prompt_ids"]) + len(segment["completion_ids"]))


class ToolClock:
    """Stands in for the wall clock of `tool_timeout` (sync tools): waiting for a tool's thread ends when the tool
    returned, or when it declared itself hung (`hang()`, called by the tool just before it blocks), never after some
    number of seconds. So a tool that returns is never timed out however loaded the machine, and one that hangs always
    is; `tool_timeout` only has to be non-zero. Installed by the `tool_clock` fixture (tests/conftest.py)."""

    THREAD_NAME = "trl-agentic-tool"  # the threads `trl_agentic.rollout.tools` runs timed sync calls in

    def __init__(self, join):
        self._join = join  # the real `threading.Thread.join`
        self._hung: set = set()

    def hang(self) -> None:
        import threading

        self._hung.add(threading.current_thread())

    def join(self, thread, timeout=None):
        if thread.name != self.THREAD_NAME or timeout is None:
            return self._join(thread, timeout)
        while thread.is_alive() and thread not in self._hung:
            self._join(thread, 0.01)  # a polling interval, not a time limit: the outcome does not depend on it
