"""The trainer side of the asynchronous agentic trainer: between TRL's rollout queue and its dataloader.

`AgenticRolloutQueue` wraps the worker's queue (TRL's `RolloutQueueDataset` reads it with `get` / `qsize`):

- **Staleness per row kind.** For every row it logs the staleness TRL's dataset is about to check (current policy
  version minus the row's `model_version`, the version when its group started, the same for every kind) as
  `sample/staleness_{kind}_mean` / `_max`, and the rows `max_staleness` is about to drop as
  `sample/dropped_stale_{kind}_total` (`kind` = regular, negative, snapshot, expansion). The drop itself is TRL's.
- **Rows in a random order within their group.** A group's rows (`group_rows` of them, pushed one after the other by
  the worker) are passed on once the group is complete, in a random order drawn from the run's seed and the group id
  (`_in_random_order`): TRL drops a group's last rows most, and the worker's order puts the conversations that
  finished last (the ones with rollbacks, and their negative rows) and an estimator's added rows at the end.
- **Estimators.** When `advantage_estimator` is not `"grpo"`, the rows of a group (pushed one after the other by the
  worker, `group_rows` of them, including the rows that are not trained, a lost rollout's and those without a trained
  token, as the synchronous trainer's estimator sees them with a zero loss mask; they are dropped once the estimator
  ran) are collected and the estimator is called once per group through the estimator protocol
  (`trl_agentic.estimators`): an `AdvantageBatch` of the group (`rows.advantage_batch`), and as `trainer` an
  `EstimatorHost`, which gives an estimator the attributes of `AgenticGRPOTrainer` the built-in ones use (the
  tokenizer, the model, one-turn generation through the vLLM server with the current adapter, per-token log-probs).
  Token-level advantages travel as the row's `advantage` array (over its whole `input_ids`, 0 on the prompt), which
  `pack_with_token_advantages` turns into TRL's per-loss-term advantages. Rows an estimator adds
  (`EstimatorResult.extra_rows`, RLVCR's expansions) join the group as `RowKind.EXPANSION` rows. A negative row's
  advantage is clamped at 0 afterwards, as in the synchronous trainer.

Estimators run on the main process, one group at a time; their collectives see one process (`EstimatorHost.accelerator`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import queue
import random
import time

import numpy as np
import torch

from ..batch import check_estimate, negative_not_a_penalty
from ..rollout.types import RowKind
from .compat import trainer_module
from .rows import advantage_batch, baseline_mask, clamp_negatives, row_from_tokens
from .worker import is_consumed_marker

__all__ = [
    "AgenticRolloutQueue",
    "EstimatorHost",
    "estimate_group",
    "pack_with_token_advantages",
    "token_advantage_collate",
]

logger = logging.getLogger(__name__)

# Groups in a row without a row to train after which the stage warns (again at each doubling); three passes over the
# training prompts (at least `UNTRAINED_GROUPS_LIMIT` groups) without one is an error: TRL's dataset only waits.
UNTRAINED_GROUPS_WARNING = 8
UNTRAINED_GROUPS_LIMIT = 64

# Generation requests an `EstimatorHost` keeps in flight at once (the server queues what it cannot batch).
MAX_CONCURRENT_REQUESTS = 64
# Attempts of a generation request (TRL's worker: 30 for its completions).
REQUEST_ATTEMPTS = 30

KIND_NAMES = {
    int(RowKind.REGULAR): "regular",
    int(RowKind.NEGATIVE): "negative",
    int(RowKind.SNAPSHOT): "snapshot",
    int(RowKind.EXPANSION): "expansion",
}


class _OneProcess:
    """The accelerator an estimator sees: the main process alone (estimators run there, one group at a time)."""

    num_processes = 1
    process_index = 0
    is_main_process = True

    def __init__(self, device):
        self.device = device

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    def unwrap_model(self, model):
        return model


class EstimatorHost:
    """What an advantage estimator reads from its `trainer` argument, for the asynchronous trainer.

    The built-in estimators (`grpo`, `rlvcr`) use: `args`, `model`, `_tokenizer`, `processing_class`, `accelerator`,
    `_metrics`, `chat_template` / `chat_template_kwargs`, `use_vllm`, `_generate_single_turn` and
    `_get_per_token_logps_and_entropies` (same signatures as `GRPOTrainer`'s).
    """

    use_vllm = True  # generation goes through the vLLM server (no transformers generation config to cap)
    chat_template = None

    def __init__(self, trainer):
        self._trainer = trainer
        self.args = trainer.args
        self.processing_class = self._tokenizer = trainer.processing_class
        self.chat_template_kwargs = trainer.args.chat_template_kwargs or {}
        self._metrics = trainer._metrics
        self.accelerator = _OneProcess(trainer.accelerator.device)
        self.temperature = trainer.args.temperature
        # Where an estimator's requests (`_generate_single_turn`) draw their sampling seeds: None, the `random`
        # module; TracIn's validation sets a stream of the refresh's seed per group.
        self.rng: random.Random | None = None

    @property
    def model(self):
        return self._trainer.accelerator.unwrap_model(self._trainer.model)

    def _generate_single_turn(
        self, prompt_ids, images=None, multimodal_fields=None, num_generations=1, max_tokens=None, **kwargs
    ):
        """One sampled turn per prompt from the vLLM server, with the adapter of the current policy version."""
        args = self.args
        limit = max_tokens or getattr(args, "rlvcr_max_thinking_tokens", args.max_completion_length)
        return self.complete(prompt_ids, [limit] * len(prompt_ids), rng=self.rng)

    def complete(self, prompts, max_tokens: list[int], rng: random.Random | None = None):
        """One sampled turn per prompt (`max_tokens[k]` tokens at most for prompt k) from the vLLM server, with the
        current policy's adapter. The requests are sent together, so that the server batches them (one at a time,
        each waits for the last: a refresh of TracIn's V took most of a 945 s step); the results are in the prompts'
        order. Each request's sampling seed is drawn from `rng` (default: the `random` module) in that order before
        any is sent, so the seeds do not depend on which request returns first.

        Returns:
            `(ids, logprobs)`: per prompt, the generated token ids and their log-probs.
        """
        t, args = self._trainer, self.args
        rng = rng if rng is not None else random
        payloads = [
            {
                "model": t._request_model_name(),
                "prompt": list(prompt),
                "max_tokens": int(limit),
                "temperature": args.temperature,
                "top_p": args.top_p,
                "top_k": args.top_k,
                "repetition_penalty": args.repetition_penalty,
                "n": 1,
                "return_token_ids": True,
                "logprobs": 0,
                "seed": rng.getrandbits(63),
                # Sampled as TRL's worker samples the training rollouts (its `_generate_one_turn`'s request).
                **({} if args.min_p is None else {"min_p": args.min_p}),
            }
            for prompt, limit in zip(prompts, max_tokens, strict=True)
        ]
        if len(payloads) <= 1:
            choices = [self._post(p) for p in payloads]
        else:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(len(payloads), MAX_CONCURRENT_REQUESTS)
            ) as pool:
                choices = list(pool.map(self._post, payloads))
        return [c["token_ids"] for c in choices], [c["logprobs"]["token_logprobs"] for c in choices]

    def _post(self, payload: dict) -> dict:
        """One completion request, retried when the server is unreachable or answers 5xx (up to `REQUEST_ATTEMPTS`
        attempts, waits of 1, 2, 4, 8, then 16 s, as TRL's worker waits). Unlike TRL's worker, a 4xx answer (a bad
        request: retrying cannot help) and a request that timed out (it already waited `request_timeout`; 30 of them
        would hold the training process for hours) are not retried: the error reaches the caller."""
        import requests

        args = self.args
        url = f"{args.vllm_server_base_url.rstrip('/')}/v1/completions"
        for attempt in range(REQUEST_ATTEMPTS):
            try:
                response = requests.post(url, json=payload, timeout=args.request_timeout)
                if 400 <= response.status_code < 500:
                    raise _refused(response, payload)
                if response.status_code < 500 or attempt == REQUEST_ATTEMPTS - 1:
                    response.raise_for_status()
                    return response.json()["choices"][0]
            except requests.ConnectionError:
                if attempt == REQUEST_ATTEMPTS - 1:
                    raise
            time.sleep(min(2 ** min(attempt, 4), 16))
        raise AssertionError("unreachable")

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, **_
    ):
        """Log-probs of the last `logits_to_keep` tokens (at the sampling temperature), as `GRPOTrainer` returns them."""
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logits = logits[:, -logits_to_keep - 1 : -1].float() / self.temperature
        targets = input_ids[:, -logits_to_keep:]
        logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logps, None, None


def _refused(response, payload: dict):
    """The `HTTPError` of a request the server refused (4xx), with what it answered: `raise_for_status` says only
    "400 Client Error: Bad Request", and vLLM's reason (a prompt longer than `max_model_len`, an unknown adapter) is in
    the body."""
    import requests

    body = response.text.strip()
    return requests.HTTPError(
        f"The vLLM server refused a generation request ({response.status_code} {response.reason}) for "
        f"`{payload.get('model')}`, a prompt of {len(payload.get('prompt', ()))} tokens and "
        f"`max_tokens={payload.get('max_tokens')}`: {body[:2000] or '(no answer body)'}",
        response=response,
    )


class AgenticRolloutQueue:
    """The worker's rollout queue, seen through trl-agentic's trainer-side stage (module docstring).

    Args:
        trainer: The `AsyncAgenticGRPOTrainer`.
        inner: The worker's queue (`rollout_worker.rollout_buffer`).
        estimator: The estimator to run per group, or None (the worker's GRPO advantages are kept).
    """

    def __init__(self, trainer, inner, estimator=None):
        self._trainer = trainer
        self._inner = inner
        self._estimator = estimator
        self._host = EstimatorHost(trainer) if estimator is not None else None
        self._pending: list = []
        self._ready: collections.deque = collections.deque()
        self._untrained_streak = 0  # groups in a row the worker pushed no row to train of
        self._warned_negative_reward = False

    def qsize(self) -> int:
        # TRL logs it as `sample/rollout_queue_size`: a group being collected is still queued.
        return self._inner.qsize() + len(self._pending) + len(self._ready)

    def get(self, timeout=None):
        # `timeout` bounds the whole call, not only each read: while the worker pushes only groups without a row to
        # train (consumed markers), TRL's dataset still gets `queue.Empty` and runs its health check between polls.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            sample = self._inner.get(timeout=remaining)  # `queue.Empty` reaches TRL's dataset, which polls again
            if getattr(sample, "group_rows", 0) <= 0:  # not trl-agentic's worker: no groups to wait for
                if self._estimator is not None:
                    raise RuntimeError(
                        f"An advantage estimator runs on a group's rows, but the rollout worker pushed a "
                        f"{type(sample).__name__} without its group's size (`group_rows`): only trl-agentic's loop in "
                        "TRL's `AsyncRolloutWorker` pushes them. Use TRL's worker, or leave `advantage_estimator` at "
                        '"grpo" and pass no estimator.'
                    )
                if getattr(sample, "trained", True):
                    self._ready.append(sample)
                    self._untrained_streak = 0  # a group with a row to train (TRL's own rows: every feature off)
                continue
            if self._pending and self._pending[0].group_id != sample.group_id:
                self._release()  # an incomplete group (a worker that stopped mid-group) is not merged with the next
            self._pending.append(sample)
            if len(self._pending) >= sample.group_rows:
                self._release()
                self._check_progress()
            if not self._ready and not self._pending and deadline is not None and time.monotonic() >= deadline:
                if not self._queued():  # at a group's end, once what was already pushed is read
                    raise queue.Empty
        sample = self._ready.popleft()
        self._observe(sample)
        return sample

    def _queued(self) -> bool:
        try:
            return self._inner.qsize() > 0
        except NotImplementedError:  # a multiprocessing queue on macOS
            return False

    def _check_progress(self) -> None:
        """Warn when a streak of groups without a row to train reaches `UNTRAINED_GROUPS_WARNING` (and at each doubling);
        raise after three passes over the training prompts (the synchronous trainer would step with a zero loss)."""
        streak = self._untrained_streak
        prompts = getattr(self._trainer, "train_dataset", None)
        try:  # far from chance: an early policy truncated under `mask_truncated_completions` fails groups in a row
            limit = max(UNTRAINED_GROUPS_LIMIT, 3 * len(prompts))
        except TypeError:  # an iterable dataset without a length
            limit = None
        causes = (
            "every rollout was lost to an infrastructure error (`infra/lost_rollouts_total`, the worker's log) or "
            "every conversation was truncated under `mask_truncated_completions` (raise `max_completion_length`, or "
            "turn it off)"
        )
        if limit is not None and streak >= limit:
            raise RuntimeError(
                f"The rollout worker pushed {streak} groups in a row without a row to train (at least three passes "
                f"over the {len(prompts)} training prompts): {causes}. No step has run since, and none is coming."
            )
        if streak >= UNTRAINED_GROUPS_WARNING and streak & (streak - 1) == 0:  # 8, 16, 32, ...
            logger.warning(
                f"The rollout worker pushed {streak} groups in a row without a row to train, so no step can run: "
                f"{causes}. Training stops with an error after {limit or 'an unbounded number of'} such groups."
            )

    def _warn_negative_reward_not_lowest(self, rows: list) -> None:
        """The synchronous trainer's warning (`batch.negative_not_a_penalty`), once a run, from a group's rows."""
        kinds = [int(getattr(s, "row_kind", RowKind.REGULAR)) for s in rows]
        if self._warned_negative_reward or int(RowKind.NEGATIVE) not in kinds:
            return
        rewards = torch.tensor([float(getattr(s, "reward", math.nan)) for s in rows])
        message = negative_not_a_penalty(rewards, torch.zeros(len(rows), dtype=torch.long), torch.tensor(kinds))
        if message is not None:
            self._warned_negative_reward = True
            logger.warning(message)

    def _release(self) -> None:
        group, self._pending = self._pending, []
        real = [s for s in group if not is_consumed_marker(s)]
        self._warn_negative_reward_not_lowest(real)
        # A group already past `max_staleness` is dropped by TRL's dataset, every row: the estimator's work (RLVCR:
        # generation and scoring forwards on the training process) would be spent on nothing.
        stale = self._trainer.model_version - int(group[0].model_version) > self._trainer.args.max_staleness
        rows = self._estimate(real) if self._estimator is not None and real and not stale else real
        trained = [s for s in rows if getattr(s, "trained", True)]
        self._untrained_streak = 0 if trained else self._untrained_streak + 1
        if not trained:
            # TRL counts a group as trained when its collator packs one of its rows: its checkpoints resume from the
            # first group never counted (`_save_checkpoint`'s `prompt_index`), and `num_train_epochs` ends when the
            # epoch's groups are counted. A group with no row to train (every conversation truncated under
            # `mask_truncated_completions`, or lost) is consumed all the same; uncounted, every later checkpoint
            # would resume at it (and train again what followed), and the epoch would run on past its end.
            self._trainer._trained_groups.add(int(group[0].group_id))
        self._ready.extend(self._in_random_order(trained))

    def _in_random_order(self, rows: list) -> list:
        """A group's rows in a random order, one permutation per group drawn from the run's seed and the group id.

        TRL's dataset reads rows in queue order and drops the ones read more than `max_staleness` versions after their
        group started: a group's last rows are read latest (a group of 10 rows read 8 a step leaves 2 for the next
        step), so they are dropped most. The worker's order is not random: conversations in the order they finished
        (those with rollbacks last, and their negative rows with them), an estimator's added rows after the group.
        Drawn at random, every row of a group has the same chance of being dropped, whatever its kind, length or
        reward (exactly so with a fixed count of rows a step; with a token budget where a step ends depends on the
        lengths read before it, a second-order effect), and the rows a step trains are a fair sample of their group's."""
        if len(rows) < 2:
            return rows
        rng = random.Random(f"{getattr(self._trainer.args, 'seed', 0)}/row-order/{rows[0].group_id}")
        return rng.sample(rows, len(rows))

    def get_nowait(self):
        return self.get(timeout=0)

    def _observe(self, sample) -> None:
        t = self._trainer
        metrics = t._metrics["train"]
        kind = KIND_NAMES.get(int(getattr(sample, "row_kind", 0)), "regular")
        staleness = t.model_version - sample.model_version
        metrics[f"sample/staleness_{kind}_mean"].append(float(staleness))
        metrics[f"sample/staleness_{kind}_max"].append(float(staleness))
        if staleness > t.args.max_staleness:
            metrics[f"sample/dropped_stale_{kind}_total"].append(1.0)
        advantage = sample.advantage
        t._observed_rows.append(
            {
                "kind": int(getattr(sample, "row_kind", 0)),
                "staleness": int(staleness),
                "model_version": int(sample.model_version),
                "policy_versions": tuple(getattr(sample, "policy_versions", ())),
                "group_id": int(sample.group_id),
                "episode": int(getattr(sample, "episode", -1)),
                "group_rows": int(getattr(sample, "group_rows", 0)),
                "baseline_rows": int(getattr(sample, "baseline_rows", 0)),
                "reward": float(getattr(sample, "reward", math.nan)),
                "advantage": advantage if isinstance(advantage, float) else np.asarray(advantage).copy(),
                "input_ids": np.asarray(sample.input_ids).copy(),
                "completion_mask": np.asarray(sample.completion_mask).copy(),
            }
        )

    def _estimate(self, group: list) -> list:
        return estimate_group(group, self._estimator, self._host)


def estimate_group(group: list, estimator, host: EstimatorHost) -> list:
    """Run `estimator` on one group's pushed rows (`AgenticRolloutSample`s, the untrained ones included) as the
    synchronous trainer runs it on a batch (module docstring): each row's `advantage` becomes the estimator's (a float,
    or an array over its `input_ids`, 0 on the prompt; a negative row's clamped at 0), and the rows it adds follow as
    `RowKind.EXPANSION` rows of the parent's type. Returns the group's rows, then the added ones."""
    args = host.args
    kinds = torch.tensor([int(s.row_kind) for s in group], dtype=torch.long)
    rewards = torch.tensor([float(s.reward) for s in group], dtype=torch.float32)
    rows = [{"input_ids": s.input_ids, "completion_mask": s.completion_mask} for s in group]
    batch = advantage_batch(
        rows,
        rewards,
        [0] * len(group),
        baseline_mask(kinds, args),
        kinds,
        [s.episode for s in group],
        args.scale_rewards,
        args.advantage_std_floor,
    )
    untrained = torch.tensor([not getattr(s, "trained", True) for s in group], dtype=torch.bool)
    batch.tool_mask[untrained] = 0  # as the synchronous trainer masks its untrained rows before the estimator
    batch.loss_mask[untrained] = 0
    model = host.model
    if not model.training:
        # Only training rows (and TracIn's validation rows, during a step) come here. TRL reads the first step's
        # rows before `Trainer` puts the model in training mode (a full model comes from `from_pretrained` in eval
        # mode), and an estimator may take eval mode for an evaluation batch (RLVCR then returns episode advantages).
        model.train()
    # Checked as the synchronous trainer checks it: a wrong shape, or an added row's parent out of range (a negative
    # index would silently pick another row), is an error naming what the estimator returned.
    advantages, extra, extra_adv = check_estimate(estimator(batch, host), len(group), batch.completion_ids.size(1))
    advantages = clamp_negatives(advantages.detach().float().cpu(), kinds)
    for k, s in enumerate(group):
        s.advantage = _row_advantage(advantages[k], batch.prompt_ids.size(1), batch.prompt_mask[k], s)
    out = list(group)
    pushed = len(group) - sum(not getattr(s, "trained", True) for s in group)  # what `get` passes on
    for s in group:
        s.group_rows = pushed
    for k, row in enumerate(extra):
        parent = group[row.parent]
        ids, mask, lps = row_from_tokens(row.prompt_ids, row.completion_ids, row.tool_mask, row.logprobs)
        value = extra_adv[k].detach().float().cpu()
        if value.dim() == 1:  # token-level over the row's completion
            value = np.concatenate([np.zeros(len(row.prompt_ids)), value[: len(row.completion_ids)].numpy()])
            value = np.pad(value, (0, len(ids) - len(value)))
        else:
            value = float(value)
        out.append(
            type(parent)(
                prompt=parent.prompt,
                completion=parent.completion,
                input_ids=np.asarray(ids, dtype=np.int64),
                completion_mask=np.asarray(mask, dtype=np.int64),
                old_log_probs=np.asarray(lps, dtype=np.float32),
                advantage=value,
                model_version=parent.model_version,
                group_id=parent.group_id,
                metrics={**parent.metrics, "rows/expansion_frac": 1.0},
                row_kind=int(RowKind.EXPANSION),
                reward=parent.reward,
                episode=parent.episode,
                group_rows=pushed + len(extra),
                policy_versions=parent.policy_versions,
            )
        )
    for s in out[: len(group)]:
        s.metrics = {**s.metrics, "rows/expansion_frac": 0.0}
    return out


def _row_advantage(value: torch.Tensor, prompt_width: int, prompt_mask: torch.Tensor, sample):
    """A row's advantage in TRL's layout: a float, or an array over its `input_ids` (0 on the prompt)."""
    if value.dim() == 0:
        return float(value)
    prompt_len = int(prompt_mask.sum())
    completion_len = len(sample.input_ids) - prompt_len
    tokens = np.zeros(len(sample.input_ids), dtype=np.float32)
    tokens[prompt_len:] = value[:completion_len].numpy()
    return tokens


def pack_with_token_advantages(row) -> dict:
    """TRL's `TreeRow.pack`, with each loss term's advantage read per token when a row's `advantage` is an array.

    TRL's packer appends `sample["advantage"]` once per trained target, in sample order and, within a sample, in
    position order (`p = 1 .. len - 1` with `completion_mask[p]`); the same order is used here.
    """
    saved = [s["advantage"] for s in row.samples]
    for s in row.samples:
        if isinstance(s["advantage"], np.ndarray):
            s["advantage"] = 0.0
    try:
        packed = trainer_module().TreeRow.pack(row)
    finally:
        for s, value in zip(row.samples, saved):
            s["advantage"] = value
    values = []
    for s, value in zip(row.samples, saved):
        mask = np.asarray(s["completion_mask"])
        positions = np.nonzero(mask[1:])[0] + 1
        if isinstance(value, np.ndarray):
            values.extend(value[positions].tolist())
        else:
            values.extend([float(value)] * len(positions))
    packed["advantages"] = torch.tensor(values, dtype=torch.float32)
    return packed


class token_advantage_collate:  # noqa: N801 - a callable used like TRL's collator instance
    """Wraps TRL's rollout collator: rows are packed with `pack_with_token_advantages`, and an optional `before`
    hook sees the micro-batch's rows first and returns tensors to add to the packed batch (the TracIn filter's tag)."""

    def __init__(self, inner, before=None):
        self.inner = inner
        self.before = before

    def __call__(self, examples):
        (rows,) = examples
        extra = self.before(rows) if self.before is not None else None
        for row in rows:
            row.pack = _bound_pack(row)
        batch = self.inner(examples)
        batch.update(extra or {})
        return batch


def _bound_pack(row):
    return lambda: pack_with_token_advantages(row)
