"""The asynchronous TracIn filter's validation rows and direction V (`trl_agentic.async_grpo.validation`, `AsyncTracIn.
refresh`), no vLLM needed: trajectories are scripted (`ValidationRollouts._trajectory` replaced) or served by a
scripted HTTP server, and V is checked against autograd by hand. The rows' advantages are checked against the rules
written out (mean and unbiased std over the baseline rows, TRL's `+ 1e-4`), not against the worker's own functions."""

from __future__ import annotations

import asyncio
import collections
import copy
import itertools
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from async_tracin_helpers import lora_model
from rollout_helpers import call

from trl_agentic.advantages import group_advantages
from trl_agentic.async_grpo.rows import AgenticSequence
from trl_agentic.rollout.types import RowKind


def _trainer(model, tokenizer=None, **config):
    """What `AsyncTracIn` and `ValidationRollouts` read of the trainer, with a real `AsyncAgenticGRPOConfig`."""
    from trl_agentic.async_grpo.config import AsyncAgenticGRPOConfig

    values = dict(
        output_dir="unused",
        tracin_enabled=True,
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        report_to=[],
        seed=0,
        tracin_val_batch_size=1,
        tracin_val_num_generations=3,
    )
    values.update(config)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")] if tokenizer is not None else [0]
    return SimpleNamespace(
        args=AsyncAgenticGRPOConfig(**values),
        processing_class=tokenizer,
        eos_token_ids=eos,
        _request_model_name=lambda: "policy",
        vllm_client=SimpleNamespace(get_max_model_len=lambda: 10_000),
        _environment_factory=None,
        _tools_list=[],
        _reward_funcs_list=[_scripted_reward],
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")),
        model=model,
        temperature=0.7,
        epsilon_low=0.2,
        epsilon_high=0.2,
        state=SimpleNamespace(global_step=0),
        _metrics={"train": collections.defaultdict(list)},
    )


def _tracin(trainer, prompts):
    """An `AsyncTracIn` of `trainer` as `__init__` leaves it, without `__init__`'s checks."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn
    from trl_agentic.async_grpo.validation import ValidationRollouts

    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.refreshed_at, tracin.refreshes = trainer, None, None, 0
    tracin.val_rows, tracin.rolled_out_at, tracin.last = None, None, {}
    tracin.dataset = [{"prompt": p} for p in prompts]
    tracin.validation = ValidationRollouts(trainer)
    tracin._prompts_checked = True  # `ValidationRollouts.check_prompts` is tested on its own
    return tracin


def _scripted_reward(prompts, completions, completion_ids, **kwargs):
    """The reward a scripted completion carries (`"reward: 0.5"`), None for `"reward: none"`."""
    values = [c[-1]["content"].split("reward: ")[1] for c in completions]
    return [None if v == "none" else float(v) for v in values]


def _row(ids, mask, kind=RowKind.REGULAR, **fields):
    return AgenticSequence(list(ids), list(mask), [0.0] * len(ids), "r", kind=int(kind), **fields)


def _script(tracin, plan):
    """Replace the trajectories: `plan(prompt text, k-th trajectory of the refresh)` gives `(reward text, rows)`. They
    run one after another (`max_parallel = 1`), so that the k-th is the refresh's k-th job."""
    made = itertools.count()
    tracin.validation.max_parallel = 1

    def trajectory(row, environment_and_kwargs, seed, max_model_len):
        k = next(made)
        reward, rows = plan(row["prompt"], k)
        inputs = {"prompt": row["prompt"], "completion_ids": [], "env_reward": None}
        return [{"role": "assistant", "content": f"reward: {reward}"}], rows, inputs

    tracin.validation._trajectory = trajectory
    return made


def _inputs():
    return {"prompt": "p", "completion_ids": [2], "env_reward": None}


