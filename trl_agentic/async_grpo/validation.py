"""Validation rollouts of the asynchronous TracIn filter (trainer process), made as TRL's worker makes training rows.

A refresh's trajectories (`tracin_val_num_generations` per validation prompt) run at once, each in a thread of its
own as the worker runs its trajectories, so that their requests reach the vLLM server together (it batches them);
each request asks for what its trajectory can keep of the completion budget, with the training requests' sampling
settings and the current policy's adapter (`stage.EstimatorHost.complete`). What a trajectory is and how its rows are
scored are the worker's (`worker.AgenticAsyncRolloutLoop._run_trajectory` and `_score_group`):

- trl-agentic's rollout loop, the prompt rendered with the worker's chat template and `chat_template_kwargs`, sync
  tools in the trajectory's thread, async tools on one event loop kept for the filter's lifetime (as the worker's
  loop is: an async tool or reward may cache objects bound to it);
- the rows are the worker's (`rows.sequences_from_loop`): the regular row and the loop's extra rows (negative
  samples, earlier snapshot segments), a rollout lost to the infrastructure marked lost, a truncated one truncated;
- rewards: the reward functions (awaited when async) with TRL's worker's arguments (the prompt the model saw, the
  completion messages, the model's token ids, the dataset columns) plus an environment's `get_reward`; then
  `rows.score_group_rows` with the config (negative rewards and cap, `group_baseline`, `snapshot_advantage`,
  `snapshot_reward_func`, `mask_truncated_completions`), and the rows it trains are the validation rows;
- a group whose baseline rows' rewards are all equal (NaN ignored) gets advantage exactly 0 on the rows where it is 0
  in exact arithmetic (`advantages.tied_rows`: its baseline rows and the rows with that same reward), not float32
  rounding noise of one sign; a negative out of the baseline (`group_baseline="episodes"`) with another reward keeps
  its advantage, measured from its episode;

- a trainer-side advantage estimator (`advantage_estimator != "grpo"`, RLVCR) runs on each validation group as the
  trainer's stage runs it on a training group (`stage.estimate_group`: every kept row, the untrained ones with a zero
  loss mask; token-level advantages as arrays over a row's `input_ids`; the rows it adds, RLVCR's expansions, are
  validation rows too), its metrics discarded, as the synchronous trainer computes validation advantages with its
  estimator. The zeroing of tied groups follows the synchronous trainer's rule
  (`estimators.zero_without_reward_spread`: GRPO and CoPO; RLVCR's additive rule and custom estimators keep theirs).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import copy
import inspect
import math
import random
import sys
import threading

import numpy as np
import torch
from transformers.utils import logging

from ..advantages import tied_rows
from ..batch import baseline_mask, snapshot_reward
from ..envs.protocol import tool_methods, with_observation
from ..estimators import zero_without_reward_spread
from ..rollout.loop import AgenticRolloutLoop, LoopConfig
from ..rollout.rendering import ChatRenderer
from ..rollout.types import RowKind
from .rows import pushed_rows, score_group_rows, segment_info, trajectory_rows
from .stage import EstimatorHost, estimate_group
from .worker import AgenticRolloutSample, environment_of

__all__ = ["ValidationRollouts"]

logger = logging.get_logger(__name__)

# Trajectories of one refresh run at once, at most (`ValidationRollouts.max_parallel`). Not TRL's
# `max_inflight_tasks`: TRL sizes it for the training rollouts (`max_staleness` steps of rows), often below a refresh.
DEFAULT_PARALLEL_TRAJECTORIES = 64


def worker_chat_template(tokenizer, has_tools: bool):
    """The chat template TRL's asynchronous worker renders with: a training-safe one when there are tools and the
    tokenizer's own template does not preserve prefixes, else the tokenizer's (`_AsyncRolloutLoop.__init__`)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    if has_tools and not is_chat_template_prefix_preserving(tokenizer):
        return get_training_chat_template(tokenizer)
    return None


