"""RLVCR / CoPO formulas against hand-computed numbers and plain-Python loops."""

import math
import random

import pytest
import torch

from trl_agentic.rlvcr.formulas import (
    action_confidence,
    chosen_level_values,
    combine_additive,
    combine_copo,
    copo_weights,
    thinking_advantages,
)

NAN = float("nan")


def close(actual: torch.Tensor, expected, tol: float = 1e-6) -> None:
    expected = torch.tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual.double(), expected, atol=tol, rtol=0), (actual, expected)


# ---- action_confidence ----


def test_action_confidence_geometric_mean_and_min():
    # Row 0: action tokens log p = -0.1, -0.3 (the third position is padding holding -inf, outside the mask).
    #   mean = -0.2 -> c = exp(-0.2) = 0.8187307531; min = -0.3 -> exp(-0.3) = 0.7408182207.
    # Row 1: one token log p = -1.0 -> c = exp(-1) = 0.3678794412 for both reductions.
    logp = torch.tensor([[-0.1, -0.3, float("-inf")], [NAN, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]])
    close(action_confidence(logp, mask), [0.8187307531, 0.3678794412])
    close(action_confidence(logp, mask.bool(), reduction="min"), [0.7408182207, 0.3678794412])


def test_action_confidence_empty_mask_is_nan_and_dtypes():
    logp = torch.tensor([[-0.5, -0.5], [-0.2, -0.4]], dtype=torch.bfloat16)
    mask = torch.tensor([[False, False], [True, True]])
    out = action_confidence(logp, mask)
    assert out.dtype == torch.float32
    assert math.isnan(out[0].item())
    # bf16(-0.2) and bf16(-0.4) are not exact: compare with the same values read back in float64.
    vals = logp[1].double()
    assert out[1].item() == pytest.approx(math.exp((vals[0].item() + vals[1].item()) / 2), rel=1e-6)
    assert action_confidence(logp.double(), mask).dtype == torch.float64


def test_action_confidence_bad_arguments():
    with pytest.raises(ValueError):
        action_confidence(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="reduction"):
        action_confidence(torch.zeros(2, 3), torch.ones(2, 3), reduction="max")


# ---- copo_weights ----


def test_copo_weights_hand_computed():
    # c = [0.2, 0.5, 0.9, 0.4]: min 0.2, max 0.9, range 0.7
    # c~ = [0, 0.3/0.7, 1, 0.2/0.7] = [0, 3/7, 1, 2/7]
    # exp(2 c~) = [1, e^(6/7), e^2, e^(4/7)] = [1, 2.3564184424, 7.3890560989, 1.7707949524]
    # mean = 12.5162694937 / 4 = 3.1290673734
    # w = [0.3195840424, 0.7530737313, 2.3614244173, 0.5659178091]
    w = copo_weights(torch.tensor([[0.2, 0.5, 0.9, 0.4]], dtype=torch.float64))
    close(w, [[0.3195840424, 0.7530737313, 2.3614244173, 0.5659178091]], tol=1e-9)
    assert w.mean().item() == pytest.approx(1.0)
    assert w.dtype == torch.float64
    w32 = copo_weights(torch.tensor([[0.2, 0.5, 0.9, 0.4]]))
    assert w32.dtype == torch.float32
    close(w32, w.tolist())


def test_copo_weights_k_and_clipping():
    # k = 1 on the same row: exp(c~) = [1, e^(3/7), e, e^(2/7)] = [1, 1.5350630, 2.7182818, 1.3307122]
    # mean = 6.5840570 / 4 = 1.6460143 -> w = [0.6075282, 0.9325940, 1.6514327, 0.8084451]
    close(copo_weights(torch.tensor([[0.2, 0.5, 0.9, 0.4]]), k=1.0), [[0.6075282, 0.9325940, 1.6514327, 0.8084451]])
    # k = 0: every exp is 1, every weight 1.
    close(copo_weights(torch.tensor([[0.2, 0.5, 0.9, 0.4]]), k=0.0), [[1.0, 1.0, 1.0, 1.0]])
    # Clipping to [1e-6, 1]: [1.5, 0, -3, 0.5] -> [1, 1e-6, 1e-6, 0.5]; range 1 - 1e-6,
    # c~ = [1, 0, 0, (0.5 - 1e-6) / (1 - 1e-6)] ~= [1, 0, 0, 0.4999995]
    # exp(2 c~) = [e^2, 1, 1, e^0.999999] = [7.3890561, 1, 1, 2.7182791] -> mean 3.0268338
    # w = [2.4411833, 0.3303782, 0.3303782, 0.8980602]
    close(copo_weights(torch.tensor([[1.5, 0.0, -3.0, 0.5]])), [[2.4411833, 0.3303782, 0.3303782, 0.8980602]])


