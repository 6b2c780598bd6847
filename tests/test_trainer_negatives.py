"""End to end on the tiny model: scripted tool failures → rollbacks → negative rows in the batch → training."""

import json
from collections import Counter

import pytest
import torch
from datasets import Dataset

from trl_agentic import AgenticGRPOConfig, AgenticGRPOTrainer
from trl_agentic.rollout.types import RowKind


class CounterEnv:
    def reset(self, **kwargs):
        self.total = 0

    def add(self, n: int) -> str:
        """
        Add a number to the total.

        Args:
            n: The number to add.
        """
        if not isinstance(n, int):
            raise TypeError(f"n must be an integer, got {type(n).__name__}")
        self.total += n
        return str(self.total)


def total_reward(environments, **kwargs):
    return [float(env.total) for env in environments]


def _call(n):
    return f"<tool_call>\n{json.dumps({'name': 'add', 'arguments': {'n': n}})}\n</tool_call><|im_end|>"


class ScriptedGeneration:
    """Stands in for `_generate_single_turn`: the k-th time a context is seen decides the answer, so rollouts of one
    group differ (some fail) and regenerations (which re-send the same context) get a fresh answer."""

    FIRST = [_call("x"), _call(1), _call(2), "No tool needed.<|im_end|>"]

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen = Counter()
        self.batch_sizes = []

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.batch_sizes.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            k = self.seen[key]
            self.seen[key] += 1
            text = self.tok.decode(ids)
            if "<tool_response>" in text:
                out.append("Done.<|im_end|>")
            else:
                out.append(self.FIRST[k] if k < len(self.FIRST) else _call(3))
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def test_negative_rows_reach_the_batch_and_are_trained_on(tiny_model_dir, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Add something."}]] * 8})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=2,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=512,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        max_negative_samples_per_group=2,
        max_tool_retries=2,
        negative_sample_reward=-1.0,
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=total_reward,
        args=args,
        train_dataset=dataset,
        environment_factory=CounterEnv,
    )
    generation = ScriptedGeneration(tiny_tokenizer)
    trainer._generate_single_turn = generation
    batches = []
    original = trainer._augmenter.__call__

    def capture(*a, **k):
        batch = original(*a, **k)
        batches.append(batch)
        return batch

    trainer._augmenter = capture
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()

    batch = batches[0]
    kinds = batch["row_kind"]
    negative = kinds == RowKind.NEGATIVE
    # One group of 4: one rollout failed once (TypeError) → one negative row, parent's group, reward -1.
    assert negative.sum().item() == 1
    assert (batch["group_id"][negative] == batch["group_id"][kinds == RowKind.REGULAR][0]).all()
    assert batch["advantages"][negative].item() < 0
    # The negative row's trainable tokens are exactly the failed call (tool result masked out).
    neg_ids = batch["completion_ids"][negative][0]
    neg_mask = (batch["completion_mask"] * batch["tool_mask"])[negative][0].bool()
    assert tiny_tokenizer.decode(neg_ids[neg_mask]) == _call("x")
    # Regeneration shared one batched call with the continuations of the other rollouts.
    assert generation.batch_sizes[:3] == [4, 3, 1]
    # The rows were padded to a multiple of steps_per_generation and the loss normaliser counts every real token.
    assert batch["prompt_ids"].size(0) % args.steps_per_generation == 0
    assert batch["num_items_in_batch"].item() == (batch["completion_mask"] * batch["tool_mask"]).sum().item()
    metrics = [h for h in trainer.state.log_history if "negatives/rows" in h]
    assert metrics and metrics[0]["negatives/rows"] == 1.0 and metrics[0]["rollback/attempts"] == 1.0
    moved = [k for k, v in trainer.model.named_parameters() if not torch.equal(before[k], v)]
    assert moved
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses)))


