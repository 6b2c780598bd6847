"""Held-out evaluation of a tool-using policy with the real multi-turn tool loop.

[`evaluate_policy`] runs a model on held-out problems exactly as the trainer rolls it out: prompts rendered with the
chat template GRPO uses (TRL's training variant when the template is not prefix-preserving), one batched generation
per turn, tool calls parsed with TRL's response parser and executed by `trl_agentic.rollout.loop.AgenticRolloutLoop`
on a fresh environment per problem, the tool results appended as environment tokens, and the task's reward functions
applied to the final conversation. Rollback is off: the model sees its tool errors and may correct them in a later
turn, as at inference time, so the numbers measure the policy and not the training-time retries.

Decoding is greedy by default (`temperature=0`): the same model gives the same numbers, so a before/after difference
is the model's, not sampling noise. A positive temperature samples instead (as GRPO does during training).

Metrics (all over problems unless said otherwise):

- `success_rate`: mean of the first reward function (for `answer_reward`: the share of correct final answers);
- `reward`: mean of the summed rewards;
- `tool_call_success_rate`: tool calls that ran without error / tool calls (0 when there are no calls);
- `tool_failure_rate`: failed tool calls / tool calls (malformed calls, unknown tools, exceptions), like TRL's
  `tools/failure_frequency` (the complement of `tool_call_success_rate` when there are calls);
- `tool_success_rate`: share of problems with at least one tool call that ran without error;
- `tool_calls_per_problem`, `no_tool_call_rate`, `mean_completion_tokens`, `seconds`;
- `mean_peak_context_tokens`: the longest context (prompt, earlier turns and the turn generated) each problem's
  generation saw, averaged (with `context_snapshots`, deleted tool results no longer count).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig

from .envs.protocol import tool_methods, with_observation
from .errors import tool_call_failed
from .rollout.context import DELETE_CONTEXT_TOOL, delete_context
from .rollout.loop import AgenticRolloutLoop, LoopConfig
from .rollout.prefix_cache import generation_module, peft_reason
from .rollout.rendering import ChatRenderer, grpo_chat_template  # noqa: F401 - grpo_chat_template re-exported


def with_response_schema(tokenizer):
    """Give the tokenizer TRL's response parser for its chat template (what `GRPOTrainer` does), if it has none."""
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        tokenizer = add_response_schema(tokenizer)
    return tokenizer


# Below this many shared tokens, a plain batched call is as fast.
_MIN_SHARED_PREFIX = 32


def _common_prefix_length(sequences: list[list[int]]) -> int:
    first = sequences[0]
    length = min(len(s) for s in sequences)
    for other in sequences[1:]:
        k = 0
        while k < length and other[k] == first[k]:
            k += 1
        length = k
    return length


