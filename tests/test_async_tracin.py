"""The asynchronous TracIn filter's scores and selection (`trl_agentic.async_grpo.tracin`), no vLLM needed.

Scores are checked against an independent computation: each row's loss term written out by hand (TRL's async PPO
term over its own forward), its LoRA gradient from `torch.autograd.grad`, and the inner product with V.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from async_tracin_helpers import lora_model


def _samples(n=5, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(n):
        prompt = rng.integers(5, 250, size=4).tolist()
        completion = rng.integers(5, 250, size=3 + k % 3).tolist()
        mask = [0] * 4 + [1] * len(completion)
        if k == 1:
            mask[-2] = 0  # an environment token inside the completion
        samples.append(
            {
                "input_ids": np.asarray(prompt + completion),
                "completion_mask": np.asarray(mask),
                "old_log_probs": np.asarray([0.0] * 4 + (-rng.random(len(completion)) * 6).tolist(), dtype=np.float32),
                "advantage": float(rng.normal()),
                "group_id": k // 2,
            }
        )
    return samples


def _stub(model, **args):
    defaults = dict(
        gradient_accumulation_steps=2,
        tracin_val_refresh_steps=100,
        tracin_selection="positive",
        tracin_top_fraction=0.5,
        tracin_threshold=0.0,
        tracin_min_selected=1,
    )
    defaults.update(args)
    metrics = {"train": __import__("collections").defaultdict(list)}
    return SimpleNamespace(
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, device=torch.device("cpu")),
        model=model,
        temperature=0.7,
        epsilon_low=0.2,
        epsilon_high=0.28,
        args=SimpleNamespace(**defaults),
        state=SimpleNamespace(global_step=3),
        _metrics=metrics,
    )


def _direction(model, seed=1):
    from trl_agentic.tracin.layers import find_lora_layers
    from trl_agentic.tracin.lora_gradient import LoraGradient

    g = torch.Generator().manual_seed(seed)
    return {
        ref.name: LoraGradient(
            A=torch.randn(ref.lora_A.weight.shape, generator=g, dtype=torch.float64),
            B=torch.randn(ref.lora_B.weight.shape, generator=g, dtype=torch.float64),
        )
        for ref in find_lora_layers(model)
    }


def _expected_scores(model, samples, direction, stub):
    """By hand: ell_b = -sum_t min(r A, clip(r) A) / N / GA over row b's own forward; <grad ell_b, V>."""
    from trl_agentic.tracin.layers import find_lora_layers

    refs = find_lora_layers(model)
    n_tokens = sum(int(np.asarray(s["completion_mask"])[1:].sum()) for s in samples)
    scores = []
    for s in samples:
        ids = torch.as_tensor(s["input_ids"])[None]
        logits = model(input_ids=ids).logits[0, :-1] / stub.temperature
        logps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.as_tensor(s["completion_mask"][1:], dtype=torch.float64)
        old = torch.as_tensor(s["old_log_probs"][1:], dtype=torch.float64)
        ratio = torch.exp(logps - old)
        a = s["advantage"]
        term = -torch.min(ratio * a, torch.clamp(ratio, 1 - stub.epsilon_low, 1 + stub.epsilon_high) * a)
        loss = (term * mask).sum() / n_tokens / stub.args.gradient_accumulation_steps
        params = [w for ref in refs for w in (ref.lora_A.weight, ref.lora_B.weight)]
        grads = torch.autograd.grad(loss, params)
        score = 0.0
        for k, ref in enumerate(refs):
            score += (grads[2 * k] * direction[ref.name].A).sum() + (grads[2 * k + 1] * direction[ref.name].B).sum()
        scores.append(float(score))
    return torch.tensor(scores, dtype=torch.float64)


def test_scores_are_row_loss_gradients_dotted_with_v(tiny_model_dir):
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    samples = _samples()
    stub = _stub(model)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction = stub, _direction(model)
    got = tracin.scores(samples).double()
    expected = _expected_scores(model, samples, tracin.direction, stub)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-10)
    assert (expected > 0).any() and (expected < 0).any()  # both signs: the selection below is not trivial