def _pool(n=6, seed=0):
    """`n` distinct short rows: 4 prompt tokens, 3-5 completion tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        ids = rng.integers(5, 250, size=4 + 3 + k % 3).tolist()
        out.append((ids, [0] * 4 + [1] * (len(ids) - 4)))
    return out


def _by_hand(rewards):
    """GRPO advantages of one group written out: (r - mean) / (unbiased std + 1e-4), NaN rows left out."""
    values = [r for r in rewards if not math.isnan(r)]
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(r - mean) / (std + 1e-4) for r in rewards]


def _brute_force_direction(model, rows, temperature):
    """V by hand at ratio 1: the LoRA gradient of `-sum_b sum_t A_bt logp_bt / N` over the trained positions (each
    row's own forward; N the trained tokens of all rows; a row's advantage a number or an array over its
    `input_ids`), which is the gradient of TRL's clipped loss where the ratio is 1."""
    from trl_agentic.tracin.layers import find_lora_layers

    refs = find_lora_layers(model)
    n_tokens = sum(int(np.asarray(r["completion_mask"])[1:].sum()) for r in rows)
    loss = 0.0
    for r in rows:
        ids = torch.as_tensor(np.asarray(r["input_ids"]))[None]
        logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1] / temperature, -1).gather(-1, ids[0, 1:, None])
        mask = torch.as_tensor(np.asarray(r["completion_mask"])[1:], dtype=torch.float64)
        advantage = np.broadcast_to(np.asarray(r["advantage"], dtype=np.float64), (ids.size(1),))
        loss = loss - (torch.as_tensor(advantage[1:].copy()) * logps[:, 0] * mask).sum() / n_tokens
    grads = torch.autograd.grad(loss, [w for ref in refs for w in (ref.lora_A.weight, ref.lora_B.weight)])
    return torch.cat([g.flatten() for g in grads])


def _flat(direction):
    return torch.cat([torch.cat([g.A.double().flatten(), g.B.double().flatten()]) for g in direction.values()])


# ----------------------------------------------------------------------------------------------------------- rows


def test_a_validation_group_without_reward_spread_adds_nothing_to_v(tiny_model_dir):
    """Validation groups tied at 0.3 (six equal rewards: TRL's float32 advantages are rounding noise of one sign, the
    control below) get advantage 0 and add nothing to V; a group with a spread keeps its GRPO advantages. With every
    group tied V is exactly 0, so every row is kept (`direction_is_zero`), not selected by the noise's direction."""
    noise = group_advantages(torch.full((6,), 0.3), torch.zeros(6, dtype=torch.long))
    assert bool((noise != 0).any())  # the case is real

    model = lora_model(tiny_model_dir)
    pool = _pool()
    rewards = {"tie": [0.3] * 6, "spread": [0.3, 0.5, 0.3, 0.9, 0.1, 0.3]}

    def refreshed(prompts):
        trainer = _trainer(model, tracin_val_batch_size=len(prompts), tracin_val_num_generations=6)
        tracin = _tracin(trainer, prompts)
        tracin.order = []  # the prompt of each job, in job order

        def plan(prompt, k):
            tracin.order.append(prompt)
            return rewards[prompt][k % 6], [_row(*pool[k % 6])]

        _script(tracin, plan)
        tracin.refresh()
        return tracin

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        tracin = refreshed(["tie", "spread"])
    assert not [w for w in got if "validation gradient is exactly 0" in str(w.message)]  # one group has a spread
    assert sorted(tracin.order[::6]) == ["spread", "tie"]  # one group per prompt, in the refresh's order
    advantages = [r["advantage"] for r in tracin.val_rows]
    tie = [a for a, prompt in zip(advantages, tracin.order) if prompt == "tie"]
    spread = [a for a, prompt in zip(advantages, tracin.order) if prompt == "spread"]
    assert tie == [0.0] * 6
    expected = group_advantages(torch.tensor(rewards["spread"]), torch.zeros(6, dtype=torch.long))
    assert spread == pytest.approx(expected.tolist(), abs=1e-6) and expected.abs().min() > 0.1
    assert not tracin.direction_is_zero

    with pytest.warns(UserWarning, match=r"validation gradient is exactly 0 at step \d+ .*group of 6 .*harder") as got:
        tracin = refreshed(["tie"])
    assert not any("lost" in str(w.message) for w in got)
    assert [r["advantage"] for r in tracin.val_rows] == [0.0] * 6
    assert tracin.direction_is_zero