def test_copo_weights_degenerate_rows():
    conf = torch.tensor(
        [
            [0.7, 0.7, 0.7, 0.7],  # equal -> c~ = 0.5 for all -> all exp equal -> all weights 1
            [0.3, 0.3 + 5e-7, 0.3, 0.3],  # range 5e-7 <= 1e-6 -> treated as equal
            [0.2, NAN, 0.9, 0.4],  # a level could not be scored -> weights 1 (plain trajectory advantage)
            [NAN, NAN, NAN, NAN],
            [0.0, 0.0, 0.0, 1.0],  # max spread: c~ = [0, 0, 0, 1], w = [1, 1, 1, e^2] / ((3 + e^2) / 4)
        ]
    )
    w = copo_weights(conf)
    mean_exp = (3 + math.exp(2)) / 4  # 2.5972640247
    close(
        w,
        [[1.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4, [1 / mean_exp] * 3 + [math.exp(2) / mean_exp]],
    )
    # A single level: min == max, so the weight is 1.
    close(copo_weights(torch.tensor([[0.4], [0.9]])), [[1.0], [1.0]])
    # No groups at all.
    assert copo_weights(torch.zeros(0, 4)).shape == (0, 4)
    with pytest.raises(ValueError):
        copo_weights(torch.tensor([0.2, 0.5, 0.9, 0.4]))


def test_copo_weights_matches_plain_python():
    rng = random.Random(0)
    rows = [[rng.random() for _ in range(4)] for _ in range(20)]
    w = copo_weights(torch.tensor(rows, dtype=torch.float64), k=2.0)
    for row, got in zip(rows, w.tolist()):
        lo, hi = min(row), max(row)
        norm = [(c - lo) / (hi - lo) for c in row]
        exps = [math.exp(2.0 * x) for x in norm]
        mean = sum(exps) / len(exps)
        assert got == pytest.approx([e / mean for e in exps], abs=1e-12)


def test_copo_weights_stay_finite_for_a_sharp_k():
    """exp(k * c~) overflows from k ~ 710: the top level's weight was inf / inf = NaN, a NaN advantage in its
    expansion row. The weights are a softmax times L, computed stably: the limit puts all of the mass on the top."""
    conf = torch.tensor([[0.2, 0.5, 0.9, 0.4], [0.7, 0.7, 0.7, 0.7]], dtype=torch.float64)
    for k in (800.0, 1e6, -800.0):
        w = copo_weights(conf, k=k)
        assert torch.isfinite(w).all() and torch.allclose(w.mean(dim=-1), torch.ones(2, dtype=torch.float64))
        close(w[1:], [[1.0] * 4])
    close(copo_weights(conf, k=800.0)[:1], [[0.0, 0.0, 4.0, 0.0]])
    close(copo_weights(conf, k=-800.0)[:1], [[4.0, 0.0, 0.0, 0.0]])
    for k in (1e-3, 2.0, 50.0):  # the same values as the plain formula where it does not overflow
        c = torch.tensor([0.0, 3 / 7, 1.0, 2 / 7], dtype=torch.float64)
        plain = torch.exp(k * c) / torch.exp(k * c).mean()
        assert torch.allclose(copo_weights(conf, k=k)[0], plain, rtol=1e-12, atol=0)


# ---- thinking_advantages ----

# c = [0.2, 0.5, 0.9, 0.4], cost = [0, 50, 100, 300], alpha = 0.5, cost_max = 200:
#   cost / cost_max = [0, 0.25, 0.5, 1.5 -> capped at 1]
#   length bonus 0.5 - that = [0.5, 0.25, 0, -0.5], times alpha = [0.25, 0.125, 0, -0.25]
#   R = [0.45, 0.625, 0.9, 0.15], mean R = 2.125 / 4 = 0.53125
#   mean_norm:     A = R - mean = [-0.08125, 0.09375, 0.36875, -0.38125]
#   unbiased var = (0.0066015625 + 0.0087890625 + 0.1359765625 + 0.1453515625) / 3 = 0.29671875 / 3 = 0.09890625
#   std = sqrt(0.09890625) = 0.3144936406
#   mean_std_norm: A / (0.3144936406 + 1e-6) = [-0.2583509844, 0.2980972897, 1.1725160062, -1.2122623115]
CONF = [[0.2, 0.5, 0.9, 0.4]]
COST = [[0.0, 50.0, 100.0, 300.0]]


def test_thinking_advantages_mean_norm():
    adv = thinking_advantages(torch.tensor(CONF), torch.tensor(COST), alpha=0.5, cost_max=200, mode="mean_norm")
    close(adv, [[-0.08125, 0.09375, 0.36875, -0.38125]])
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-7)