def test_scores_divide_by_the_accumulation_trl_trains_with(tiny_model_dir):
    """TRL divides a micro-batch's loss by `current_gradient_accumulation_steps` (the training loop's count, which the
    last window of an epoch can make smaller than the configured one): the scores are on that gradient's scale."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    samples = _samples()
    stub = _stub(model)  # gradient_accumulation_steps=2 configured
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction = stub, _direction(model)
    configured = tracin.scores(samples).double()
    stub.current_gradient_accumulation_steps = 3
    torch.testing.assert_close(tracin.scores(samples).double(), configured * 2 / 3, rtol=1e-6, atol=1e-12)


def _collate(samples, tracin):
    """The micro-batch as the trainer collates it: TRL's planner row and collator, our packing and the filter's tag."""
    from trl_agentic.async_grpo.compat import trainer_module
    from trl_agentic.async_grpo.stage import token_advantage_collate

    module = trainer_module()
    row = module.TreeRow()
    for s in samples:
        row.add({**s, "metrics": {}})
    collate = token_advantage_collate(module.DataCollatorForRollout(0), before=tracin.stash if tracin else None)
    return collate([[row]])


def _terms(batch):
    """The loss terms TRL's `compute_loss` trains: (target position, old log-prob, advantage) in order, and its
    normaliser."""
    keep = batch["token_index"] >= 0
    terms = list(
        zip(
            batch["token_index"][keep].tolist(),
            batch["old_log_probs"][keep].tolist(),
            batch["advantages"][keep].tolist(),
        )
    )
    return terms, float(batch["global_n_tokens"][0])


@pytest.mark.parametrize("mode", ["positive", "top_fraction"])
def test_the_filter_trains_the_selected_rows_alone(tiny_model_dir, mode):
    """At training time the filter drops the rejected rows' loss terms and TRL's normaliser counts the kept ones: the
    loss terms TRL trains, and what it divides by, are exactly those of the micro-batch packed with the rejected
    rows' masks zeroed (the reference: the selected rows alone), for the rows the hand-computed scores select."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn
    from trl_agentic.tracin.selection import select_rows

    model = lora_model(tiny_model_dir)
    samples = _samples()
    stub = _stub(model, tracin_selection=mode)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.refreshed_at = stub, _direction(model), 3  # V is fresh: no refresh
    tracin._pending, tracin._collated = {}, 0
    expected = _expected_scores(model, samples, tracin.direction, stub)
    keep = select_rows(expected, torch.ones(len(samples), dtype=torch.bool), mode=mode, fraction=0.5, min_selected=1)
    assert 0 < int(keep.sum()) < len(samples)  # a real selection
    masked = [dict(s, completion_mask=s["completion_mask"] * int(k)) for s, k in zip(samples, keep.tolist())]
    reference = _collate(masked, None)
    batch = _collate([dict(s) for s in samples], tracin)
    assert _terms(batch)[1] > _terms(reference)[1]  # collated unfiltered: the filter has not run yet
    assert stub._metrics["train"]["tracin/num_selected"] == []
    trained = tracin.apply(batch)
    assert "tracin_batch" not in trained and tracin._pending == {}
    assert _terms(trained) == _terms(reference)
    assert torch.equal(trained["input_ids"], reference["input_ids"])  # the same forward: rejected rows as context
    assert stub._metrics["train"]["tracin/num_selected"] == [(float(keep.sum()), 1.0)]  # rows, one step
    assert tracin.last["selected"].tolist() == keep.tolist()