class HFGenerationBackend:
    """`RolloutBackend` on a plain transformers (or PEFT) model: batched `generate` with left padding.

    Args:
        model: A causal LM (may be a `PeftModel`).
        tokenizer: Its tokenizer, with a response parser (see [`with_response_schema`]).
        tools_per_row: The tools (bound methods) of each rollout, for prompt rendering and argument typing.
        max_completion_length: Token budget of a whole multi-turn completion (as in GRPO).
        max_iterations: Maximum tool rounds per rollout (`None`: no limit, as in TRL's `GRPOTrainer`).
        temperature: 0 for greedy decoding, otherwise the sampling temperature.
        top_p: Nucleus sampling threshold when sampling.
        prefix_caching: Encode the prefix shared by all contexts of a call once (see `generate`).
        max_turn_tokens: Tokens generated per assistant turn at most (default: `max_completion_length`).
        chunk_tokens: Rows still generating after this many tokens continue in a `generate` call of their own with
            the other unfinished rows, so that a batch does not run at full width until its longest turn ends (a
            sampled batch of 16 often holds one rambling row). Each row samples from the same distribution as in one
            call: a continuation is conditioned on the same tokens. `None` (default): one call per turn.
        typed_arguments: Type tool-call arguments with the tool's JSON schema, as TRL's response parser does in
            training (`"7"` becomes `7` for an integer parameter); `False` keeps the model's JSON values, as BFCL runs
            them.
    """

    multi_process = False

    def __init__(
        self,
        model,
        tokenizer,
        tools_per_row: Sequence[Sequence[Callable]],
        *,
        max_completion_length: int,
        max_iterations: int | None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        prefix_caching: bool = True,
        max_turn_tokens: int | None = None,
        chunk_tokens: int | None = None,
        typed_arguments: bool = True,
        chat_template_kwargs: dict | None = None,
    ):
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"`chunk_tokens` must be positive or None, got {chunk_tokens}.")
        self.chunk_tokens = chunk_tokens
        self.typed_arguments = typed_arguments
        self.model = model
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer, template_kwargs=chat_template_kwargs)
        self.environment_factory: Callable | None = None  # for a fresh environment after a timed-out call
        # A turn ends at any of TRL's `eos_token_ids`: the tokenizer's and every one of the model's generation config
        # (Qwen, Llama-3 instruct checkpoints declare several).
        declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        declared = declared if isinstance(declared, list | tuple) else [declared]
        self.eos_ids = list(dict.fromkeys(i for i in (tokenizer.eos_token_id, *declared) if i is not None))
        self.stop_token_ids = {*self.eos_ids, tokenizer.pad_token_id} - {None}
        self.tools_per_row = tools_per_row
        self.max_completion_length = max_completion_length
        self.max_iterations = sys.maxsize if max_iterations is None else max_iterations  # TRL's reading of None
        self.max_model_len = getattr(model.config, "max_position_embeddings", None) or 2048
        self.temperature = temperature
        self.top_p = top_p
        # A PEFT method whose `generate` adds to the base model's forward would not read the keys the prefix got.
        self.prefix_caching = prefix_caching and peft_reason(model) is None
        self.max_turn_tokens = min(max_turn_tokens or max_completion_length, max_completion_length)
        self.generated_tokens = 0
        self.peak_context: dict[int, int] = {}  # row -> the longest context (prompt and turn) it was generated in
        self._prefix_key: tuple | None = None
        self._prefix_kv = None

    def _prefix_cache(self, prefix: list[int]):
        """KV cache of the prefix every context shares (system prompt and tool schemas), computed once per weights."""
        key = tuple(prefix)
        if self._prefix_key != key:
            device = next(self.model.parameters()).device
            # In the module `generate` runs: a trained PEFT policy's own `forward` is still accelerate's autocast one.
            forward = generation_module(self.model)
            output = forward(input_ids=torch.tensor([prefix], device=device), use_cache=True)
            self._prefix_key, self._prefix_kv = key, output.past_key_values
        return copy.deepcopy(self._prefix_kv)

    @torch.no_grad()
    def generate(self, contexts: list[list[int]]) -> tuple[list[list[int]], None]:
        eos = set(self.eos_ids)
        outputs: list[list[int]] = [[] for _ in contexts]
        active = list(range(len(contexts)))
        while active:
            left = self.max_turn_tokens - len(outputs[active[0]])  # every active row has generated as many
            step = left if self.chunk_tokens is None else min(self.chunk_tokens, left)
            new = self._generate_once([contexts[k] + outputs[k] for k in active], step)
            still = []
            for k, ids in zip(active, new):
                outputs[k] += ids
                if (not ids or ids[-1] not in eos) and len(ids) == step and len(outputs[k]) < self.max_turn_tokens:
                    still.append(k)  # neither ended nor out of tokens: continue with the other unfinished rows
            active = still
        self.generated_tokens += sum(len(ids) for ids in outputs)
        return outputs, None

    def _generate_once(self, contexts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """One batched `generate` call of at most `max_new_tokens`, each row cut after its first end-of-turn token."""
        pad, eos = self.tokenizer.pad_token_id, self.eos_ids
        device = next(self.model.parameters()).device
        # Every prompt starts with the same system prompt and tool schemas (most of its tokens): encode that prefix
        # once and reuse its KV cache, with each row's own tokens left-padded after it. Positions come from the
        # attention mask, so the padding in the middle changes nothing for the model.
        shared = _common_prefix_length(contexts) if self.prefix_caching else 0
        shared = min(shared, min(len(c) for c in contexts) - 1)
        use_cache_prefix = shared >= _MIN_SHARED_PREFIX
        start = shared if use_cache_prefix else 0
        tails = [c[start:] for c in contexts]
        width = max(len(t) for t in tails)
        input_ids = torch.full((len(contexts), start + width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(contexts), start + width), dtype=torch.long)
        if use_cache_prefix:
            input_ids[:, :start] = torch.tensor(contexts[0][:start])
            attention_mask[:, :start] = 1
        for k, tail in enumerate(tails):
            input_ids[k, start + width - len(tail) :] = torch.tensor(tail)
            attention_mask[k, start + width - len(tail) :] = 1
        extra = {}
        if use_cache_prefix:
            cache = self._prefix_cache(contexts[0][:start])
            cache.batch_repeat_interleave(len(contexts))
            extra["past_key_values"] = cache
        sampling = {"do_sample": False}
        if self.temperature > 0:
            sampling = {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        # A generation config as TRL passes one: the sampling settings and the repetition penalty are ours (a
        # checkpoint's `repetition_penalty: 1.05` would otherwise apply); its unset fields merge from the checkpoint's.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
            use_cache=True,
            repetition_penalty=1.0,
            **sampling,
        )
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            **extra,
        )
        new_ids = []
        for row in output[:, start + width :].tolist():
            # Keep everything up to and including the first end-of-turn token, like TRL's generation path.
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            new_ids.append(row[:cut])
        return new_ids

    def parse(self, ids: list[int], prefix: list[int], row: int, tools: list | None = None) -> dict:
        from trl.chat_template_utils import parse_response

        tools = list(self.tools_per_row[row]) if tools is None else tools
        self.peak_context[row] = max(self.peak_context.get(row, 0), len(prefix) + len(ids))
        return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools if self.typed_arguments else None)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        return self.renderer.tool_suffix_ids(tool_messages)

    def hint_ids(self, hint: str) -> list[int]:
        return self.renderer.hint_ids(hint)

    def user_turn_ids(self, content: str) -> list[int]:
        return self.renderer.user_turn_ids(content)

    def render_prompt(self, messages: list[dict], row: int, tools: list | None = None) -> list[int]:
        return self.renderer.prompt_ids(messages, tools=list(self.tools_per_row[row]) if tools is None else tools)

    def new_environment(self, row: int, old):
        return self.environment_factory() if self.environment_factory is not None else type(old)()

    def any_rank(self, flag: bool, error: BaseException | None = None) -> bool:
        if error is not None:
            raise error
        return flag