def test_thinking_advantages_mean_std_norm_uses_unbiased_std():
    adv = thinking_advantages(torch.tensor(CONF), torch.tensor(COST), alpha=0.5, cost_max=200, mode="mean_std_norm")
    close(adv, [[-0.2583509844, 0.2980972897, 1.1725160062, -1.2122623115]])
    # The biased (population) std would give sqrt(0.29671875 / 4) = 0.2723594...: a different first entry.
    assert adv[0, 0].item() != pytest.approx(-0.08125 / math.sqrt(0.29671875 / 4), abs=1e-3)


def test_thinking_advantages_alpha_zero_ignores_cost():
    # alpha = 0: R = c; the NaN cost is never read. mean c = 2.0 / 4 = 0.5 -> A = [-0.3, 0, 0.4, -0.1]
    adv = thinking_advantages(
        torch.tensor(CONF), torch.tensor([[NAN, 1.0, 2.0, 3.0]]), alpha=0.0, cost_max=200, mode="mean_norm"
    )
    close(adv, [[-0.3, 0.0, 0.4, -0.1]])


def test_thinking_advantages_cost_above_max_is_capped():
    # Equal confidence 0.5; costs 0 / 200 / 400 / 10_000 with cost_max 200 and alpha 1:
    #   bonus = 0.5 - min(1, cost / 200) = [0.5, -0.5, -0.5, -0.5] -> R = [1.0, 0.0, 0.0, 0.0], mean 0.25
    #   A = [0.75, -0.25, -0.25, -0.25]: every cost at or above cost_max is penalised the same.
    adv = thinking_advantages(
        torch.full((1, 4), 0.5),
        torch.tensor([[0.0, 200.0, 400.0, 10_000.0]]),
        alpha=1.0,
        cost_max=200,
        mode="mean_norm",
    )
    close(adv, [[0.75, -0.25, -0.25, -0.25]])


def test_thinking_advantages_degenerate_rows():
    conf = torch.tensor([[0.3, 0.3, 0.3, 0.3], [0.2, NAN, 0.9, 0.4], [0.2, 0.5, 0.9, 0.4]])
    cost = torch.tensor([[10.0, 10.0, 10.0, 10.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, float("inf"), 0.0]])
    for mode in ("mean_norm", "mean_std_norm"):
        adv = thinking_advantages(conf, cost, alpha=0.1, cost_max=100, mode=mode)
        # Equal rewards: zero std, so 0 / (0 + 1e-6) = 0 (float64 arithmetic keeps the numerator exactly 0).
        # A NaN confidence: no thinking signal for the step.
        # An infinite cost is capped at cost_max like any large cost: R = [0.25, 0.55, 0.85, 0.45] (alpha 0.1,
        #   bonus [0.05, 0.05, -0.05, 0.05]), mean 0.525 -> mean_norm A = [-0.275, 0.025, 0.325, -0.075]
        close(adv[:2], [[0.0] * 4, [0.0] * 4], tol=1e-9)
        if mode == "mean_norm":
            close(adv[2:], [[-0.275, 0.025, 0.325, -0.075]])
    # A single level: mean_norm gives R - R = 0; mean_std_norm follows GiGPO's singleton rule (0, not NaN).
    for mode in ("mean_norm", "mean_std_norm"):
        close(
            thinking_advantages(torch.tensor([[0.7]]), torch.tensor([[3.0]]), alpha=0.5, cost_max=10, mode=mode),
            [[0.0]],
        )


def test_thinking_advantages_matches_plain_python():
    rng = random.Random(1)
    conf = [[rng.random() for _ in range(4)] for _ in range(10)]
    cost = [[rng.uniform(0, 400) for _ in range(4)] for _ in range(10)]
    adv = thinking_advantages(
        torch.tensor(conf, dtype=torch.float64),
        torch.tensor(cost, dtype=torch.float64),
        alpha=0.3,
        cost_max=250,
        mode="mean_std_norm",
    )
    for c_row, k_row, got in zip(conf, cost, adv.tolist()):
        rewards = [c + 0.3 * (0.5 - min(1.0, k / 250)) for c, k in zip(c_row, k_row)]
        mean = sum(rewards) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
        assert got == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards], abs=1e-12)


def test_thinking_advantages_bad_arguments():
    conf, cost = torch.tensor(CONF), torch.tensor(COST)
    with pytest.raises(ValueError, match="mode"):
        thinking_advantages(conf, cost, alpha=0.5, cost_max=200, mode="std_norm")
    with pytest.raises(ValueError, match="cost_max"):
        thinking_advantages(conf, cost, alpha=0.5, cost_max=0, mode="mean_norm")
    with pytest.raises(ValueError):
        thinking_advantages(conf, cost[:, :3], alpha=0.5, cost_max=200, mode="mean_norm")