def test_validation_rows_are_the_rows_training_would_get(tiny_model_dir):
    """One group of three rollouts: a success, a failure with a negative row (a rolled-back attempt) and a rollout lost
    to the infrastructure. V's rows are those the worker trains: the two regular rows and the negative row (reward
    `negative_sample_reward`, in the baseline under `all_rows`, its advantage clamped at 0); the lost rollout's row is
    left out of both the rows and the statistics. Advantages by hand; V against autograd of the same rows."""
    model = lora_model(tiny_model_dir)
    pool = _pool()
    trainer = _trainer(model, save_negative_samples=True, enable_tool_rollback=True, group_baseline="all_rows")
    tracin = _tracin(trainer, ["p"])
    plans = [
        ("1.0", [_row(*pool[0])]),
        ("0.0", [_row(*pool[1]), _row(*pool[2], kind=RowKind.NEGATIVE, error_types=["ValueError"])]),
        ("1.0", [_row(*pool[3], lost=True)]),
    ]
    _script(tracin, lambda prompt, k: plans[k])
    tracin.refresh()
    negative = trainer.args.negative_sample_reward
    expected = _by_hand([1.0, 0.0, negative])
    expected[2] = min(expected[2], 0.0)
    assert [r["input_ids"].tolist() for r in tracin.val_rows] == [pool[k][0] for k in (0, 1, 2)]
    assert [r["kind"] for r in tracin.val_rows] == [RowKind.REGULAR, RowKind.REGULAR, RowKind.NEGATIVE]
    assert [r["advantage"] for r in tracin.val_rows] == pytest.approx(expected, abs=1e-5)
    assert trainer._metrics["train"]["tracin/val_reward"] == [pytest.approx(0.5)]  # the lost rollout's left out
    torch.testing.assert_close(_flat(tracin.direction), _brute_force_direction(model, tracin.val_rows, 0.7))


def test_a_tied_group_with_a_negative_out_of_the_baseline(tiny_model_dir):
    """Six rollouts tied at 0.3, one with a negative row, one with a snapshot segment, `group_baseline="episodes"`:
    the negative is out of the statistics, so the group is tied; the episodes' float32 advantages are noise (exactly 0
    now), the snapshot's too (its episode's), and the negative keeps the advantage training gives it
    (`score_group_rows`, measured from its episode, at most 0)."""
    from trl_agentic.async_grpo.rows import score_group_rows

    model = lora_model(tiny_model_dir)
    pool = _pool(8)
    trainer = _trainer(
        model, save_negative_samples=True, enable_tool_rollback=True, group_baseline="episodes",
        enable_context_snapshots=True,
    )  # fmt: skip
    trainer.args.tracin_val_num_generations = 6
    tracin = _tracin(trainer, ["p"])
    negative = _row(*pool[6], kind=RowKind.NEGATIVE, error_types=["ValueError"])
    snapshot = _row(*pool[7], kind=RowKind.SNAPSHOT)
    extra = {0: [negative], 1: [snapshot]}
    plans = [("0.3", [_row(*pool[k])] + extra.get(k, [])) for k in range(6)]
    _script(tracin, lambda prompt, k: plans[k])
    tracin.refresh()
    kinds = [RowKind.REGULAR, RowKind.NEGATIVE, RowKind.REGULAR, RowKind.SNAPSHOT] + [RowKind.REGULAR] * 4
    assert [r["kind"] for r in tracin.val_rows] == kinds
    rows = [row for _, rs in plans for row in rs]
    scored, _ = score_group_rows(rows, [0, 0, 1, 1, 2, 3, 4, 5], [0.3] * 8, 6, trainer.args)
    assert bool((scored.advantages[scored.kinds != RowKind.NEGATIVE] != 0).all())  # the noise is real, snapshot too
    advantages = [r["advantage"] for r in tracin.val_rows]
    assert advantages[0] == 0.0 and advantages[2:] == [0.0] * 6
    assert advantages[1] == pytest.approx(float(scored.advantages[1])) and advantages[1] < -0.1
    assert not tracin.direction_is_zero


@pytest.mark.parametrize("mask", [True, False])
def test_a_truncated_validation_rollout_is_masked_as_in_training(tiny_model_dir, mask):
    """With `mask_truncated_completions` a truncated rollout's row is not a validation row, while its reward stays in
    the group statistics (as the worker trains); without it, it is one."""
    model = lora_model(tiny_model_dir)
    pool = _pool()
    trainer = _trainer(model, mask_truncated_completions=mask)
    tracin = _tracin(trainer, ["p"])
    plans = [("1.0", [_row(*pool[0])]), ("0.0", [_row(*pool[1])]), ("0.5", [_row(*pool[2], truncated=True)])]
    _script(tracin, lambda prompt, k: plans[k])
    tracin.refresh()
    expected = _by_hand([1.0, 0.0, 0.5])
    kept = [0, 1] if mask else [0, 1, 2]
    assert [r["input_ids"].tolist() for r in tracin.val_rows] == [pool[k][0] for k in kept]
    assert [r["advantage"] for r in tracin.val_rows] == pytest.approx([expected[k] for k in kept], abs=1e-5)