class _HTTPBackend:
    """`RolloutBackend` of one validation trajectory: generation through the vLLM server with the current policy's
    adapter. Each request asks for what the trajectory can keep of its turn (`takes_turn_limits`, as the worker's
    requests do), with sampling seeds from the trajectory's own `rng`."""

    multi_process = False
    takes_turn_limits = True

    def __init__(self, host, renderer: ChatRenderer, tools, max_model_len, rng: random.Random):
        trainer = host._trainer
        self._host = host
        self._rng = rng
        self.tools = tools
        self.tokenizer = trainer.processing_class
        self.renderer = renderer
        args = trainer.args
        self.max_completion_length = args.max_completion_length
        self.max_model_len = max_model_len
        self.max_iterations = (
            sys.maxsize if args.max_tool_calling_iterations is None else args.max_tool_calling_iterations
        )
        self.stop_token_ids = {*trainer.eos_token_ids, self.tokenizer.pad_token_id} - {None}

    def generate(self, contexts, limits=None):
        limits = [self.max_completion_length] * len(contexts) if limits is None else limits
        return self._host.complete(contexts, limits, rng=self._rng)

    def parse(self, ids, prefix, row, tools=None):
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, ids, prefix=prefix, tools=self.tools if tools is None else tools)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages):
        return self.renderer.tool_suffix_ids(tool_messages)

    def hint_ids(self, hint):
        return self.renderer.hint_ids(hint)

    def user_turn_ids(self, content):
        return self.renderer.user_turn_ids(content)

    def render_prompt(self, messages, row, tools=None):
        return self.renderer.prompt_ids(messages, tools=self.tools if tools is None else tools)

    def new_environment(self, row, old):
        raise NotImplementedError("tool_timeout is not supported by the asynchronous trainer")

    def any_rank(self, flag, error=None):
        if error is not None:
            raise error
        return flag


def _excerpt(messages: list[dict], chars: int = 80) -> str:
    content = str(messages[-1].get("content", "")) if messages else ""
    return repr(content[:chars] + ("..." if len(content) > chars else ""))


def _too_long(what: str, length: int, max_model_len: int) -> str:
    return (
        f"{what} is {length} tokens as rendered with the chat template, and the vLLM server's `max_model_len` is "
        f"{max_model_len}: no token could be generated after it (vLLM refuses the request). Shorten the prompt or "
        "drop it from the validation set, or serve a longer `max_model_len`."
    )