def test_a_micro_batch_with_no_row_selected_is_not_trained(tiny_model_dir):
    """`tracin_min_selected=0` and no positive score: no row is trained (as the synchronous trainer would train none):
    `apply` says there is nothing to train (the trainer then skips the micro-batch), or, where the step cannot be
    skipped (DeepSpeed), gives every term advantage 0. The stash of a micro-batch collated but never trained (an
    earlier `train()`'s prefetch) is dropped."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    stub = _stub(model, tracin_selection="positive", tracin_min_selected=0)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.refreshed_at = stub, _direction(model), 3
    tracin._pending, tracin._collated = {}, 0
    tracin.scores = lambda samples: -torch.arange(1.0, len(samples) + 1)
    _collate(_samples(seed=1), tracin)  # never trained
    assert tracin.apply(_collate(_samples(), tracin)) is None
    assert tracin._pending == {} and tracin.last["selected"].tolist() == [False] * 5
    batch = _collate(_samples(), tracin)
    before = _terms(batch)
    terms = _terms(tracin.apply(batch, can_skip=False))
    assert [t[:2] for t in terms[0]] == [t[:2] for t in before[0]] and all(t[2] == 0.0 for t in terms[0])
    # With the default `tracin_min_selected=1` the best row is kept instead.
    stub.args.tracin_min_selected = 1
    tracin.apply(_collate(_samples(), tracin))
    assert tracin.last["selected"].tolist() == [True, False, False, False, False]


def test_a_zero_validation_direction_keeps_every_row_unscored(tiny_model_dir):
    """V = 0 (no validation group had a reward spread, as in a live run on the log search where every validation
    reward was 0): every score would be 0, which says nothing about a row. Every row with a trained token is kept and
    its mask untouched, none is scored, as in the synchronous trainer (`direction_is_zero`); not the fallback's
    lowest-index row alone, which TRL's loss would then weight as the whole micro-batch."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn
    from trl_agentic.tracin.lora_gradient import LoraGradient

    model = lora_model(tiny_model_dir)
    samples = _samples()
    samples[3]["completion_mask"] = np.zeros_like(samples[3]["completion_mask"])  # no trained token: not a row to keep
    stub = _stub(model, tracin_selection="positive", tracin_min_selected=1)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    zero = {
        name: LoraGradient(A=torch.zeros_like(g.A), B=torch.zeros_like(g.B)) for name, g in _direction(model).items()
    }
    tracin.trainer, tracin.direction, tracin.refreshed_at = stub, zero, 3
    assert tracin.direction_is_zero
    tracin.scores = lambda samples: pytest.fail("scored against a zero direction")
    tracin.select(samples)
    metrics = stub._metrics["train"]
    assert metrics["tracin/num_selected"] == [(4.0, 1.0)] and metrics["tracin/selected_ratio"] == [(4.0, 4.0)]
    assert tracin.last["selected"].tolist() == [True, True, True, False, True]
    # One non-zero entry anywhere and the rows are scored and selected again.
    name = next(iter(zero))
    zero[name] = LoraGradient(A=zero[name].A.clone().index_fill_(1, torch.tensor([0]), 1.0), B=zero[name].B)
    assert not tracin.direction_is_zero
    scored = []
    tracin.scores = lambda samples: scored.append(len(samples)) or torch.tensor([-1.0, 2.0, 3.0, 4.0, -5.0])
    tracin.select(samples)
    assert scored == [5] and tracin.last["selected"].tolist() == [False, True, True, False, False]  # row 3: no token