def test_no_validation_row_to_train_gives_a_zero_direction(tiny_model_dir):
    """Every validation rollout lost (or unscorable without a token): no row, V exactly 0, so every training row is
    kept unscored (`direction_is_zero`) instead of a crash on an empty batch."""
    model = lora_model(tiny_model_dir)
    trainer = _trainer(model)
    tracin = _tracin(trainer, ["p"])
    pool = _pool()
    _script(tracin, lambda prompt, k: ("1.0", [_row(*pool[k], lost=True)]))
    # The warning gives the cause, no rows (not a missing reward spread), and where to look.
    with pytest.warns(
        UserWarning,
        match=r"exactly 0 at step 0 \(no validation token was left to train: every validation rollout was lost",
    ):
        tracin.refresh()
    assert tracin.val_rows == [] and tracin.direction_is_zero
    assert trainer._metrics["train"]["tracin/val_grad_norm"] == [0.0]


def test_an_example_picks_its_environment_and_an_unknown_one_is_named():
    """A dict `environment_factory` (TRL's multi-environment mode): the example's `environment` field picks the
    factory and is not passed to `reset`; an unknown name fails with the names that exist."""
    from trl_agentic.async_grpo.validation import ValidationRollouts

    class A:
        def reset(self, **kwargs):
            pass

    class B(A):
        pass

    trainer = _trainer(None)
    trainer._environment_factory = {"a": A, "b": B}
    validation = ValidationRollouts(trainer)
    drawn = []

    def trajectory(row, environment_and_kwargs, seed, max_model_len):
        drawn.append(environment_and_kwargs)
        return [{"role": "assistant", "content": "reward: 1"}], [_row([1, 2], [0, 1])], _inputs()

    validation._trajectory = trajectory
    validation.run([{"environment": "b", "prompt": "x", "level": 3}], seed=0)
    assert all(type(environment) is B and kwargs == {"prompt": "x", "level": 3} for environment, kwargs in drawn)
    with pytest.raises(ValueError, match=r"environment='c'.*\['a', 'b'\]"):
        validation.run([{"environment": "c", "prompt": "x"}], seed=0)
    validation.close()


def test_an_error_in_one_trajectory_fails_the_refresh_after_the_others():
    """A trajectory that raises (an environment's `reset`, say) fails the refresh with its error, once the other
    trajectories are done; the event loop is still there to be closed."""
    from trl_agentic.async_grpo.validation import ValidationRollouts

    trainer = _trainer(None)
    validation = ValidationRollouts(trainer)
    finished = []

    def trajectory(row, environment_and_kwargs, seed, max_model_len):
        if len(finished) == 1:
            finished.append("failed")
            raise RuntimeError("reset failed")
        finished.append("ok")
        inputs = {"prompt": "p", "completion_ids": [2, 3], "env_reward": None}
        return [{"role": "assistant", "content": "reward: 1"}], [_row([1, 2, 3], [0, 1, 1])], inputs

    validation._trajectory = trajectory
    validation.max_parallel = 1  # in order: the second trajectory fails
    with pytest.raises(RuntimeError, match="reset failed"):
        validation.run([{"prompt": "p"}], seed=0)
    assert finished == ["ok", "failed", "ok"]
    validation.close()


def test_async_rewards_run_on_one_event_loop_across_refreshes():
    """An async reward function that keeps an object bound to its event loop (an `asyncio.Queue`, a client session)
    works at every refresh: the loop lives as long as the filter, as the worker's does."""
    from trl_agentic.async_grpo.validation import ValidationRollouts

    state = {}

    async def cached_reward(prompts, completions, completion_ids, **kwargs):
        queue = state.setdefault("queue", asyncio.Queue())  # bound to the loop of its first use
        await queue.put(1)
        await queue.get()
        state.setdefault("loops", set()).add(id(asyncio.get_running_loop()))
        return [1.0] * len(completions)

    trainer = _trainer(None)
    trainer._reward_funcs_list = [cached_reward]
    validation = ValidationRollouts(trainer)
    inputs = {"prompt": "p", "completion_ids": [2], "env_reward": None}
    validation._trajectory = lambda *a: ([{"role": "assistant", "content": "x"}], [_row([1, 2], [0, 1])], inputs)
    for _ in range(3):
        rows, rewards = validation.run([{"prompt": "p"}], seed=0)
        assert rewards == [1.0, 1.0, 1.0]
    assert len(state["loops"]) == 1
    validation.close()


# ----------------------------------------------------------------------------------------------------------- reuse