class SecondTurnFailure:
    """Every rollout: a good first call, then at the second turn a bad call for the first rollout only (rolled back
    and regenerated), then an answer."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.seen = Counter()

    def __call__(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for ids in prompt_ids:
            key = tuple(ids)
            k = self.seen[key]
            self.seen[key] += 1
            rounds = self.tok.decode(ids).count("<tool_response>")
            if rounds == 0:
                out.append(f"[{k}] " + _call(k + 1))
            elif rounds == 1:
                out.append(_call("x") if (k == 0 and "[0]" in self.tok.decode(ids)) else _call(5))
            else:
                out.append("Done.<|im_end|>")
        return [self.tok.encode(s, add_special_tokens=False) for s in out], None


def _negative_trainer(tiny_model_dir, tiny_tokenizer, tmp_path, reward_funcs=total_reward, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        seed=0,
        max_steps=1,
        learning_rate=5e-2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=512,
        logging_steps=1,
        save_strategy="no",
        enable_tool_rollback=True,
        save_negative_samples=True,
        negative_sample_reward=-1.0,
        group_baseline="episodes",
        log_completions=False,
    )
    values.update(overrides)
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_funcs,
        args=AgenticGRPOConfig(**values),
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "Add something."}]] * 8}),
        environment_factory=CounterEnv,
    )
    trainer._generate_single_turn = SecondTurnFailure(tiny_tokenizer)
    return trainer


def test_a_negative_row_pushes_down_only_its_failed_turn(tiny_model_dir, tiny_tokenizer, tmp_path, caplog):
    """The failure happens at the second turn. The good first turn is the negative row's prompt: the gradient of the
    loss w.r.t. the negative row's per-token log-probs is zero everywhere but on the failed call, and the first turn's
    tokens get the gradient they get without the negative row (their regular row's, unchanged with
    `group_baseline="episodes"`, up to the loss normaliser: `dr_grpo` divides by the number of rows)."""
    trainer = _negative_trainer(tiny_model_dir, tiny_tokenizer, tmp_path, loss_type="dr_grpo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows = [dict(r) for r in trainer.train_dataset.select(range(4))]
    with caplog.at_level("WARNING", logger="trl_agentic.batch"):
        batch = trainer._generate_and_score_completions(rows)
    assert not [r for r in caplog.records if "is not below the rewards" in r.getMessage()]  # a real penalty here
    kinds = batch["row_kind"]
    (neg,) = torch.nonzero(kinds == RowKind.NEGATIVE).flatten().tolist()
    parent = 0  # the rollout that failed (variant [0])
    decode = tiny_tokenizer.decode
    loss_mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert decode(batch["completion_ids"][neg][loss_mask[neg]]) == _call("x")
    neg_prompt = decode(batch["prompt_ids"][neg][batch["prompt_mask"][neg].bool()])
    first_turn = "[0] " + _call(1)
    assert (
        neg_prompt.endswith("<|im_start|>assistant\n") and first_turn in neg_prompt and "<tool_response>" in neg_prompt
    )
    assert first_turn in decode(batch["completion_ids"][parent][loss_mask[parent]])

    def logp_gradients(inputs):
        """d loss / d per-token log-probs, through TRL's loss (the model's log-probs made a leaf)."""
        captured = {}
        original = trainer._get_per_token_logps_and_entropies

        def leaf(*args, **kwargs):
            logps, entropies, aux = original(*args, **kwargs)
            captured["logps"] = logps.detach().requires_grad_(True)
            return captured["logps"], entropies, aux

        trainer._get_per_token_logps_and_entropies = leaf
        try:
            loss = trainer._compute_loss(trainer.model, inputs)
        finally:
            del trainer._get_per_token_logps_and_entropies
        (grad,) = torch.autograd.grad(loss, captured["logps"])
        return grad

    grad = logp_gradients(batch)
    assert grad[neg][~loss_mask[neg]].abs().max() == 0
    assert grad[neg][loss_mask[neg]].abs().min() > 0  # pushed down (its advantage is negative)
    assert batch["advantages"][neg] < 0
    # The same batch without the negative row: the regular rows' gradients, the first turn's included, are unchanged.
    keep = torch.tensor([k for k in range(kinds.numel()) if k != neg])
    without = {k: v[keep] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}
    without["num_rows_in_batch"] = batch["num_rows_in_batch"] - 1
    grad_without = logp_gradients(without)
    regular = (kinds[keep] == RowKind.REGULAR).nonzero().flatten()
    width = grad_without.size(1)
    rows_with, rows_without = int(batch["num_rows_in_batch"]), int(without["num_rows_in_batch"])
    assert grad_without[regular].abs().max() > 0
    scale = grad_without[regular].abs().max().item() * rows_without
    torch.testing.assert_close(
        grad[keep][regular][:, :width] * rows_with, grad_without[regular] * rows_without, rtol=1e-6, atol=1e-6 * scale
    )


def test_logged_completions_show_what_is_trained(tiny_model_dir, tiny_tokenizer, tmp_path):
    """TRL logs the advantages it computed before our augmentation; the completion table must show the trained ones,
    plus the extra rows (here the negative), with their kind."""
    trainer = _negative_trainer(tiny_model_dir, tiny_tokenizer, tmp_path, group_baseline="all_rows")
    trainer.model.train()
    rows = [dict(r) for r in trainer.train_dataset.select(range(4))]
    batch = trainer._generate_and_score_completions(rows)
    logs = trainer._logs
    kinds = batch["row_kind"]
    trained = [
        batch["advantages"][k].item()
        for k in range(kinds.numel())
        if int(kinds[k]) in (RowKind.REGULAR, RowKind.NEGATIVE)
    ]
    assert list(logs["advantages"]) == trained  # regular rows first, then the negative (its advantage is in them)
    assert list(logs["extra"]["row_kind"]) == ["regular"] * 4 + ["negative"]
    negative_completion = logs["completion"][-1]
    assert negative_completion[0]["tool_calls"][0]["function"]["arguments"] == {"n": "x"}
    assert negative_completion[-1]["role"] == "tool" and "integer" in negative_completion[-1]["content"]
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["rewards"]["total_reward"]) == 5
    # With the negative in the baseline ("all_rows"), TRL's pre-augmentation advantages were different.
    assert any(a != b for a, b in zip(trained[:4], [0.0] * 4))
    # A later batch without extra rows shows its own rows only: the columns grown for the negative kept it in front of
    # them, and `row_kind` kept the first batch's labels.
    trainer.args.save_negative_samples = False
    trainer._generate_and_score_completions(rows)
    assert list(logs["extra"]["row_kind"]) == ["regular"] * 4
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == 4
    assert len(logs["rewards"]["total_reward"]) == 4
    assert not any(
        m.get("role") == "tool" and "integer" in str(m.get("content")) for c in logs["completion"] for m in c
    )


def test_every_process_saves_and_restores_its_own_rng(tiny_model_dir, tiny_tokenizer, tmp_path):
    from unittest.mock import PropertyMock, patch

    trainer = _negative_trainer(tiny_model_dir, tiny_tokenizer, tmp_path / "t")
    folder = tmp_path / "checkpoint-1"
    states = {}
    cls = type(trainer.accelerator)
    for rank in (0, 1):
        trainer._rng.seed(100 + rank)
        states[rank] = trainer._rng.getstate()
        with (
            patch.object(cls, "process_index", new_callable=PropertyMock, return_value=rank),
            patch.object(cls, "num_processes", new_callable=PropertyMock, return_value=2),
        ):
            trainer._save_own_state(str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["trl_agentic_state_0.json", "trl_agentic_state_1.json"]
    for rank in (1, 0):
        trainer._rng.seed(7)
        with (
            patch.object(cls, "process_index", new_callable=PropertyMock, return_value=rank),
            patch.object(cls, "num_processes", new_callable=PropertyMock, return_value=2),
        ):
            trainer._load_own_state(str(folder))
        assert trainer._rng.getstate() == states[rank]
    # A checkpoint without this process's file (another world size) is reported, not silently shared.
    with (
        patch.object(cls, "process_index", new_callable=PropertyMock, return_value=2),
        patch.object(cls, "num_processes", new_callable=PropertyMock, return_value=3),
    ):
        import pytest

        with pytest.warns(UserWarning, match="trl_agentic_state_2.json"):
            trainer._load_own_state(str(folder))


def test_an_extra_row_with_a_none_sampling_logprob_batches(tiny_model_dir, tiny_tokenizer, tmp_path):
    """vLLM returns None for a NaN log-prob; TRL maps it to NaN for regular rows, and so must extra rows."""
    from trl_agentic.batch import _stack

    rows = [[-0.1, None, -0.3], [-0.5]]
    out = _stack(
        [[float("nan") if lp is None else lp for lp in r] for r in rows], 4, 0.0, "right", torch.float32, "cpu"
    )
    assert out.shape == (2, 4) and torch.isnan(out[0, 1]) and out[0, 0] == -0.1 and out[1, 1] == 0.0


def below_the_negative_reward(environments, **kwargs):
    """A custom reward whose every regular row scores below the negative sample reward (-1)."""
    return [-10.0 - env.total for env in environments]


@pytest.mark.parametrize("baseline", ["episodes", "all_rows"])
def test_a_negative_row_is_never_pushed_up(tiny_model_dir, tiny_tokenizer, tmp_path, baseline, caplog):
    """Scored against a group whose rewards are all below its own, a negative row's advantage would be positive:
    it is clamped to 0, and the regular rows keep theirs (the group statistics of the estimator). The user is warned
    (once) that such a reward is no penalty."""
    from trl_agentic.advantages import group_advantages

    trainer = _negative_trainer(
        tiny_model_dir, tiny_tokenizer, tmp_path, reward_funcs=below_the_negative_reward, group_baseline=baseline
    )
    trainer.model.train()
    with caplog.at_level("WARNING", logger="trl_agentic.batch"):
        batch = trainer._generate_and_score_completions([dict(r) for r in trainer.train_dataset.select(range(4))])
    warnings = [r.getMessage() for r in caplog.records if "is not below the rewards" in r.getMessage()]
    assert len(warnings) == 1 and "(-1)" in warnings[0] and "lowest -19" in warnings[0]
    kinds = batch["row_kind"]
    (neg,) = torch.nonzero(kinds == RowKind.NEGATIVE).flatten().tolist()
    assert batch["advantages"][neg] == 0
    # Without the clamp it would have been positive: the same statistics, computed independently.
    regular = (kinds == RowKind.REGULAR).nonzero().flatten()
    totals = [env.total for env in trainer.environments]
    assert totals == [6, 7, 8, 9]  # 1..4 at the first turn, then 5 each (the failed call rolled back)
    rewards = torch.tensor([-10.0 - t for t in totals] + [-1.0])
    in_baseline = torch.tensor([True] * 4 + [baseline == "all_rows"])
    expected = group_advantages(rewards, torch.zeros(5, dtype=torch.long), baseline_mask=in_baseline)
    assert expected[4] > 0
    torch.testing.assert_close(batch["advantages"][regular], expected[:4])


def test_the_negative_rows_mean_advantage_is_over_their_trained_tokens(tiny_model_dir, tmp_path):
    """With token-level advantages (an estimator's, or rows widened for longer extra rows) a row's advantage in the
    metrics is the mean over its trained tokens, as in the completion logs, not over the padded width (-0.5 here)."""
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Add something."}]] * 4})
    args = AgenticGRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=64,
        enable_tool_rollback=True,
        save_strategy="no",
    )
    trainer = AgenticGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=total_reward,
        environment_factory=CounterEnv,
        train_dataset=dataset,
        args=args,
    )
    batch = {
        "row_kind": torch.tensor([RowKind.REGULAR, RowKind.NEGATIVE]),
        "advantages": torch.tensor([[0.5] * 6, [-1.5, -1.5, 0, 0, 0, 0]]),
        "completion_mask": torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0]]),
        "tool_mask": torch.ones(2, 6, dtype=torch.long),
    }
    trainer._augmenter._log_metrics("train", batch, None, torch.tensor([0, 0]), torch.tensor([0, 1]))
    assert trainer._metrics["train"]["negatives/mean_advantage"][-1] == pytest.approx(-1.5)


def test_completion_logs_keep_trls_rows_and_drop_only_the_last_batchs_extra_rows():
    """Several evaluation batches smaller than a generation batch stay in TRL's completion logs (a rebuild to the
    last batch dropped the earlier ones); a batch's extra rows go at the next batch, with their `row_kind` labels."""
    from collections import defaultdict, deque
    from types import SimpleNamespace

    from trl_agentic.batch import BatchAugmenter
    from trl_agentic.rollout.types import ExtraRow

    size = 8
    logs = {
        "prompt": deque(maxlen=size),
        "completion": deque(maxlen=size),
        "advantages": deque(maxlen=size),
        "rewards": defaultdict(lambda: deque(maxlen=size)),
        "extra": defaultdict(lambda: deque(maxlen=size)),
    }
    trainer = SimpleNamespace(
        _logs=logs, args=SimpleNamespace(generation_batch_size=size), accelerator=SimpleNamespace(num_processes=1)
    )
    augmenter = BatchAugmenter.__new__(BatchAugmenter)
    augmenter.trainer, augmenter._logged_extra_rows = trainer, 0

    def batch(name: str, n: int, negatives: int = 0):
        rows = [f"{name}-{k}" for k in range(n)]
        logs["prompt"].extend(rows)  # what TRL logs for the batch, before our augmentation
        logs["completion"].extend(rows)
        logs["advantages"].extend([0.0] * n)
        logs["rewards"]["r"].extend([1.0] * n)
        extras = [
            ExtraRow(
                kind=RowKind.NEGATIVE,
                parent=0,
                prompt_ids=[],
                completion_ids=[],
                tool_mask=[],
                logprobs=None,
                prompt_messages=f"{name}-neg{k}",
                messages=f"{name}-neg{k}",
            )  # fmt: skip
            for k in range(negatives)
        ]
        advantages = torch.zeros(n + negatives)
        augmenter._log_trained_rows({"advantages": advantages}, n, extras, None, rows)

    batch("train", 8, negatives=2)
    assert list(logs["prompt"]) == [f"train-{k}" for k in range(8)] + ["train-neg0", "train-neg1"]
    assert list(logs["extra"]["row_kind"]) == ["regular"] * 8 + ["negative"] * 2
    batch("eval0", 4)
    batch("eval1", 4)
    assert list(logs["prompt"]) == [f"eval0-{k}" for k in range(4)] + [f"eval1-{k}" for k in range(4)]
    assert list(logs["extra"]["row_kind"]) == ["regular"] * 8
    assert len(logs["completion"]) == len(logs["advantages"]) == len(logs["rewards"]["r"]) == 8