# ---- chosen_level_values ----


def test_chosen_level_values():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    out = chosen_level_values(values, torch.tensor([3, 1, 7]))
    assert out[:2].tolist() == [3.0, 5.0]
    assert math.isnan(out[2].item())
    assert math.isnan(chosen_level_values(values[:1], torch.tensor([0]))[0].item())


# ---- combine_additive / combine_copo ----


def _random_case(seed: int, batch: int = 5, steps: int = 4, tokens: int = 17):
    rng = random.Random(seed)
    traj = [rng.uniform(-2, 2) for _ in range(batch)]
    per_step = [[rng.choice([NAN, rng.uniform(-1, 2)]) for _ in range(steps)] for _ in range(batch)]
    step_ids = [[rng.randint(-1, steps - 1) for _ in range(tokens)] for _ in range(batch)]
    return traj, per_step, step_ids


@pytest.mark.parametrize("seed", range(5))
def test_combine_additive_matches_loop(seed):
    traj, per_step, step_ids = _random_case(seed)
    w = 0.7
    out = combine_additive(
        torch.tensor(traj, dtype=torch.float64), torch.tensor(per_step, dtype=torch.float64), torch.tensor(step_ids), w
    )
    for b in range(len(traj)):
        for t in range(len(step_ids[b])):
            k = step_ids[b][t]
            thinking = 0.0 if k == -1 or math.isnan(per_step[b][k]) else per_step[b][k]
            assert out[b, t].item() == pytest.approx(traj[b] + w * thinking, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_combine_copo_matches_loop(seed):
    traj, per_step, step_ids = _random_case(seed)
    out = combine_copo(
        torch.tensor(traj, dtype=torch.float64), torch.tensor(per_step, dtype=torch.float64), torch.tensor(step_ids)
    )
    for b in range(len(traj)):
        for t in range(len(step_ids[b])):
            k = step_ids[b][t]
            weight = 1.0 if k == -1 or math.isnan(per_step[b][k]) else per_step[b][k]
            assert out[b, t].item() == pytest.approx(traj[b] * weight, abs=1e-12)


def test_combine_small_explicit_example():
    # Row 0: traj 0.5, steps [thinking 0.2, missing]; tokens: prompt pad, step 0, step 0, tool token, step 1.
    # Row 1: traj -1.0, steps [-0.4, 0.1]; tokens: step 0, tool, step 1, step 1, pad.
    traj = torch.tensor([0.5, -1.0])
    per_step = torch.tensor([[0.2, NAN], [-0.4, 0.1]])
    step_ids = torch.tensor([[-1, 0, 0, -1, 1], [0, -1, 1, 1, -1]])
    # additive, w = 2: row 0 -> [0.5, 0.5 + 0.4, 0.9, 0.5, 0.5]; row 1 -> [-1 - 0.8, -1, -1 + 0.2, -0.8, -1]
    close(
        combine_additive(traj, per_step, step_ids, w=2.0),
        [[0.5, 0.9, 0.9, 0.5, 0.5], [-1.8, -1.0, -0.8, -0.8, -1.0]],
    )
    # copo with per-step weights [1.5, missing] and [0.5, 2.0]:
    # row 0 -> [0.5, 0.75, 0.75, 0.5, 0.5]; row 1 -> [-0.5, -1, -2, -2, -1]
    weights = torch.tensor([[1.5, NAN], [0.5, 2.0]])
    close(combine_copo(traj, weights, step_ids), [[0.5, 0.75, 0.75, 0.5, 0.5], [-0.5, -1.0, -2.0, -2.0, -1.0]])
    # w = 0 gives the plain trajectory advantage everywhere.
    close(combine_additive(traj, per_step, step_ids, w=0.0), [[0.5] * 5, [-1.0] * 5])


def test_combine_no_steps_and_bad_ids():
    traj = torch.tensor([0.3, -0.2])
    no_steps = torch.zeros(2, 0)
    ids = torch.full((2, 3), -1)
    close(combine_additive(traj, no_steps, ids, w=1.0), [[0.3] * 3, [-0.2] * 3])
    close(combine_copo(traj, no_steps, ids), [[0.3] * 3, [-0.2] * 3])
    per_step = torch.zeros(2, 2)
    for bad in (torch.tensor([[0, 2, -1], [0, 0, 0]]), torch.tensor([[0, -2, -1], [0, 0, 0]])):
        with pytest.raises(ValueError, match="step_ids"):
            combine_additive(traj, per_step, bad, w=1.0)
    with pytest.raises(ValueError):
        combine_copo(traj, per_step, torch.zeros(2, 3))  # float step ids
    with pytest.raises(ValueError):
        combine_copo(traj, torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.long))
