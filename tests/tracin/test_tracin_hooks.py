"""LoraGhostHooks: gating, gradient checkpointing, streaming micro-batches, selected-row gradients, all-reduce."""

import pytest
import torch

from trl_agentic.tracin import (
    LoraGhostHooks,
    LoraGradient,
    all_reduce_,
    lora_gradient_dot,
    lora_influence_scores,
    lora_parameters,
    select_rows,
)


def _grpo_losses(kit, batch, **kwargs):
    return lambda model: kit.per_sample_policy_losses(kit.completion_logps(model, batch), batch, "grpo", **kwargs)


def _closures(kit):
    return kit.seeded(11, _grpo_losses(kit, kit.train_batch())), kit.seeded(12, kit.grpo_val_loss)


def _as_gradients(model, flat_grads):
    """Per-layer LoraGradient dict from autograd.grad results ordered like lora_param_list."""
    names = [name for name, _, _ in lora_parameters(model)]
    return {name: LoraGradient(flat_grads[2 * i], flat_grads[2 * i + 1]) for i, name in enumerate(names)}


# ------------------------------------------------------------------------------------------------------ gating


def test_nothing_captured_when_not_recording_or_adapter_disabled(kit):
    model = kit.make_lora_model()
    batch = kit.train_batch()
    with LoraGhostHooks(model) as hooks:
        assert len(hooks.layers) == 14 and not hooks.recording
        kit.completion_logps(model, batch)  # recording off (old log-prob pass with grad)
        with torch.no_grad():
            kit.completion_logps(model, batch)  # recording off (no-grad pass)
        assert hooks.num_pending == 0

        with hooks.record(), model.disable_adapter():  # reference-model pass: LoRA modules are bypassed
            kit.completion_logps(model, batch)
        assert hooks.num_pending == 0 and not hooks.recording

        with hooks.record():
            kit.completion_logps(model, batch)
        assert hooks.num_pending == 14


def test_hooks_are_removed_on_exit(kit):
    model = kit.make_lora_model()
    module = model.base_model.model.model.layers[0].self_attn.q_proj
    before = (len(module.lora_A["default"]._forward_hooks), len(module.lora_B["default"]._backward_hooks))
    with LoraGhostHooks(model):
        assert len(module.lora_A["default"]._forward_hooks) == before[0] + 1
    assert (len(module.lora_A["default"]._forward_hooks), len(module.lora_B["default"]._backward_hooks)) == before


def test_recorded_forward_must_go_through_the_hooks(kit):
    model = kit.make_lora_model()
    batch = kit.train_batch()
    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            loss = _grpo_losses(kit, batch)(model).sum()
        with pytest.raises(RuntimeError, match="outside LoraGhostHooks"):
            loss.backward()
        hooks.reset()
        with hooks.record():
            kit.completion_logps(model, batch)
            with pytest.raises(RuntimeError, match="called twice"):
                kit.completion_logps(model, batch)
        hooks.reset()
        with pytest.raises(RuntimeError, match="Nothing was recorded"):
            hooks.score_rows(loss, {})