@dataclass
class EvalResult:
    """What [`evaluate_policy`] returns.

    Attributes:
        metrics: Aggregate numbers (see the module docstring).
        records: One dict per problem: `question`, `answer`, `messages` (the completion), `reward`, `correct`,
            `tool_calls`, `tool_failures`, `completion_tokens`.
    """

    metrics: dict[str, float]
    records: list[dict] = field(default_factory=list)


def _question(prompt: list[dict]) -> str:
    return next((m.get("content", "") for m in reversed(prompt) if m.get("role") == "user"), "")


@torch.no_grad()
def evaluate_policy(
    model,
    tokenizer,
    rows: Sequence[dict],
    *,
    environment_factory: Callable | None,
    reward_funcs: Sequence[Callable],
    max_completion_length: int = 96,
    max_tool_calling_iterations: int | None = 3,
    batch_size: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    progress: bool = True,
    desc: str = "eval",
    prefix_caching: bool = True,
    seed: int = 0,
    max_turn_tokens: int | None = None,
    chunk_tokens: int | None = None,
    batch_by: str | None = None,
    context_snapshots: bool = False,
    context_stub_text: str = "[deleted]",
    typed_arguments: bool = True,
    max_tool_output_chars: int | None = None,
    chat_template_kwargs: dict | None = None,
    tools: Sequence[Callable] | None = None,
) -> EvalResult:
    """
    Roll out a policy on held-out problems with the multi-turn tool loop and score it.

    Args:
        model:
            Causal LM (plain or `PeftModel`); put in eval mode for the call and restored afterwards.
        tokenizer:
            Its tokenizer, with a tool-calling chat template.
        rows (`Sequence[dict]`):
            Dataset rows with a conversational `prompt` and the columns the reward functions and `env.reset` need.
        environment_factory (`Callable` or `dict[str, Callable]`):
            Builds one environment per problem (TRL's environment protocol: `reset(**row)` plus public tool methods).
            A dict is TRL's multi-environment mode: each row's `environment` column names its factory, and is not
            passed to `reset`. None with standalone `tools` only.
        reward_funcs (`Sequence[Callable]`):
            TRL-style reward functions `f(completions=..., prompts=..., **columns) -> list[float]`; the first one
            defines `success_rate`. An environment with a `get_reward()` method adds its reward last, as in TRL.
        max_completion_length (`int`, *optional*, defaults to `96`):
            Token budget of a whole completion (all turns), as `max_completion_length` in GRPO.
        max_tool_calling_iterations (`int` or `None`, *optional*, defaults to `3`):
            Maximum tool rounds per problem, as TRL's `GRPOTrainer` reads `max_tool_calling_iterations`: `None` is no
            limit, `0` runs no tool call.
        batch_size (`int`, *optional*, defaults to `16`):
            Problems rolled out together (one `generate` call per turn and batch).
        temperature (`float`, *optional*, defaults to `0.0`):
            0 for greedy decoding, otherwise the sampling temperature.
        top_p (`float`, *optional*, defaults to `1.0`):
            Nucleus sampling threshold when sampling.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar.
        desc (`str`, *optional*, defaults to `"eval"`):
            Label of the progress bar.
        prefix_caching (`bool`, *optional*, defaults to `True`):
            Encode the prompt prefix shared by a batch (system prompt and tool schemas) once per generation call
            (same tokens as without it, several times faster with long tool schemas).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the sampling (the global RNG is forked, so training's random stream is untouched): with a fixed
            seed, the same model samples the same completions.
        max_turn_tokens (`int`, *optional*):
            Tokens generated per assistant turn at most (default: `max_completion_length`); bounds the cost of a
            turn that never ends in long multi-turn conversations.
        chunk_tokens (`int`, *optional*):
            Rows of a batch still generating after this many tokens of a turn continue together in a smaller
            `generate` call, so a batch does not run at full width to its longest turn (sampled batches often hold
            one rambling row). The same distribution as one call per turn, at the cost of re-encoding each
            continuing row's own tokens once per chunk (worth it for short contexts). `None` (default): one call per
            turn.
        batch_by (`str`, *optional*):
            A column: consecutive rows with the same value are batched together and a batch never mixes values
            (e.g. `"environment"`: rows with the same tools share their prompt prefix, which `prefix_caching` then
            encodes once). Sort the rows by it first.
        context_snapshots (`bool`, *optional*, defaults to `False`):
            Offer trl-agentic's `delete_context` tool and apply it, as `enable_context_snapshots=True` does in
            training: a task whose tool outputs outgrow `max_completion_length` (the log search) is solvable only
            with it.
        context_stub_text (`str`, *optional*, defaults to `"[deleted]"`):
            What replaces a deleted message (`context_stub_text` of the training config).
        typed_arguments (`bool`, *optional*, defaults to `True`):
            Type tool-call arguments with each tool's JSON schema, as TRL's response parser does in training (`"7"`
            becomes `7` for an integer parameter). `False` keeps the model's JSON values, as a benchmark that runs
            them unchanged does (BFCL: `trl_agentic.envs.bfcl.evaluate`).
        max_tool_output_chars (`int`, *optional*):
            Cut each tool result to this many characters, as training's `max_tool_output_chars` does (None: no cut).
        chat_template_kwargs (`dict`, *optional*):
            Training's `chat_template_kwargs` (e.g. `enable_thinking: false`): the prompts are rendered as GRPO's.
        tools (`Sequence[Callable]`, *optional*):
            Training's standalone `tools` (synchronous functions), listed before the environment's methods as TRL
            lists them; with tools, `environment_factory` may be None.

    The protocol is fixed, whatever the training run used, so that runs compare: malformed tool calls are shown to
    the model and counted as failed calls (`malformed_tool_call_feedback`), a tool call has 10 s, nothing rolls back.
    Generation stops at every end-of-turn id TRL stops at (the tokenizer's and the model's generation config's) and
    samples with its own temperature, `top_p`, no `top_k` and a repetition penalty of 1.0 (a checkpoint's own penalty
    does not apply); the checkpoint's other generation settings merge in as they do in TRL's training generation.

    Returns:
        [`EvalResult`]: The metrics and one record per problem.
    """
    from tqdm.auto import tqdm

    standalone = {tool.__name__: tool for tool in tools or ()}
    if any(inspect.iscoroutinefunction(tool) for tool in standalone.values()):
        raise ValueError("`tools`: evaluation runs synchronous tools only (no event loop for async ones).")
    if not environment_factory and not standalone:
        raise ValueError("Evaluation needs an `environment_factory` or `tools`.")
    tokenizer = with_response_schema(tokenizer)
    if tokenizer.pad_token_id is None:
        raise ValueError("The tokenizer needs a pad token for batched generation.")
    was_training = model.training
    model.eval()
    start = time.perf_counter()
    records: list[dict] = []
    # Malformed calls are shown to the model and counted as failed calls, as during training with rollback.
    config = LoopConfig(
        rollback_on_errors=[],
        tool_timeout=10.0,
        malformed_tool_call_feedback=True,
        enable_context_snapshots=context_snapshots,
        context_stub_text=context_stub_text,
        max_tool_output_chars=max_tool_output_chars,
        # The engine caps each turn (`HFGenerationBackend`): the loop must know it, to tell a capped turn from a
        # complete one (a turn is cut when it fills the tokens it could keep without an end-of-turn token).
        max_turn_tokens=max_turn_tokens,
    )
    bar = tqdm(total=len(rows), desc=desc, disable=not progress, unit="problem")
    # A forked RNG: the sampled completions depend only on `seed`, and training's random stream is left as it was.
    with contextlib.ExitStack() as stack:
        # Every visible CUDA device too: `manual_seed` below seeds them all (GRPO's sampling stream on a GPU).
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        stack.enter_context(torch.random.fork_rng(devices=cuda))
        stack.callback(model.train, was_training)
        stack.callback(bar.close)
        torch.manual_seed(seed)
        for chunk in _chunks(rows, batch_size, batch_by):
            chunk = [dict(r) for r in chunk]
            envs = [_factory_for(environment_factory, row)() if environment_factory else None for row in chunk]
            # What `reset` returns joins the last prompt message, as in TRL's rollouts (the text world's first
            # observation): the evaluated model sees the prompt GRPO trained it on.
            prompts = [
                with_observation(
                    row["prompt"], env.reset(**_reset_kwargs(environment_factory, row)) if env is not None else None
                )
                for env, row in zip(envs, chunk)
            ]
            # Prompts are rendered with the standalone tools, `delete_context` (which the trainer adds to `tools` with
            # snapshots on) and the environment's bound methods: the schema GRPO shows the model, in TRL's order.
            extra = {**standalone, **({DELETE_CONTEXT_TOOL: delete_context} if context_snapshots else {})}
            tool_dicts = [{**extra, **(tool_methods(env) if env is not None else {})} for env in envs]
            tools_per_row = [list(tools.values()) for tools in tool_dicts]
            backend = HFGenerationBackend(
                model,
                tokenizer,
                tools_per_row,
                max_completion_length=max_completion_length,
                max_iterations=max_tool_calling_iterations,
                temperature=temperature,
                top_p=top_p,
                prefix_caching=prefix_caching,
                max_turn_tokens=max_turn_tokens,
                chunk_tokens=chunk_tokens,
                typed_arguments=typed_arguments,
                chat_template_kwargs=chat_template_kwargs,
            )
            # A fresh environment after a timed-out call (multi-environment mode: the class of the old one).
            backend.environment_factory = None if isinstance(environment_factory, dict) else environment_factory
            prompt_ids = [backend.render_prompt(p, k) for k, p in enumerate(prompts)]
            completion_ids, _ = backend.generate(prompt_ids)
            completions = []
            for k, ids in enumerate(completion_ids):
                message = backend.parse(ids, prompt_ids[k], k) if ids else {"role": "assistant", "content": ""}
                completions.append([message])
            loop = AgenticRolloutLoop(backend, config)
            trl_tuple, _ = loop.run(
                [list(p) for p in prompts],
                prompt_ids,
                completion_ids,
                completions,
                None,
                tool_dicts,
                [{} for _ in chunk],
                envs if environment_factory else None,
            )
            tool_mask, completions, completion_ids = trl_tuple[0], trl_tuple[1], trl_tuple[2]
            columns = {key: [row.get(key) for row in chunk] for key in chunk[0] if key != "prompt"}
            per_func = []
            for func in reward_funcs:
                values = func(
                    prompts=prompts,
                    completions=completions,
                    completion_ids=completion_ids,
                    environments=envs,
                    **columns,
                )
                per_func.append([math.nan if v is None else float(v) for v in values])
            if callable(getattr(envs[0], "get_reward", None)):  # an environment that owns its reward, as in TRL
                per_func.append([math.nan if (v := env.get_reward()) is None else float(v) for env in envs])
            for k, row in enumerate(chunk):
                messages = completions[k]
                tool_msgs = [m for m in messages if m.get("role") == "tool"]
                # Calls that raised or that the loop refused (malformed, unknown tool, timeout): recorded by the loop.
                failures = sum(tool_call_failed(m) for m in tool_msgs)
                rewards = [values[k] for values in per_func]
                records.append(
                    {
                        "question": _question(row["prompt"]),
                        "answer": row.get("answer"),
                        "messages": messages,
                        "rewards": rewards,
                        "reward": float(sum(r for r in rewards if not math.isnan(r))),
                        "correct": bool(rewards and rewards[0] >= 0.5),
                        "tool_calls": len(tool_msgs),
                        "tool_failures": failures,
                        "completion_tokens": sum(tool_mask[k]),
                        # What the model attended to at most: with `delete_context`, deleted results leave the context.
                        "peak_context_tokens": backend.peak_context.get(k, len(prompt_ids[k])),
                    }
                )
            for env in envs:  # e.g. the Python sandbox's interpreter process
                close = getattr(env, "_close", None)
                if callable(close):
                    close()
            bar.update(len(chunk))
    return EvalResult(summarize(records, time.perf_counter() - start), records)


