"""select_rows modes, fallback, padding rows and ties; validate_tracin_model errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_agentic.tracin import select_rows, validate_tracin_model

NAN = float("nan")


def _select(scores, valid, **kwargs):
    return select_rows(torch.tensor(scores), torch.tensor(valid), **kwargs).tolist()


def test_positive_mode_skips_padding_nan_and_zero():
    scores = [0.5, -1.0, 0.0, 2.0, NAN, 0.1]
    valid = [True, True, True, False, True, True]
    assert _select(scores, valid, mode="positive") == [True, False, False, False, False, True]


def test_threshold_mode():
    scores = [0.5, -1.0, 0.3, 2.0, 0.31]
    valid = [True, True, True, False, True]
    assert _select(scores, valid, mode="threshold", threshold=0.3) == [True, False, False, False, True]
    assert _select(scores, valid, mode="threshold", threshold=-2.0) == [True, True, True, False, True]


def test_top_fraction_counts_valid_rows_and_breaks_ties_by_index():
    scores = [1.0, 3.0, 1.0, 9.0, 1.0, -2.0]
    valid = [True, True, True, False, True, True]
    # 5 valid rows -> ceil(0.5 * 5) = 3: the 3.0 and the first two of the tied 1.0s; the padding row's 9.0 is ignored.
    assert _select(scores, valid, mode="top_fraction", fraction=0.5) == [True, True, True, False, False, False]
    assert _select(scores, valid, mode="top_fraction", fraction=1.0) == [True, True, True, False, True, True]
    assert sum(_select(scores, valid, mode="top_fraction", fraction=0.01)) == 1


@pytest.mark.parametrize("fraction,n,kept", [(0.14, 50, 7), (0.28, 25, 7), (0.56, 50, 28), (0.5, 5, 3)])
def test_top_fraction_keeps_the_ceiling_of_the_exact_fraction(fraction, n, kept):
    """0.14 * 50 is 7.000000000000001 in floating point: 8 rows were kept, where the random control at the same
    fraction (`selection.rules.random_rows`) keeps 7."""
    from trl_agentic.selection.rules import random_rows

    scores = [float(k) for k in range(n)]
    assert sum(_select(scores, [True] * n, mode="top_fraction", fraction=fraction)) == kept
    assert sum(random_rows(scores, fraction, seed=0)) == kept


def test_min_selected_fallback_takes_the_best_valid_rows():
    scores = [-0.5, -0.1, -0.3, 5.0, -0.1]
    valid = [True, True, True, False, True]
    assert _select(scores, valid, mode="positive") == [False, True, False, False, False]  # default min_selected=1
    assert _select(scores, valid, mode="positive", min_selected=2) == [False, True, False, False, True]
    assert _select(scores, valid, mode="positive", min_selected=0) == [False] * 5
    # The fallback is a superset of an insufficient selection.
    assert _select([0.2, -0.1, 0.1, -0.2], [True] * 4, mode="positive", min_selected=3) == [True, True, True, False]
    # Never more than the eligible rows, never padding or NaN.
    assert _select([-1.0, NAN, 3.0], [True, True, False], mode="threshold", threshold=0.0, min_selected=5) == [
        True,
        False,
        False,
    ]


def test_no_valid_rows_selects_nothing():
    assert _select([1.0, 2.0], [False, False], mode="top_fraction") == [False, False]
    assert _select([1.0, 2.0], [False, False], mode="positive", min_selected=2) == [False, False]


def test_invalid_arguments():
    scores, valid = torch.zeros(3), torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mode='best'"):
        select_rows(scores, valid, mode="best")
    with pytest.raises(ValueError, match="fraction"):
        select_rows(scores, valid, mode="top_fraction", fraction=0.0)
    with pytest.raises(ValueError, match="min_selected"):
        select_rows(scores, valid, mode="positive", min_selected=-1)
    with pytest.raises(ValueError, match="same shape"):
        select_rows(scores, valid[:2], mode="positive")


def _reference(scores, valid, mode, fraction, threshold, min_selected):
    """Plain-Python statement of the documented rule."""
    eligible = [i for i, (s, v) in enumerate(zip(scores, valid)) if v and not math.isnan(s)]
    ranked = sorted(eligible, key=lambda i: (-scores[i], i))
    if mode == "positive":
        chosen = {i for i in eligible if scores[i] > 0}
    elif mode == "threshold":
        chosen = {i for i in eligible if scores[i] > threshold}
    else:
        chosen = set(ranked[: math.ceil(fraction * sum(valid))])
    if len(chosen) < min_selected:
        chosen = set(ranked[:min_selected])
    return [i in chosen for i in range(len(scores))]


@settings(max_examples=150, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.sampled_from([-2.0, -0.5, 0.0, 0.25, 0.5, 1.0, 3.0, NAN]), st.booleans()), min_size=1, max_size=12
    ),
    mode=st.sampled_from(["positive", "top_fraction", "threshold"]),
    fraction=st.sampled_from([0.1, 0.25, 0.5, 0.7, 1.0]),
    threshold=st.sampled_from([-1.0, 0.0, 0.5]),
    min_selected=st.integers(0, 4),
)
def test_matches_reference_rule(rows, mode, fraction, threshold, min_selected):
    scores, valid = [s for s, _ in rows], [v for _, v in rows]
    got = _select(scores, valid, mode=mode, fraction=fraction, threshold=threshold, min_selected=min_selected)
    assert got == _reference(scores, valid, mode, fraction, threshold, min_selected)


# -------------------------------------------------------------------------------------------- validate_tracin_model


def test_validate_accepts_a_lora_model(kit):
    assert len(validate_tracin_model(kit.make_lora_model())) == 14


def test_validate_rejects_a_plain_transformers_model(kit):
    model = kit.make_lora_model().get_base_model()  # the transformers model (still holds LoRA layers)
    with pytest.raises(ValueError, match="peft.PeftModel"):
        validate_tracin_model(model)


def test_validate_rejects_lm_head_lora(kit):
    model = kit.make_lora_model(target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head"):
        validate_tracin_model(model)


def test_validate_rejects_a_peft_model_without_lora(kit):
    from peft import IA3Config, get_peft_model

    base = kit.make_lora_model().get_base_model()
    ia3 = get_peft_model(
        type(base)(base.config),
        IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    )
    with pytest.raises(ValueError, match="no PEFT LoRA layer"):
        validate_tracin_model(ia3)


def test_validate_rejects_dora(kit):
    with pytest.raises(ValueError, match="variant"):
        validate_tracin_model(kit.make_lora_model(target_modules=["q_proj"], use_dora=True))


def test_validate_rejects_lora_that_never_calls_its_lora_a_module(kit, monkeypatch):
    """`target_parameters` (MoE experts) gives PEFT `ParamWrapper`s, whose forward builds the weight from lora_A and
    lora_B without calling them: they were accepted, left out of every score, and never trained by the fused step."""
    from trl_agentic.tracin import layers
    from trl_agentic.tracin.hooks import LoraGhostHooks

    model = kit.make_lora_model(
        lora_dropout=0.0, target_modules=["q_proj"], target_parameters=["mlp.down_proj.weight"]
    )
    with pytest.raises(ValueError, match="ParamWrapper.*target_parameters"):
        validate_tracin_model(model)
    # A layer type not listed is caught when it runs: no silent zero gradient.
    monkeypatch.setattr(layers, "_WEIGHT_LEVEL_LAYERS", ())
    batch = kit.train_batch()
    with (
        LoraGhostHooks(model) as hooks,
        hooks.record(),
        pytest.raises(RuntimeError, match="without calling its lora_A"),
    ):
        kit.per_sample_policy_losses(kit.completion_logps(model, batch), batch, "grpo")
    # The plain LoRA of the same model is hooked as before.
    plain = kit.make_lora_model(lora_dropout=0.0, target_modules=["q_proj", "down_proj"])
    with LoraGhostHooks(plain) as hooks:
        with hooks.record():
            kit.per_sample_policy_losses(kit.completion_logps(plain, batch), batch, "grpo")
        assert hooks.num_pending == len(hooks.layers) == 4
        hooks.reset()