def test_validation_gradient_equals_autograd(kit):
    """accumulate_gradient == autograd.grad(L_val, lora weights), with dropout, and param.grad stays None."""
    model = kit.make_lora_model()
    val_loss = kit.seeded(12, kit.grpo_val_loss)
    params = kit.lora_param_list(model)
    expected = _as_gradients(model, torch.autograd.grad(val_loss(model), params))

    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            loss = val_loss(model)
        direction = hooks.accumulate_gradient(loss)

    assert list(direction) == list(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(direction[name].A, grad.A, rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(direction[name].B, grad.B, rtol=1e-10, atol=1e-14)
    assert all(param.grad is None for param in params)
    # lora_A gradients are non-zero because B was initialised randomly.
    assert all(grad.A.abs().max() > 0 for grad in direction.values())


# ------------------------------------------------------------------------------------------ gradient checkpointing


def test_non_reentrant_checkpointing_gives_the_same_scores(kit):
    model = kit.make_lora_model()
    closures = _closures(kit)
    plain = lora_influence_scores(model, *closures)

    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    calls = []
    probe = q_proj.lora_A["default"].register_forward_hook(lambda *args: calls.append(1))
    checkpointed = lora_influence_scores(model, *closures)
    probe.remove()

    assert len(calls) == 4  # two forwards, each re-run by the checkpoint recompute: only the first is captured
    kit.assert_close_relative(checkpointed, plain, rtol=1e-12)
    kit.assert_close_relative(checkpointed, kit.brute_force_scores(model, *closures), rtol=1e-8)

    # The unprojected path (keep=True, per-row gradients) under checkpointing too.
    per_sample_losses, val_loss = closures
    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            direction = hooks.accumulate_gradient(val_loss(model))
        with hooks.record():
            losses = per_sample_losses(model)
        # Inside checkpointed layers no lora_A input is held from the forward: the backward's recompute supplies it.
        assert hooks.num_pending == len(hooks.layers)
        assert all(c.x is None and c.deferred for c in hooks._pending.values())
        kept = hooks.score_rows(losses.sum(), direction, keep=True)
        everything = hooks.selected_gradients(torch.ones_like(kept, dtype=torch.bool))
    kit.assert_close_relative(kept, plain, rtol=1e-12)
    torch.testing.assert_close(lora_gradient_dot(everything, direction), plain.sum(), rtol=1e-10, atol=0.0)


def test_reentrant_checkpointing_raises_a_clear_error(kit):
    model = kit.make_lora_model()
    model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    module = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    hooks_before = len(module._forward_hooks)

    with pytest.raises(RuntimeError, match=r"reentrant gradient checkpointing.*use_reentrant': False"):
        lora_influence_scores(model, *_closures(kit))
    assert len(module._forward_hooks) == hooks_before  # removed despite the error


def test_projected_recording_requires_the_same_direction(kit):
    model = kit.make_lora_model()
    per_sample_losses, val_loss = _closures(kit)
    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            direction = hooks.accumulate_gradient(val_loss(model))
        other = {name: LoraGradient(grad.A.clone(), grad.B.clone()) for name, grad in direction.items()}
        for use in (
            lambda loss: hooks.score_rows(loss, other),
            lambda loss: hooks.score_rows(loss, direction, keep=True),
            lambda loss: hooks.accumulate_gradient(loss),
        ):
            with hooks.record(direction=direction):
                loss = per_sample_losses(model).sum()
            with pytest.raises((ValueError, RuntimeError), match="direction|record"):
                use(loss)
            assert hooks.num_pending == 0 and hooks.num_kept == 0


# ---------------------------------------------------------------------------------------------- streaming


def test_streaming_micro_batches_equal_one_shot_and_free_captures(kit):
    model = kit.make_lora_model()
    model.eval()  # identical activations whether rows run together or in micro-batches
    batch, val = kit.train_batch(), kit.val_batch()
    n_rows, n_layers = batch.input_ids.shape[0], 14
    losses_fn = _grpo_losses(kit, batch, n_rows=n_rows)  # the full batch's normaliser in every micro-batch

    with LoraGhostHooks(model) as hooks:
        # V from two validation micro-batches == V from the whole validation batch.
        direction = None
        for rows in (slice(0, 4), slice(4, 6)):
            part = val.rows(rows)
            with hooks.record():
                loss = kit.per_sample_policy_losses(kit.completion_logps(model, part), part, "grpo", n_rows=6).sum()
            direction = hooks.accumulate_gradient(loss, into=direction)
        with hooks.record():
            loss = kit.grpo_val_loss(model, val)
        whole = hooks.accumulate_gradient(loss)
        for name in whole:
            torch.testing.assert_close(direction[name].A, whole[name].A, rtol=1e-10, atol=1e-14)
            torch.testing.assert_close(direction[name].B, whole[name].B, rtol=1e-10, atol=1e-14)

        with hooks.record():
            one_shot = hooks.score_rows(losses_fn(model).sum(), direction)

        # Count the captures still held each time a lora_B backward hook has run (ours fires first).
        held = []
        probes = [
            ref.lora_B.register_full_backward_hook(lambda *args: held.append(hooks.num_pending))
            for ref in hooks.layers
        ]
        streamed = []
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
            part = batch.rows(rows)
            with hooks.record(direction=direction):  # rank-r projections only; the one-shot pass kept x
                losses = kit.per_sample_policy_losses(kit.completion_logps(model, part), part, "grpo", n_rows=n_rows)
            assert hooks.num_pending == n_layers
            assert all(c.x is None and c.x_proj.shape[-1] == 4 for c in hooks._pending.values())
            held.clear()
            streamed.append(hooks.score_rows(losses.sum(), direction))
            # Each layer's x, h are dropped as soon as its hook ran, not at the end of the backward.
            assert held == list(range(n_layers - 1, -1, -1))
            assert hooks.num_pending == 0 and hooks.num_kept == 0 and hooks._scores is None
        for probe in probes:
            probe.remove()

    kit.assert_close_relative(torch.cat(streamed), one_shot, rtol=1e-10)
    kit.assert_close_relative(one_shot, kit.brute_force_scores(model, losses_fn, kit.grpo_val_loss), rtol=1e-8)


# -------------------------------------------------------------------------------------------- selected rows (c)


def test_selected_row_gradients_match_brute_force_and_surrogate_applies_them(kit):
    model = kit.make_lora_model()
    per_sample_losses, val_loss = _closures(kit)
    params = kit.lora_param_list(model)
    reference_scores = lora_influence_scores(model, per_sample_losses, val_loss)

    with LoraGhostHooks(model) as hooks:
        with hooks.record():
            direction = hooks.accumulate_gradient(val_loss(model))
        with hooks.record():
            losses = per_sample_losses(model)
        scores = hooks.score_rows(losses.sum(), direction, keep=True)
        assert hooks.num_kept == 14 and hooks.num_pending == 0
        assert all(param.grad is None for param in params)

        valid = kit.train_batch().completion_mask.sum(-1) > 0
        mask = select_rows(scores, valid, mode="positive")
        assert 0 < int(mask.sum()) < int(valid.sum())
        selected = hooks.selected_gradients(mask)
        weights = torch.linspace(-1.0, 2.0, len(scores), dtype=torch.float64)
        weighted = hooks.selected_gradients(weights)

        with pytest.raises(RuntimeError, match="release"):
            with hooks.record():
                hooks.score_rows(per_sample_losses(model).sum(), direction)
        hooks.reset()

        # Brute force on a fresh forward with the same dropout masks.
        fresh = per_sample_losses(model)
        expected = _as_gradients(model, torch.autograd.grad(fresh[mask].sum(), params, retain_graph=True))
        # sum_b w_b grad ell_b from per-sample backwards: a backward of sum_b w_b ell_b would round differently,
        # because the model's RMSNorm runs in float32 and w_b is not a power of two.
        per_sample = [torch.autograd.grad(loss, params, retain_graph=True) for loss in fresh]
        summed = [sum(w * grads[j] for w, grads in zip(weights, per_sample)) for j in range(len(params))]
        expected_weighted = _as_gradients(model, summed)
        for name in expected:
            for got, want in ((selected[name], expected[name]), (weighted[name], expected_weighted[name])):
                torch.testing.assert_close(got.A, want.A, rtol=1e-9, atol=1e-14)
                torch.testing.assert_close(got.B, want.B, rtol=1e-9, atol=1e-14)

        # The surrogate's backward writes exactly the selected rows' gradient into param.grad.
        hooks.gradient_surrogate(selected).backward()
        for name, A, B in lora_parameters(model):
            torch.testing.assert_close(A.grad, expected[name].A, rtol=1e-9, atol=1e-14)
            torch.testing.assert_close(B.grad, expected[name].B, rtol=1e-9, atol=1e-14)
        hooks.release()
        assert hooks.num_kept == 0

    kit.assert_close_relative(scores, reference_scores, rtol=1e-12)
    # The selected rows' scores sum to <grad of the selected loss, V>.
    torch.testing.assert_close(lora_gradient_dot(selected, direction), scores[mask].sum(), rtol=1e-9, atol=1e-14)


# -------------------------------------------------------------------------------------------------- all-reduce


def _all_reduce_worker(rank: int, world_size: int, init_file: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        local = {
            "a": LoraGradient(torch.full((2, 3), float(rank + 1)), torch.full((4, 2), 10.0 * (rank + 1))),
            "b": LoraGradient(torch.arange(6.0).view(2, 3) * (rank + 1), torch.ones(4, 2)),
        }
        summed = all_reduce_({k: LoraGradient(v.A.clone(), v.B.clone()) for k, v in local.items()})
        torch.testing.assert_close(summed["a"].A, torch.full((2, 3), 3.0))
        torch.testing.assert_close(summed["a"].B, torch.full((4, 2), 30.0))
        torch.testing.assert_close(summed["b"].A, torch.arange(6.0).view(2, 3) * 3)
        torch.testing.assert_close(summed["b"].B, torch.full((4, 2), 2.0))
        averaged = all_reduce_(local, op="mean")
        assert averaged is local
        torch.testing.assert_close(local["a"].A, torch.full((2, 3), 1.5))
        torch.testing.assert_close(local["b"].B, torch.ones(4, 2))
    finally:
        dist.destroy_process_group()


def test_all_reduce_sums_over_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_all_reduce_worker, args=(2, str(tmp_path / "init")), nprocs=2, start_method="fork")


def test_all_reduce_without_process_group_is_a_no_op():
    grads = {"a": LoraGradient(torch.ones(2, 3), torch.ones(4, 2))}
    assert all_reduce_(grads) is grads
    assert torch.equal(grads["a"].A, torch.ones(2, 3))
    with pytest.raises(ValueError, match="op"):
        all_reduce_(grads, op="max")


def test_gradient_norm_is_the_norm_of_every_entry_flattened():
    """`tracin/val_grad_norm`: the Euclidean norm over all layers' A and B entries (float32 inputs, float64 sum), 0 for
    an all-zero direction."""
    from trl_agentic.tracin.lora_gradient import LoraGradient, is_zero, norm

    g = torch.Generator().manual_seed(0)
    grads = {
        f"layer{k}": LoraGradient(A=torch.randn(2, 5, generator=g), B=torch.randn(7, 2, generator=g)) for k in range(3)
    }
    flat = torch.cat([t.double().flatten() for grad in grads.values() for t in grad])
    assert norm(grads) == pytest.approx(float(flat.square().sum().sqrt()), rel=1e-12)
    zero = {k: LoraGradient(A=torch.zeros_like(v.A), B=torch.zeros_like(v.B)) for k, v in grads.items()}
    assert norm(zero) == 0.0 and is_zero(zero) and not is_zero(grads)