def _chunks(rows: Sequence[dict], batch_size: int, batch_by: str | None):
    """Consecutive batches of at most `batch_size` rows, split where the `batch_by` column changes."""
    chunk: list[dict] = []
    for row in rows:
        if chunk and (len(chunk) == batch_size or (batch_by and row.get(batch_by) != chunk[0].get(batch_by))):
            yield chunk
            chunk = []
        chunk.append(row)
    if chunk:
        yield chunk


def _factory_for(environment_factory, row: dict) -> Callable:
    """The row's environment factory: TRL's multi-environment mode picks it by the row's `environment` column."""
    if not isinstance(environment_factory, dict):
        return environment_factory
    name = row.get("environment")
    if name not in environment_factory:
        raise ValueError(f"Row has `environment={name!r}`, not among {list(environment_factory)}.")
    return environment_factory[name]


def _reset_kwargs(environment_factory, row: dict) -> dict:
    """`reset` gets every column, except `environment` in multi-environment mode (as in TRL)."""
    if isinstance(environment_factory, dict):
        return {k: v for k, v in row.items() if k != "environment"}
    return row


_METRICS = (
    "num_problems",
    "success_rate",
    "reward",
    "tool_success_rate",
    "tool_call_success_rate",
    "tool_failure_rate",
    "tool_calls_per_problem",
    "no_tool_call_rate",
    "mean_completion_tokens",
    "mean_peak_context_tokens",
)