def test_validation_rollouts_are_reused_until_due_and_survive_a_checkpoint(tiny_model_dir, tmp_path):
    """`tracin_val_rollout_steps=2`, a refresh at every step: steps 0 and 2 roll out, step 1 recomputes V on step 0's
    rows and advantages at the step-1 weights (ratio 1 in the same forward), checked against V by hand. A checkpoint
    written after step 0 keeps the stored rows and their step: a run resumed from it computes at step 1, without
    rolling out, the V of the uninterrupted run, bit for bit."""
    model = lora_model(tiny_model_dir)
    pool = _pool()
    trainer = _trainer(model, tracin_val_num_generations=6, tracin_val_rollout_steps=2)
    tracin = _tracin(trainer, ["p"])
    rewards = [0.3, 0.5, 0.3, 0.9, 0.1, 0.3]
    made = _script(tracin, lambda prompt, k: (rewards[k % 6], [_row(*pool[k % 6])]))
    tracin.refresh()
    assert next(made) == 6  # (the probe takes a number: 7 from here on)
    tracin.save(str(tmp_path))
    stored = copy.deepcopy(tracin.val_rows)
    before = _flat(tracin.direction)

    with torch.no_grad():  # the policy moves between the two refreshes
        g = torch.Generator().manual_seed(5)
        for name, w in model.named_parameters():
            if "lora_" in name:
                w.add_(0.05 * torch.randn(w.shape, generator=g, dtype=w.dtype))
    trainer.state.global_step = 1
    tracin.refresh()
    assert next(made) == 7  # no new rollout
    assert [r["input_ids"].tolist() for r in tracin.val_rows] == [r["input_ids"].tolist() for r in stored]
    assert [r["advantage"] for r in tracin.val_rows] == [r["advantage"] for r in stored]
    want = _brute_force_direction(model, stored, trainer.temperature)
    scale = float(want.abs().max())
    # float32 log-probs, as TRL's: V agrees to float32 rounding; step 0's V (the weights before the move) does not.
    torch.testing.assert_close(_flat(tracin.direction), want, rtol=1e-4, atol=1e-5 * scale)
    assert scale > 0 and float((before - want).abs().max()) > 1e-2 * scale

    resumed = _tracin(trainer, ["p"])
    resumed.load(str(tmp_path))
    assert (resumed.rolled_out_at, resumed.refreshes, resumed.refreshed_at) == (0, 1, 0)
    resumed_made = _script(resumed, lambda prompt, k: pytest.fail("the resumed run rolled out"))
    resumed.refresh()
    assert next(resumed_made) == 0
    assert torch.equal(_flat(resumed.direction), _flat(tracin.direction))

    trainer.state.global_step = 2
    tracin.refresh()
    assert next(made) == 14  # 6 new rollouts at step 2
    metrics = trainer._metrics["train"]
    assert len(metrics["perf/tracin_val_rollout_s"]) == len(metrics["tracin/val_reward"]) == 2
    assert len(metrics["perf/tracin_refresh_s"]) == len(metrics["tracin/val_grad_norm"]) == 4  # the resumed one too


def test_a_checkpoint_without_stored_rows_loads_and_rolls_out_next(tiny_model_dir, tmp_path):
    """A checkpoint written before validation rollouts were stored (V, its step and the rollout count only) loads,
    and the next refresh rolls out."""
    from trl_agentic.async_grpo.tracin import STATE_FILE

    torch.save({"direction": None, "refreshed_at": 4, "refreshes": 2}, tmp_path / STATE_FILE)
    trainer = _trainer(lora_model(tiny_model_dir))
    trainer.state.global_step = 5
    tracin = _tracin(trainer, ["p"])
    tracin.load(str(tmp_path))
    assert (tracin.refreshed_at, tracin.refreshes, tracin.val_rows, tracin.rolled_out_at) == (4, 2, None, None)
    rolled = []
    tracin._validation_rollouts = lambda: rolled.append(tracin.refreshes) or ([], [])
    tracin.refresh()
    assert rolled == [2] and tracin.rolled_out_at == 5  # rolled out, prompts drawn from the restored count


# ----------------------------------------------------------------------------------------------------------- live


class _LookupEnv:
    """An environment with an async tool and an async `get_reward` (both awaited in TRL's worker)."""

    calls = 0  # over every instance: the validation rollouts run in threads of their own

    def reset(self, **kwargs):
        self.found = None
        return " (ask the book)"

    async def lookup(self, key: str) -> str:
        """
        Look a key up in the book.

        Args:
            key: The key.
        """
        type(self).calls += 1
        self.found = f"value-of-{key}"
        return self.found

    async def get_reward(self) -> float:
        return 0.5 if self.found else 0.0