class ValidationRollouts:
    """Makes the validation rows of `AsyncTracIn` (module docstring).

    Args:
        trainer: The `AsyncAgenticGRPOTrainer` (or an object with its attributes: `args`, `processing_class`,
            `eos_token_ids`, `_environment_factory`, `_tools_list`, `_reward_funcs_list`, `_request_model_name`).

    Attributes:
        max_parallel: Trajectories run at once (default `DEFAULT_PARALLEL_TRAJECTORIES`);
            `bench/async_tracin_refresh.py` sets 1 to measure one after another.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        args = trainer.args
        self.max_parallel = DEFAULT_PARALLEL_TRAJECTORIES
        self._host = EstimatorHost(trainer)
        # The trainer-side estimator (None: the worker's GRPO advantages), run through a host of its own whose
        # metrics are discarded: validation is not training (the synchronous trainer keeps them out too).
        self._estimator = getattr(trainer, "advantage_estimator", None)
        self._estimator_host = EstimatorHost(trainer) if self._estimator is not None else None
        self._renderer: ChatRenderer | None = None  # chosen at the first refresh, from its environments' tools
        self._segment_reward = snapshot_reward(getattr(args, "snapshot_reward_func", None))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Idle environments by environment name (None: a single factory), as TRL's worker pools them; drawn and
        # returned by the trajectories' threads under the lock, built under it too (a constructor need not be
        # thread-safe).
        self._pool: dict[str | None, list] = {}
        self._pool_lock = threading.Lock()

    # ----------------------------------------------------------------------------------------------- event loop
    def event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of async tools and rewards, started on first use and kept until `close`."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="tracin-validation-loop", daemon=True)
            self._thread.start()
        return self._loop

    def close(self) -> None:
        """Stop the event loop: cancel what still runs on it, finish its async generators, join its thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def shutdown():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=60)
        except Exception as error:  # noqa: BLE001 - closing must not hide what ended training
            logger.warning(f"TracIn's validation event loop did not shut down cleanly: {error!r}")
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=60)
        if not self._thread.is_alive():
            loop.close()

    def call(self, func, **kwargs):
        """`func(**kwargs)`, awaited on the event loop when it is async (TRL's worker awaits async reward functions
        and an async `get_reward`)."""
        from trl.trainer.utils import is_async_callable

        if not is_async_callable(func):
            return func(**kwargs)
        return asyncio.run_coroutine_threadsafe(func(**kwargs), self.event_loop()).result()

    # ----------------------------------------------------------------------------------------------- a refresh
    def check_prompts(self, dataset) -> None:
        """Refuse a validation set holding a prompt the server cannot take, before any validation rollout.

        A refresh rolls out a sample of the validation prompts, so a prompt of `max_model_len` tokens or more would
        stop training (vLLM answers 400) at the first refresh that draws it, possibly hours in. Every example with a
        `prompt` is rendered once, as a trajectory renders it (the worker's chat template, the tools of its
        environment), and the first that leaves no room for a generated token is named. An environment's `reset`
        observation, appended to the prompt, is not known here: a trajectory checks its own prompt too.

        Raises:
            ValueError: If an example's prompt is `max_model_len` tokens or longer.
        """
        max_model_len = self.trainer.vllm_client.get_max_model_len()
        if self._renderer is None:
            self._renderer = self._choose_renderer()
        for index in range(len(dataset)):
            row = dict(dataset[index])
            if not isinstance(row.get("prompt"), list):
                continue  # no conversation to render: the prompt is the environment's observation
            name, _ = self._environment_name(row)
            environment = self._draw(name)
            try:
                tools = list(self._tool_dict(environment).values())
            finally:
                if environment is not None:
                    with self._pool_lock:
                        self._pool.setdefault(name, []).append(environment)
            length = len(self._renderer.prompt_ids(row["prompt"], tools=tools))
            if length >= max_model_len:
                raise ValueError(
                    _too_long(f"Validation example {index} of `tracin_eval_dataset`", length, max_model_len)
                )

    def run(self, prompts: list[dict], seed: int) -> tuple[list[dict], list[float]]:
        """Roll out `prompts` (`tracin_val_num_generations` times each) and score them.

        Returns:
            `(rows, rewards)`: the trained rows of every group (`input_ids`, `completion_mask`, `advantage`, `kind`),
            and each conversation's reward (NaN for a lost one).
        """
        t, args = self.trainer, self.trainer.args
        n = args.tracin_val_num_generations
        max_model_len = t.vllm_client.get_max_model_len()
        if self._renderer is None:
            self._renderer = self._choose_renderer()
        # One seed per trajectory, drawn before any runs: the same samples are asked for however the threads
        # interleave.
        seeds = random.Random(seed).sample(range(2**62), len(prompts) * n)
        jobs = [(row, seeds[g * n + k]) for g, row in enumerate(prompts) for k in range(n)]
        self.event_loop()
        workers = max(1, min(len(jobs), self.max_parallel or len(jobs)))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tracin-val") as pool:
            done = list(pool.map(lambda job: self._job(*job, max_model_len), jobs))
        out, rewards = [], []
        for g, row in enumerate(prompts):
            group = done[g * n : (g + 1) * n]
            group_rewards = self._rewards(row, group)
            # An estimator's requests (RLVCR's alternative thinking) draw their seeds from the refresh's seed too.
            out += self._score(row, group, group_rewards, random.Random(f"{seed}/estimator/{g}"))
            rewards += [math.nan if rows[0].lost else r for (_, rows, _), r in zip(group, group_rewards)]
        return out, rewards

    def _job(self, row: dict, seed: int, max_model_len: int):
        """One trajectory in its thread, with an environment drawn from the pool and returned to it afterwards."""
        name, kwargs = self._environment_name(row)
        environment = self._draw(name)
        try:
            return self._trajectory(row, (environment, kwargs), seed, max_model_len)
        finally:
            if environment is not None:
                with self._pool_lock:
                    self._pool.setdefault(name, []).append(environment)

    def _environment_name(self, row: dict):
        """`(environment name, reset kwargs)` of a validation example: with a dict `environment_factory` the example's
        `environment` field names it (and is not passed to `reset`), as in TRL's worker; else None and the row."""
        factory = self.trainer._environment_factory
        if not isinstance(factory, dict):
            return None, row
        name = row.get("environment")
        if name not in factory:
            raise ValueError(
                f"Validation example has `environment={name!r}`, which is not among the environments passed to "
                f"`environment_factory`. Expected one of: {list(factory)}."
            )
        return name, {k: v for k, v in row.items() if k != "environment"}

    def _draw(self, name):
        """An idle environment of `name` from the pool, or a new one (TRL's "construct once, reset often": a
        sandbox is not started again for every trajectory). None without an `environment_factory`."""
        factory = self.trainer._environment_factory
        if factory is None:
            return None
        with self._pool_lock:
            idle = self._pool.get(name)
            if idle:
                return idle.pop()
            return (factory[name] if isinstance(factory, dict) else factory)()

    def _choose_renderer(self) -> ChatRenderer:
        """The worker's template, decided once as TRL's worker decides it: from every tool it can expose, one
        instance of each environment probed (and kept in the pool)."""
        t = self.trainer
        factory = t._environment_factory
        names = list(factory) if isinstance(factory, dict) else ([None] if factory is not None else [])
        tools = bool(t._tools_list)
        for name in names:
            environment = self._draw(name)
            tools = tools or bool(tool_methods(environment))
            with self._pool_lock:
                self._pool.setdefault(name, []).append(environment)
        template = worker_chat_template(t.processing_class, tools)
        return ChatRenderer(t.processing_class, template, getattr(t.args, "chat_template_kwargs", None))

    def _tool_dict(self, environment) -> dict:
        """The tools a trajectory exposes: the trainer's, then its environment's methods."""
        tool_dict = {f.__name__: f for f in (self.trainer._tools_list or [])}
        if environment is not None:
            tool_dict.update(tool_methods(environment))
        return tool_dict

    def _trajectory(self, row: dict, environment_and_kwargs, seed: int, max_model_len: int):
        """One trajectory: `(completion messages, its rows, what its rewards are computed from)`."""
        args = self.trainer.args
        environment, reset_kwargs = environment_and_kwargs
        observation = environment.reset(**reset_kwargs) if environment is not None else None
        tool_dict = self._tool_dict(environment)
        tools = list(tool_dict.values())
        # Two streams of one seed: the requests' sampling seeds, and the loop's own draws (snapshot downsampling).
        seeds = random.Random(seed)
        backend = _HTTPBackend(self._host, self._renderer, tools, max_model_len, random.Random(seeds.getrandbits(64)))
        prompt = row["prompt"] if "prompt" in row or environment is None else [{"role": "user", "content": ""}]
        prompt = with_observation(copy.deepcopy(prompt), observation)
        seen_prompt = copy.deepcopy(prompt)  # the loop extends its prompts in place
        prompt_ids = backend.render_prompt(prompt, 0)
        if len(prompt_ids) >= max_model_len:  # vLLM would answer 400: say which prompt, and why
            raise ValueError(
                _too_long(
                    f"A validation prompt of `tracin_eval_dataset` (its last message begins {_excerpt(prompt)}) with "
                    "its environment's observation",
                    len(prompt_ids),
                    max_model_len,
                )
            )
        loop = AgenticRolloutLoop(
            backend,
            LoopConfig(**{name: getattr(args, name) for name in LoopConfig.__dataclass_fields__}),
            async_loop=self.event_loop(),
            rng=random.Random(seeds.getrandbits(64)),
        )
        # The first turn is asked for as the loop asks for later ones (at least one token, as the worker asks).
        (ids,), (lps,) = backend.generate([prompt_ids], limits=[max(1, loop._turn_limit(prompt_ids, prompt_ids))])
        message = backend.parse(ids, prompt_ids, 0)
        prompt_lists = [prompt_ids]
        sync = {n: f for n, f in tool_dict.items() if not inspect.iscoroutinefunction(f)}
        asynchronous = {n: f for n, f in tool_dict.items() if inspect.iscoroutinefunction(f)}
        trl_tuple, result = loop.run(
            [prompt],
            prompt_lists,
            [list(ids)],
            [[message]],
            [list(lps)],
            [sync],
            [asynchronous],
            # The environment the worker's loop gets: the owner of the rollout's tool methods (`environment_of`).
            [env] if (env := environment_of(tool_dict, self.trainer._tools_list or ())) is not None else None,
        )
        tool_mask, completions, completion_ids, *_ = trl_tuple
        rows = trajectory_rows(prompt_lists[0], trl_tuple, result, backend.stop_token_ids)
        # TRL's environment-reward rule: `get_reward` defined on the environment's class.
        owns_reward = environment is not None and inspect.isfunction(getattr(type(environment), "get_reward", None))
        inputs = {
            "prompt": seen_prompt,
            # The model's tokens, as TRL's worker passes `completion_ids` (the tools' tokens are not the model's).
            "completion_ids": [tok for tok, m in zip(completion_ids[0], tool_mask[0]) if m],
            "env_reward": self.call(environment.get_reward) if owns_reward else None,
        }
        return completions[0], rows, inputs

    def _rewards(self, row: dict, group: list) -> list[float]:
        """Per conversation: the reward functions' sum (weight 1 each, as TRL's worker) plus an environment's
        `get_reward`; NaN where every source gave None."""
        t = self.trainer
        n = len(group)
        kwargs = {k: [v] * n for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        inputs = [i for _, _, i in group]
        columns = []
        for func in t._reward_funcs_list:
            values = self.call(
                func,
                prompts=[i["prompt"] for i in inputs],
                completions=[c for c, _, _ in group],
                completion_ids=[i["completion_ids"] for i in inputs],
                **kwargs,
            )
            columns.append([np.nan if v is None else float(v) for v in values])
        env_rewards = [i["env_reward"] for i in inputs]
        if any(r is not None for r in env_rewards):
            columns.append([np.nan if r is None else float(r) for r in env_rewards])
        values = np.array(columns, dtype=float).reshape(len(columns), n)
        total = np.nansum(values, axis=0)
        total[np.all(np.isnan(values), axis=0)] = np.nan
        return total.tolist()

    def _score(self, row: dict, group: list, conversation_rewards: list[float], rng: random.Random) -> list[dict]:
        """The group's rows as the worker scores and trains them (`score_group_rows`), then the trainer-side
        estimator's advantages (its requests seeded from `rng`), 0 without a spread under GRPO and CoPO."""
        args = self.trainer.args
        rows = [r for _, trajectory_rows, _ in group for r in trajectory_rows]
        conversation = [c for c, (_, trajectory_rows, _) in enumerate(group) for _ in trajectory_rows]
        terms = None
        if self._segment_reward is not None:
            terms = []
            for r, c in zip(rows, conversation):
                if r.kind != RowKind.SNAPSHOT:
                    terms.append(0.0)
                    continue
                dataset_row = {k: v for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
                dataset_row["prompt"] = group[c][2]["prompt"]
                terms.append(float(self._segment_reward(segment_info(r, dataset_row))))
        scored, trained = score_group_rows(
            rows,
            conversation,
            [conversation_rewards[c] for c in conversation],
            len(group),
            args,
            terms,
            mask_truncated=bool(getattr(args, "mask_truncated_completions", False)),
        )
        # The synchronous trainer's tie rule (`advantages.tied_rows`): rows whose advantage is 0 in exact arithmetic.
        zero = zero_without_reward_spread(self._estimator, args)
        if self._estimator is None:
            tied = tied_rows(scored.rewards, torch.zeros(len(scored.rewards), dtype=torch.long), scored.baseline)
            return [
                {
                    "input_ids": np.asarray(rows[k].input_ids),
                    "completion_mask": np.asarray(rows[k].completion_mask),
                    "advantage": 0.0 if zero and bool(tied[j]) else float(scored.advantages[j]),
                    "kind": int(rows[k].kind),
                }
                for k, j in trained
            ]
        samples = [
            AgenticRolloutSample(
                prompt=None,
                completion=None,
                input_ids=np.asarray(rows[k].input_ids),
                completion_mask=np.asarray(rows[k].completion_mask),
                old_log_probs=np.zeros(len(rows[k].input_ids), dtype=np.float32),  # unused: V's ratio is 1
                advantage=float(scored.advantages[j]),
                model_version=0,
                group_id=0,
                metrics={},
                row_kind=int(rows[k].kind),
                reward=float(scored.rewards[j]),
                episode=conversation[k],
                trained=is_trained,
            )
            for k, j, is_trained in pushed_rows(scored.keep, trained, untrained=True)
        ]
        if not samples:
            return []
        host = self._estimator_host
        host._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        host.rng = rng
        estimated = estimate_group(samples, self._estimator, host)
        kinds = torch.tensor([int(s.row_kind) for s in estimated])
        rewards = torch.tensor([float(s.reward) for s in estimated], dtype=torch.float64)
        tied = tied_rows(rewards, torch.zeros(len(estimated), dtype=torch.long), baseline_mask(kinds, args))
        return [
            {
                "input_ids": s.input_ids,
                "completion_mask": s.completion_mask,
                "advantage": (np.zeros_like(s.advantage) if isinstance(s.advantage, np.ndarray) else 0.0)
                if zero and bool(tied[n])
                else s.advantage,
                "kind": int(s.row_kind),
            }
            for n, s in enumerate(estimated)
            if s.trained
        ]