def summarize(records: list[dict], seconds: float = 0.0) -> dict[str, float]:
    """Aggregate per-problem records of [`evaluate_policy`] into its metrics."""
    n = len(records)
    if n == 0:  # every metric present (callers format them), none defined
        return {key: (0 if key == "num_problems" else math.nan) for key in _METRICS} | {"seconds": seconds}
    calls = sum(r["tool_calls"] for r in records)
    failures = sum(r["tool_failures"] for r in records)
    first = [r["rewards"][0] for r in records if r["rewards"] and not math.isnan(r["rewards"][0])]
    return {
        "num_problems": n,
        "success_rate": sum(first) / len(first) if first else math.nan,
        "reward": sum(r["reward"] for r in records) / n,
        "tool_success_rate": sum(r["tool_calls"] > r["tool_failures"] for r in records) / n,
        "tool_call_success_rate": (calls - failures) / calls if calls else 0.0,
        "tool_failure_rate": failures / calls if calls else 0.0,
        "tool_calls_per_problem": calls / n,
        "no_tool_call_rate": sum(r["tool_calls"] == 0 for r in records) / n,
        "mean_completion_tokens": sum(r["completion_tokens"] for r in records) / n,
        "mean_peak_context_tokens": sum(r.get("peak_context_tokens", 0) for r in records) / n,
        "seconds": seconds,
    }


def format_comparison(results: dict[str, dict[str, float]]) -> str:
    """A small fixed-width table of evaluation metrics, one column per stage (e.g. before / after GRPO)."""
    keys = [
        ("success_rate", "success rate", True),
        ("tool_call_success_rate", "successful tool calls", True),
        ("tool_success_rate", "problems with a successful tool call", True),
        ("tool_calls_per_problem", "tool calls per problem", False),
        ("mean_completion_tokens", "completion tokens", False),
        ("seconds", "eval time (s)", False),
    ]
    stages = list(results)
    width = max(12, *(len(s) + 2 for s in stages))
    lines = [f"{'':<38}" + "".join(f"{s:>{width}}" for s in stages)]
    for key, label, percent in keys:
        cells = []
        for stage in stages:
            value = results[stage].get(key, math.nan)
            cells.append(f"{value:>{width}.1%}" if percent else f"{value:>{width}.1f}")
        lines.append(f"{label:<38}" + "".join(cells))
    return "\n".join(lines)


def row_dicts(dataset: Any) -> list[dict]:
    """Rows of a `datasets.Dataset` (or any sequence of dicts) as a list of plain dicts."""
    return [dict(row) for row in dataset]