class _ScriptedServer:
    """A `/v1/completions` server standing in for vLLM. A first turn (no tool response in the prompt) answers with a
    call to `lookup` for an even seed and a plain answer for an odd one; a later turn answers. Every first-turn
    request waits at a barrier of `first_turns` parties before it is answered, so the refresh only completes when all
    its first turns are in flight at once (one at a time, the first one would wait out the barrier's timeout, a
    guard against a hang, and fail)."""

    def __init__(self, tokenizer, first_turns: int):
        import http.server
        import json
        import threading

        self.payloads: list[dict] = []
        self.barrier = threading.Barrier(first_turns, timeout=60)
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.payloads.append(payload)
                first = "<tool_response>" not in tokenizer.decode(payload["prompt"])
                try:
                    if first:
                        server.barrier.wait()
                except threading.BrokenBarrierError:
                    self.send_response(400)  # not retried: the refresh fails at once
                    self.end_headers()
                    return
                if first and payload["seed"] % 2 == 0:
                    text = call("lookup", key="k")
                else:
                    text = "Done.<|im_end|>"
                ids = tokenizer.encode(text, add_special_tokens=False)[: payload["max_tokens"]]
                body = json.dumps({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_refresh_runs_its_validation_trajectories_together_with_async_tools_and_rewards(
    tiny_model_dir, tiny_tokenizer
):
    """The refresh's 2 x 3 validation trajectories are in flight together (the scripted server's barrier), through
    the real rollout loop, tool rendering and HTTP requests. The async tool runs (its result is in the row as tool
    tokens, not a "not found" error), the async reward function and the environment's async `get_reward` are awaited
    with the prompt the model saw and the model's token ids of the row, every later turn asks the server for what is
    left of the completion budget, and the requests carry the training requests' sampling settings. Checked against
    the rows themselves and the requests the server recorded."""
    from trl.chat_template_utils import add_response_schema

    tokenizer = add_response_schema(copy.deepcopy(tiny_tokenizer))
    budget = 300  # byte-level tokens: a call and its result fit
    server = _ScriptedServer(tokenizer, first_turns=6)
    seen = []

    async def answer_reward(prompts, completions, completion_ids, **kwargs):
        seen.append((prompts, completion_ids))
        return [float(any("value-of-k" in str(m.get("content")) for m in c)) for c in completions]

    model = lora_model(tiny_model_dir)
    trainer = _trainer(
        model,
        tokenizer,
        max_completion_length=budget,
        tracin_val_batch_size=2,
        tracin_val_num_generations=3,
        vllm_server_base_url=server.url,
        request_timeout=120,
        repetition_penalty=1.1,
        min_p=0.05,
    )
    trainer._environment_factory, trainer._reward_funcs_list = _LookupEnv, [answer_reward]
    trainer.temperature = 1.0
    tracin = _tracin(trainer, [[{"role": "user", "content": f"question {i}"}] for i in range(2)])
    _LookupEnv.calls = 0
    try:
        tracin.refresh()
    finally:
        server.close()
        tracin.close()
    rows = tracin.val_rows
    rewards = [r for r in trainer._metrics["train"]["tracin/val_reward"]]

    first = [p for p in server.payloads if "<tool_response>" not in tokenizer.decode(p["prompt"])]
    later = [p for p in server.payloads if p not in first]
    assert len(first) == 6 and len({p["seed"] for p in server.payloads}) == len(server.payloads)
    assert all(p["repetition_penalty"] == 1.1 and p["min_p"] == 0.05 and p["model"] == "policy" for p in first)
    called = sum(p["seed"] % 2 == 0 for p in first)
    assert 0 < called < 6 and len(later) == called == _LookupEnv.calls  # the seeds give both kinds of trajectory
    # Budgets: a first turn may use the whole completion budget, a later turn what the first one left.
    assert {p["max_tokens"] for p in first} == {budget}
    for p in later:
        prompt = max((f["prompt"] for f in first if p["prompt"][: len(f["prompt"])] == f["prompt"]), key=len)
        assert p["max_tokens"] == budget - (len(p["prompt"]) - len(prompt))

    tool_text = tokenizer.decode(tokenizer.encode("value-of-k", add_special_tokens=False))
    prompts, completion_ids = (sum((list(x) for x in column), []) for column in zip(*seen))
    assert len(rows) == len(prompts) == 6
    found = []
    for row, prompt, ids in zip(rows, prompts, completion_ids):
        mask = np.asarray(row["completion_mask"])
        start = int(np.argmax(mask))
        completion = row["input_ids"][start:].tolist()
        assert ids == [t for t, m in zip(completion, mask[start:]) if m]  # the model's tokens only
        assert prompt[-1]["content"].endswith("(ask the book)")  # ... and the prompt with the observation
        tool_tokens = tokenizer.decode([t for t, m in zip(completion, mask[start:]) if m == 0])
        found.append(tool_text in tool_tokens)  # the async tool's result, as tool tokens of the row
    assert sum(found) == called
    # The async reward function (1 with the tool's result) plus the async `get_reward` (0.5 after a lookup).
    assert rewards == [pytest.approx(1.5 * called / 6)]
    group = [1.5 if f else 0.0 for f in found]
    expected = [a for g in (group[:3], group[3:]) for a in (_by_hand(g) if len(set(g)) > 1 else [0.0] * 3)]
    assert [r["advantage"] for r in rows] == pytest.approx(expected, abs=1e-5)
    metrics = trainer._metrics["train"]
    assert len(metrics["perf/tracin_refresh_s"]) == len(metrics["perf/tracin_val_rollout_s"]) == 1
    assert metrics["perf/tracin_refresh_s"][0] >= metrics["perf/tracin_val_rollout_s"][0] > 0


def test_environments_are_built_once_and_reused_across_refreshes():
    """TRL's "construct once, reset often": a refresh draws idle environments before building new ones, so two
    refreshes of 3 trajectories build 3 environments, each reset at every trajectory it runs."""
    import threading

    from trl_agentic.async_grpo.validation import ValidationRollouts

    built = []

    class Counted:
        def __init__(self):
            built.append(self)

        def reset(self, **kwargs):
            pass

    trainer = _trainer(None)
    trainer._environment_factory = Counted
    validation = ValidationRollouts(trainer)
    used = []
    together = threading.Barrier(3, timeout=60)  # a hang guard: the three trajectories of a refresh run at once

    def trajectory(row, environment_and_kwargs, seed, max_model_len):
        used.append(environment_and_kwargs[0])
        together.wait()
        return [{"role": "assistant", "content": "reward: 1"}], [_row([1, 2], [0, 1])], _inputs()

    validation._trajectory = trajectory
    for refresh in range(2):
        validation.run([{"prompt": "p"}], seed=0)
        assert len({id(e) for e in used[3 * refresh :]}) == 3  # no environment shared by running trajectories
    assert len(built) == 3 and {id(e) for e in used} == {id(e) for e in built} and len(used) == 6
    validation.close()


def test_the_template_is_chosen_from_every_environment_and_renders_with_the_template_kwargs(monkeypatch):
    """TRL's worker picks its chat template once, from every tool it can expose: with a dict `environment_factory`
    whose first environment has no tool and the second has one, the training-safe template is chosen (the decision
    seen through `worker_chat_template`), one instance of each environment probed and kept for the trajectories; the
    renderer applies `chat_template_kwargs`."""
    from trl_agentic.async_grpo import validation as module

    class Plain:
        def reset(self, **kwargs):
            pass

    class WithTool(Plain):
        def look(self, key: str) -> str:
            """
            Look.

            Args:
                key: The key.
            """
            return key

    decided = []
    monkeypatch.setattr(module, "worker_chat_template", lambda tok, tools: decided.append(tools) or "TEMPLATE")
    trainer = _trainer(None, chat_template_kwargs={"enable_thinking": False})
    trainer._environment_factory = {"plain": Plain, "tool": WithTool}
    validation = module.ValidationRollouts(trainer)
    renderer = validation._choose_renderer()
    assert decided == [True] and renderer.chat_template == "TEMPLATE"
    assert renderer.template_kwargs == {"enable_thinking": False}
    assert [type(e) for e in validation._pool["plain"] + validation._pool["tool"]] == [Plain, WithTool]


@pytest.mark.parametrize(("statuses", "requests_made", "ok"), [([503, 503, 200], 3, True), ([400], 1, False)])
def test_a_request_is_retried_on_5xx_and_not_on_4xx(monkeypatch, statuses, requests_made, ok):
    """`EstimatorHost._post` (every validation and estimator request): a 5xx answer is retried after waits of 1, 2, ...
    s (TRL's backoff); a 4xx answer fails at once with its HTTP error."""
    import requests

    from trl_agentic.async_grpo import stage

    waits, answers = [], list(statuses)
    monkeypatch.setattr(stage.time, "sleep", waits.append)

    refusal = b'{"error": {"message": "This model\'s maximum context length is 64 tokens."}}'

    def post(url, json, timeout):
        response = requests.Response()
        response.status_code = answers.pop(0)
        response.reason = "Bad Request" if response.status_code == 400 else "OK"
        response._content = (
            refusal
            if response.status_code == 400
            else b'{"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}]}'
        )
        return response

    monkeypatch.setattr(requests, "post", post)
    host = stage.EstimatorHost(_trainer(None))
    if ok:
        assert host._post({"prompt": [1]}) == {"token_ids": [1], "logprobs": {"token_logprobs": [-0.1]}}
    else:
        # What the server answered is in the error (`raise_for_status` says only "400 Client Error: Bad Request").
        with pytest.raises(
            requests.HTTPError,
            match=r"\(400 Bad Request\) for `policy`, a prompt of 3 tokens .*"
            r"`max_tokens=5`: .*maximum context length is 64 tokens",
        ) as error:
            host._post({"model": "policy", "prompt": [1, 2, 3], "max_tokens": 5})
        assert error.value.response.status_code == 400
    assert len(statuses) - len(answers) == requests_made and waits == [1, 2][: requests_made - 1]


# ------------------------------------------------------------------------------------------- prompts that do not fit


def test_a_validation_prompt_the_server_cannot_take_is_named_before_any_rollout(tiny_tokenizer):
    """A refresh draws a sample of the validation prompts, so an over-long one would stop training at whichever refresh
    drew it (vLLM answers 400). Every prompt is checked, rendered with the chat template, at the first refresh, before
    a trajectory runs; the error names the example and both lengths (compared with the rendered length here)."""
    short = [{"role": "user", "content": "2 + 2?"}]
    long = [{"role": "user", "content": "add these: " + " + ".join(str(k) for k in range(40))}]
    texts = [tiny_tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in (short, long)]
    lengths = [len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    max_model_len = (lengths[0] + lengths[1]) // 2
    assert lengths[0] < max_model_len <= lengths[1]
    trainer = _trainer(None, tiny_tokenizer, tracin_val_batch_size=1)
    trainer.vllm_client = SimpleNamespace(get_max_model_len=lambda: max_model_len)
    tracin = _tracin(trainer, [short, short, long])
    tracin._prompts_checked = False
    made = _script(tracin, lambda prompt, k: (0.0, [_row(*_pool(1)[0])]))
    with pytest.raises(
        ValueError,
        match=rf"Validation example 2 of `tracin_eval_dataset` is {lengths[1]} tokens .*"
        rf"`max_model_len` is {max_model_len}",
    ):
        tracin._validation_rollouts()
    assert next(made) == 0  # no trajectory ran

    tracin.dataset = [{"prompt": short}, {"prompt": short}]  # every prompt fits: checked, then the refresh rolls out
    rows, _ = tracin._validation_rollouts()
    assert tracin._prompts_checked and len(rows) == 3


def test_a_trajectory_whose_observation_makes_the_prompt_too_long_fails_before_its_request(tiny_tokenizer):
    """An environment's `reset` observation is appended to the prompt, so the check at the first refresh cannot see
    it: the trajectory checks its own rendered prompt, and fails naming it before any request is sent."""
    from trl_agentic.async_grpo.validation import ValidationRollouts

    class Verbose:
        def reset(self, **kwargs):
            return " and the whole manual: " + "word " * 200

    trainer = _trainer(None, tiny_tokenizer)
    trainer._environment_factory = Verbose
    validation = ValidationRollouts(trainer)
    validation._renderer = validation._choose_renderer()
    sent = []
    validation._host.complete = lambda *a, **k: sent.append(a)
    row = {"prompt": [{"role": "user", "content": "Read the manual."}]}
    validation.check_prompts([row])  # the prompt alone fits the server's 10,000 tokens ... (see `_trainer`)
    with pytest.raises(
        ValueError,
        match=r"its last message begins 'Read the manual\. and the whole manual: word word .*\.\.\.'\) with its "
        r"environment's observation is \d+ tokens .*`max_model_len` is 120",
    ):
        validation._trajectory(row, (Verbose(), {}), seed=0, max_model_len=120)
    assert sent == []