# ----------------------------------------------------------------------------------------------- gradient checkpointing


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_scores_and_v_under_gradient_checkpointing(tiny_model_dir, reentrant):
    """Gradient checkpointing is on by default in TRL's asynchronous config. Non-reentrant, the scoring forward and
    V's run checkpointed (each decoder layer runs twice: the backward's recompute) and the hooks take a region's
    inputs from the recompute; reentrant (its first forward without autograd), the two passes run without it (each
    layer once) and checkpointing is back on afterwards. Either way the scores equal the uncheckpointed by-hand ones
    and V equals the uncheckpointed V."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    model.train()
    samples = _samples()
    stub = _stub(model)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction = stub, _direction(model)
    tracin.val_rows = [dict(s, advantage=float(k) - 1.5) for k, s in enumerate(samples)]
    expected = _expected_scores(model, samples, tracin.direction, stub)
    plain_v = tracin._validation_direction(model)

    kwargs = {"use_reentrant": reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    stub.args.gradient_checkpointing, stub.args.gradient_checkpointing_kwargs = True, kwargs
    tracin.disable_checkpointing = reentrant  # as `__init__` decides (`reentrant_checkpointing`, tested below)
    layer = model.base_model.model.model.layers[0]
    calls = []
    probe = layer.register_forward_pre_hook(lambda *args: calls.append(1))  # (a recompute may stop early)
    got = tracin.scores(samples).double()
    scored_calls = len(calls)
    v = tracin._validation_direction(model)
    probe.remove()
    assert (scored_calls, len(calls)) == ((1, 2) if reentrant else (2, 4))
    assert model.is_gradient_checkpointing  # restored after the reentrant case's passes
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-10)
    for name, g in plain_v.items():
        torch.testing.assert_close(v[name].A, g.A, rtol=1e-9, atol=1e-14)
        torch.testing.assert_close(v[name].B, g.B, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs, reentrant",
    [
        (None, False),
        ({}, False),
        ({"use_reentrant": False}, False),
        ({"use_reentrant": True}, True),
        ({"every_n_layers": 2}, False),
        ({"preserve_rng_state": True}, True),
        ({"use_reentrant": None}, True),
    ],
)
def test_reentrant_checkpointing_is_decided_as_transformers_enables_it(tiny_model_dir, kwargs, reentrant):
    """`reentrant_checkpointing(args)` against what the model does once `transformers.Trainer` has enabled
    checkpointing from those args (its own keys taken out, `None` when nothing is left): a recorded forward raises the
    hooks' no-autograd error exactly when checkpointing is reentrant."""
    import warnings

    from trl_agentic.tracin.hooks import LoraGhostHooks, reentrant_checkpointing

    args = SimpleNamespace(gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    assert reentrant_checkpointing(args) is reentrant
    off = SimpleNamespace(gradient_checkpointing=False, gradient_checkpointing_kwargs=kwargs)
    assert reentrant_checkpointing(off) is False

    model = lora_model(tiny_model_dir)
    model.train()
    given = dict(kwargs or {})
    every = given.pop("every_n_layers", 1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=given or None, every_n_layers=every)
    ids = torch.as_tensor(_samples()[0]["input_ids"])[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "pass use_reentrant explicitly"
        with LoraGhostHooks(model) as hooks:
            try:
                with hooks.record():
                    model(input_ids=ids).logits.sum()
                raised = False
            except RuntimeError as error:
                assert "autograd disabled" in str(error)
                raised = True
    assert raised is reentrant


@pytest.mark.parametrize("kwargs, warns", [(None, False), ({"use_reentrant": True}, True)])
def test_the_filter_says_at_start_up_when_its_passes_run_without_checkpointing(tiny_tokenizer, kwargs, warns):
    """The filter built with TRL's default checkpointing (non-reentrant) keeps it in its passes, silently; with
    reentrant checkpointing it turns it off there and says so once, at start-up."""
    import warnings

    from test_async_tracin_validation import _trainer

    from trl_agentic.async_grpo.tracin import AsyncTracIn

    trainer = _trainer(None, tiny_tokenizer, gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    trainer.accelerator.num_processes = 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracin = AsyncTracIn(trainer, [{"prompt": "p"}])
    said = [str(w.message) for w in caught if "reentrant gradient checkpointing" in str(w.message)]
    assert tracin.disable_checkpointing is warns and len(said) == int(warns)


def test_pausing_reentrant_checkpointing_keeps_what_the_trainer_enabled(tiny_model_dir):
    """Reentrant checkpointing on every second layer (`every_n_layers=2`, a transformers key the Trainer takes out of
    `gradient_checkpointing_kwargs`): after the filter's passes every layer's flag is what it was and no input hook was
    added, and training's next forward and backward run (TRL's `disable_gradient_checkpointing` re-enabled every
    layer with `every_n_layers` handed to torch, which rejects it, and added an embedding hook per call)."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    model.train()
    samples = _samples()
    direction = _direction(model)
    expected = _expected_scores(model, samples, direction, _stub(model))  # by hand, before checkpointing is on
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True}, every_n_layers=2)
    layers = model.base_model.model.model.layers
    flags = [layer.gradient_checkpointing for layer in layers]
    assert True in flags and False in flags
    embed = model.get_input_embeddings()
    hooks_before = len(embed._forward_hooks)
    stub = _stub(model, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True})
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.disable_checkpointing = stub, direction, True
    tracin.val_rows = [dict(s, advantage=1.0) for s in samples]
    torch.testing.assert_close(tracin.scores(samples).double(), expected, rtol=1e-6, atol=1e-10)
    tracin._validation_direction(model)
    assert [layer.gradient_checkpointing for layer in layers] == flags
    assert len(embed._forward_hooks) == hooks_before
    ids = torch.as_tensor(samples[0]["input_ids"])[None]
    model(input_ids=ids).logits.sum().backward()  # training's next step, checkpointed as before


def test_the_filter_runs_in_training_mode_from_step_0(tiny_model_dir):
    """TRL reads step 0's rows before `Trainer` puts the model in training mode: the filter puts it there first, so
    its passes run as training runs, checkpointed (non-reentrant: each layer twice in the scoring pass)."""
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    model = lora_model(tiny_model_dir)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.eval()
    stub = _stub(model)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.refreshed_at = stub, _direction(model), 3
    calls = []
    probe = model.base_model.model.model.layers[0].register_forward_pre_hook(lambda *args: calls.append(1))
    tracin.select(_samples(n=2))
    probe.remove()
    assert model.training and len(calls) == 2


def test_the_filters_rates_are_reduced_over_the_logging_window(tiny_model_dir):
    """`tracin/selected_ratio` is selected rows over valid rows in the window, not a mean of micro-batch ratios (with
    the token budget micro-batches hold different numbers of rows): one of one row kept, then none of seven, is 1/8,
    not 0.5; `tracin/num_selected` is selected rows per optimizer step (1 in the step, not 0.5 a micro-batch). Reduced
    with TRL's own `_reduce_metric`."""
    import sys

    from trl_agentic.async_grpo.compat import trainer_module
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    reduce_metric = sys.modules[trainer_module().__name__]._reduce_metric
    model = lora_model(tiny_model_dir)
    stub = _stub(model, tracin_selection="positive", tracin_min_selected=0)
    tracin = AsyncTracIn.__new__(AsyncTracIn)
    tracin.trainer, tracin.direction, tracin.refreshed_at = stub, _direction(model), 3
    rows = _samples()
    tracin.scores = lambda samples: torch.ones(len(samples))
    tracin.select(rows[:1])
    tracin.scores = lambda samples: -torch.ones(len(samples))
    tracin.select((rows * 2)[:7])
    metrics = stub._metrics["train"]
    assert reduce_metric("tracin/selected_ratio", metrics["tracin/selected_ratio"]) == 1 / 8
    assert reduce_metric("tracin/score_pos_frac", metrics["tracin/score_pos_frac"]) == 1 / 8
    assert reduce_metric("tracin/score_mean", metrics["tracin/score_mean"]) == (1 - 7) / 8
    assert reduce_metric("tracin/num_selected", metrics["tracin/num_selected"]) == 1.0
    stub.state.global_step += 1  # the next step's micro-batch counts a second step
    tracin.scores = lambda samples: torch.ones(len(samples))
    tracin.select(rows[:3])
    assert reduce_metric("tracin/num_selected", metrics["tracin/num_selected"]) == (1 + 3) / 2


def test_keeping_every_row_with_lora_dropout_trains_as_without_the_filter(tiny_model_dir, tmp_path, monkeypatch):
    """With LoRA dropout the filter's passes (V's, the scoring forward) drew their masks from the global RNG, so every
    later training forward drew other masks: a run whose filter keeps every row trained other weights than the same
    run without the filter (max difference 0.039 here). The passes run on a forked RNG now: the same weights, bit for
    bit. The filter runs for real (a fixed V, real scores, `select_rows`); scores are made positive to keep all."""
    from datasets import Dataset
    from test_async_equivalence import _samples as agentic_samples
    from test_async_equivalence import _train

    from trl_agentic.async_grpo import AsyncAgenticGRPOConfig, AsyncAgenticGRPOTrainer
    from trl_agentic.async_grpo.tracin import AsyncTracIn

    real_scores, calls = AsyncTracIn.scores, []

    def scores(self, samples):
        calls.append(len(samples))
        return real_scores(self, samples).abs() + 1.0

    def refresh(self):
        self.direction = _direction(self._model())
        self.refreshed_at = self.trainer.state.global_step

    monkeypatch.setattr(AsyncTracIn, "scores", scores)
    monkeypatch.setattr(AsyncTracIn, "refresh", refresh)
    validation = Dataset.from_list([{"prompt": [{"role": "user", "content": "v"}]}] * 2)

    def run(out):
        return _train(
            AsyncAgenticGRPOTrainer, AsyncAgenticGRPOConfig, tiny_model_dir, tmp_path / out,
            {"tracin_eval_dataset": validation}, agentic_samples(agentic=True), lora_dropout=0.1, tracin_enabled=True,
        )  # fmt: skip

    _, filtered_losses, filtered, _ = run("filtered")
    assert calls  # the scoring pass ran
    monkeypatch.setattr(AsyncTracIn, "select", lambda self, samples: torch.ones(len(samples), dtype=torch.bool))
    _, plain_losses, plain, _ = run("plain")
    assert filtered_losses == plain_losses
    assert all(torch.equal(filtered[name], plain[name]) for name in plain)
