"""Pure tensor formulas of RLVCR / CoPO (CogRouter, arXiv 2602.12662): no model, no trainer state.

Conventions shared by every function here:

* A *thinking group* is one expanded step: the same (history, action) scored under the four thinking levels. Its
  per-level values are stored as a row of an `(S, L)` tensor whose column `l - 1` holds level `l` (so `L = 4` in
  practice; the functions accept any `L >= 1`).
* A *missing* value is NaN (a step that was not expanded, a level whose alternative thinking could not be generated).
  Every function states what it does with NaN; the `combine_*` functions never let a missing step value reach a token
  advantage.

The two ways of turning a group into token advantages:

* `copo_weights` + `combine_copo`: the published CoPO rule `A = A_traj * w_l` with `w` a softmax-like weight of the
  min-max normalised action confidence.
* `thinking_advantages` + `combine_additive`: the earlier additive RLVCR design `A = A_traj + w * A_think`, with a
  GiGPO-style group-normalised thinking reward (confidence plus a length bonus).
"""

import torch

__all__ = [
    "THINKING_ADVANTAGE_MODES",
    "action_confidence",
    "chosen_level_values",
    "combine_additive",
    "combine_copo",
    "copo_weights",
    "thinking_advantages",
]

THINKING_ADVANTAGE_MODES = ("mean_norm", "mean_std_norm")

# Bounds of the CoPO clip and of the "all levels equal" test (core_copo.py: `np.clip(p, 1e-6, 1.0)`, `range > 1e-6`).
_CONF_MIN = 1e-6
_RANGE_EPS = 1e-6


def _out_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # The arithmetic runs in float64 (half-precision log-probs lose the small differences between levels); results
    # come back as float32, or float64 when an input was float64.
    dtype = torch.float32
    for t in tensors:
        if t.dtype == torch.float64:
            dtype = torch.float64
    return dtype


def _check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"`{name}` must be 2-D (groups, levels), got shape {tuple(t.shape)}.")


def action_confidence(
    action_logprobs: torch.Tensor, action_mask: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Confidence of the original action under one thinking context, per sequence.

    CoPO scores a thinking level by how likely it makes the action that was actually taken: the geometric-mean token
    probability `c = exp(mean_t log p(a_t | prefix))` over the action tokens.

    Args:
        action_logprobs (`torch.Tensor` of shape `(S, T)`):
            Per-token log-probabilities. Positions outside `action_mask` are ignored, even when they hold `-inf` or
            NaN (padding).
        action_mask (`torch.Tensor` of shape `(S, T)`):
            Which tokens belong to the action (bool, or any numeric dtype where non-zero means "in the action").
        reduction (`str`, *optional*, defaults to `"mean"`):
            `"mean"` for the published geometric-mean confidence, `"min"` for the earlier "min_prob" variant
            `exp(min_t log p)`.

    Returns:
        `torch.Tensor` of shape `(S,)`: the confidences in `[0, 1]` (float32, or float64 for float64 input). A row
        whose mask is empty has no action to score and gets NaN, which `copo_weights` and `thinking_advantages`
        treat as "not scored".
    """
    if action_logprobs.shape != action_mask.shape or action_logprobs.dim() != 2:
        raise ValueError(
            f"`action_logprobs` and `action_mask` must both be (S, T); got {tuple(action_logprobs.shape)} and "
            f"{tuple(action_mask.shape)}."
        )
    if reduction not in ("mean", "min"):
        raise ValueError(f"`reduction` must be 'mean' or 'min', got {reduction!r}.")
    mask = action_mask.bool()
    logp = action_logprobs.to(torch.float64)
    count = mask.sum(dim=-1)
    if reduction == "mean":
        # `where`, not multiplication: 0 * -inf would be NaN on padded positions.
        total = torch.where(mask, logp, torch.zeros_like(logp)).sum(dim=-1)
        score = total / count.clamp(min=1)
    else:
        score = torch.where(mask, logp, torch.full_like(logp, float("inf"))).amin(dim=-1)
    conf = torch.exp(score)
    conf = torch.where(count > 0, conf, torch.full_like(conf, float("nan")))
    return conf.to(_out_dtype(action_logprobs))


def copo_weights(confidence: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    """CoPO confidence weights of the levels in each thinking group.

    Per row: clip `c` to `[1e-6, 1]`, min-max normalise `c~_l = (c_l - min c) / (max c - min c)` (all `c~ = 0.5`
    when `max c - min c <= 1e-6`, following `core_copo.py`, which normalises only when the range is `> 1e-6`), then
    `w_l = exp(k * c~_l) / mean_l' exp(k * c~_l')`. Each row of weights has mean 1; for `k = 2` and four levels a weight lies in
    `[4 / (1 + 3e^2), 4e^2 / (e^2 + 3)]`, about `[0.17, 2.85]`.

    Args:
        confidence (`torch.Tensor` of shape `(S, L)`):
            Action confidence per group and level (column `l - 1` is level `l`).
        k (`float`, *optional*, defaults to `2.0`):
            Sharpness of the weighting (hard-coded to 2.0 in the published code). `k = 0` gives all-ones weights.

    Returns:
        `torch.Tensor` of shape `(S, L)`: the weights. A row containing any NaN (a level that could not be scored) gets
        all weights 1, i.e. it falls back to the plain trajectory advantage, like an unexpanded step in CoPO.
    """
    _check_2d("confidence", confidence)
    c = confidence.to(torch.float64)
    bad_row = torch.isnan(c).any(dim=-1, keepdim=True)
    c = torch.nan_to_num(c, nan=1.0).clamp(_CONF_MIN, 1.0)
    c_min = c.amin(dim=-1, keepdim=True)
    c_max = c.amax(dim=-1, keepdim=True)
    c_range = c_max - c_min
    flat = c_range <= _RANGE_EPS
    c_norm = torch.where(
        flat, torch.full_like(c, 0.5), (c - c_min) / torch.where(flat, torch.ones_like(c_range), c_range)
    )
    z = k * c_norm
    e = torch.exp(z - z.amax(dim=-1, keepdim=True))  # the same ratios; exp(k) overflows from k ~ 710
    w = e / e.mean(dim=-1, keepdim=True)
    w = torch.where(bad_row, torch.ones_like(w), w)
    return w.to(_out_dtype(confidence))


def thinking_advantages(
    confidence: torch.Tensor,
    cost: torch.Tensor,
    *,
    alpha: float,
    cost_max: float,
    mode: str,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised thinking advantage of each level (the additive RLVCR design).

    Thinking reward `R_l = c_l + alpha * (0.5 - min(1, cost_l / cost_max))`: the action confidence plus a length
    bonus that is `+0.5 * alpha` for free thinking and `-0.5 * alpha` at or above `cost_max` thinking tokens. Inside
    each group:

    * `mode="mean_norm"`: `A_l = R_l - mean_l R` (GiGPO's default, `F_norm = 1`);
    * `mode="mean_std_norm"`: `A_l = (R_l - mean_l R) / (std_l R + eps)`, with the *unbiased* (Bessel, `L - 1`) std
      and `eps = 1e-6`, exactly GiGPO's `step_norm_reward` (`torch.std(...)` defaults to unbiased, then
      `/ (std + epsilon)`). A group of one level gets 0, as GiGPO gives a singleton group.

    The arithmetic runs in float64, so a group of equal rewards gives advantages of exactly (or within 1e-10 of) 0
    even with the tiny `eps` denominator.

    Args:
        confidence (`torch.Tensor` of shape `(S, L)`):
            Action confidence per group and level (column `l - 1` is level `l`). Not clipped.
        cost (`torch.Tensor` of shape `(S, L)`):
            Thinking cost per group and level (number of thinking tokens, expected `>= 0`). Ignored when `alpha == 0`
            (so it may then hold NaN).
        alpha (`float`):
            Weight of the length bonus.
        cost_max (`float`):
            Cost at which the length bonus reaches its minimum; must be `> 0`.
        mode (`str`):
            `"mean_norm"` or `"mean_std_norm"`.
        eps (`float`, *optional*, defaults to `1e-6`):
            Added to the std in `"mean_std_norm"`.

    Returns:
        `torch.Tensor` of shape `(S, L)`: the advantages. A row whose reward has any NaN or infinite entry gets all
        zeros (no thinking signal for that step).
    """
    if mode not in THINKING_ADVANTAGE_MODES:
        raise ValueError(f"`mode` must be one of {THINKING_ADVANTAGE_MODES}, got mode={mode!r}.")
    if not cost_max > 0:
        raise ValueError(f"`cost_max` must be > 0, got {cost_max!r}.")
    _check_2d("confidence", confidence)
    _check_2d("cost", cost)
    if confidence.shape != cost.shape:
        raise ValueError(f"`confidence` {tuple(confidence.shape)} and `cost` {tuple(cost.shape)} must match.")
    reward = confidence.to(torch.float64)
    if alpha != 0:
        length_bonus = 0.5 - torch.clamp(cost.to(torch.float64) / cost_max, max=1.0)
        reward = reward + alpha * length_bonus
    bad_row = ~torch.isfinite(reward).all(dim=-1, keepdim=True)
    reward = torch.where(bad_row, torch.zeros_like(reward), reward)
    num_levels = reward.shape[-1]
    centred = reward - reward.mean(dim=-1, keepdim=True)
    if mode == "mean_std_norm":
        if num_levels < 2:
            centred = torch.zeros_like(centred)
        else:
            centred = centred / (reward.std(dim=-1, keepdim=True, unbiased=True) + eps)
    return centred.to(_out_dtype(confidence, cost))


def chosen_level_values(values: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Pick, in each group, the value of the level that was actually chosen.

    Args:
        values (`torch.Tensor` of shape `(S, L)`):
            Per-level values (column `l - 1` is level `l`), e.g. the output of `thinking_advantages` or `copo_weights`.
        levels (`torch.Tensor` of shape `(S,)`):
            The chosen level of each group, 1-based. Any level outside `1..L` selects NaN (missing).

    Returns:
        `torch.Tensor` of shape `(S,)`: `values[s, levels[s] - 1]`, NaN where the level is out of range.
    """
    _check_2d("values", values)
    if levels.shape != values.shape[:1]:
        raise ValueError(f"`levels` must have shape ({values.shape[0]},), got {tuple(levels.shape)}.")
    idx = levels.long() - 1
    valid = (idx >= 0) & (idx < values.shape[-1])
    picked = values.gather(-1, idx.clamp(0, max(values.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    out = picked.to(_out_dtype(values))
    return torch.where(valid, out, torch.full_like(out, float("nan")))


def _gather_steps(per_step: torch.Tensor, step_ids: torch.Tensor, fill: float) -> torch.Tensor:
    """`per_step[b, step_ids[b, t]]`, with `fill` where the step id is -1 or the value is NaN."""
    batch, num_steps = per_step.shape
    if step_ids.dim() != 2 or step_ids.shape[0] != batch:
        raise ValueError(f"`step_ids` must be (B, T) with B={batch}, got {tuple(step_ids.shape)}.")
    if step_ids.is_floating_point():
        raise ValueError("`step_ids` must be an integer tensor.")
    ids = step_ids.long()
    if ids.numel() and (ids.min() < -1 or ids.max() >= num_steps):
        raise ValueError(
            f"`step_ids` must lie in [-1, {num_steps - 1}] (K={num_steps} steps), got range "
            f"[{int(ids.min())}, {int(ids.max())}]."
        )
    values = per_step.to(_out_dtype(per_step))
    values = torch.where(torch.isnan(values), torch.full_like(values, fill), values)
    if num_steps == 0:
        return torch.full(ids.shape, fill, dtype=values.dtype, device=values.device)
    gathered = values.gather(1, ids.clamp(min=0))
    return torch.where(ids >= 0, gathered, torch.full_like(gathered, fill))


def _check_traj(traj_adv: torch.Tensor, per_step: torch.Tensor, name: str) -> None:
    if traj_adv.dim() != 1:
        raise ValueError(f"`traj_adv` must be 1-D (B,), got {tuple(traj_adv.shape)}.")
    if per_step.dim() != 2 or per_step.shape[0] != traj_adv.shape[0]:
        raise ValueError(f"`{name}` must be (B, K) with B={traj_adv.shape[0]}, got {tuple(per_step.shape)}.")


def combine_additive(
    traj_adv: torch.Tensor, thinking_adv_of_chosen: torch.Tensor, step_ids: torch.Tensor, w: float
) -> torch.Tensor:
    """Token advantages of the additive RLVCR rule `A = A_traj + w * A_think`.

    Token `t` of row `b` gets `traj_adv[b] + w * thinking_adv_of_chosen[b, step_ids[b, t]]`. The trajectory advantage
    applies to *every* token of the row, including tokens outside any step (`step_id = -1`: prompt padding, tool or
    observation tokens), exactly as a plain GRPO advantage would; only the thinking term is 0 there. Tokens the loss
    must not see are the loss mask's business, not this function's.

    Args:
        traj_adv (`torch.Tensor` of shape `(B,)`):
            Trajectory (episode) advantage of each row.
        thinking_adv_of_chosen (`torch.Tensor` of shape `(B, K)`):
            Thinking advantage of the chosen level at step `k` of row `b` (e.g. `chosen_level_values` of
            `thinking_advantages`). NaN (or 0) for a step that does not exist or was not expanded; NaN counts as 0.
        step_ids (`torch.Tensor` of shape `(B, T)`, integer):
            Step index of each token in `[0, K)`, or -1 for tokens that belong to no step.
        w (`float`):
            Weight of the thinking advantage (`step_advantage_w`).

    Returns:
        `torch.Tensor` of shape `(B, T)`: the token advantages.
    """
    _check_traj(traj_adv, thinking_adv_of_chosen, "thinking_adv_of_chosen")
    thinking = _gather_steps(thinking_adv_of_chosen, step_ids, fill=0.0)
    traj = traj_adv.to(_out_dtype(traj_adv, thinking_adv_of_chosen))
    return traj[:, None] + w * thinking.to(traj.dtype)


def combine_copo(traj_adv: torch.Tensor, weights_of_level: torch.Tensor, step_ids: torch.Tensor) -> torch.Tensor:
    """Token advantages of the CoPO rule `A = A_traj * w_l`.

    Token `t` of row `b` gets `traj_adv[b] * weights_of_level[b, step_ids[b, t]]`, with weight 1 where the token
    belongs to no step (`step_id = -1`) or the step was not expanded (NaN weight): those tokens keep the plain
    trajectory advantage.

    Args:
        traj_adv (`torch.Tensor` of shape `(B,)`):
            Trajectory (episode) advantage of each row.
        weights_of_level (`torch.Tensor` of shape `(B, K)`):
            CoPO weight of the level used at step `k` of row `b` (e.g. `chosen_level_values` of `copo_weights`); NaN
            (or 1) for a missing or unexpanded step. Not 0: a weight of 0 would zero the advantage of that step.
        step_ids (`torch.Tensor` of shape `(B, T)`, integer):
            Step index of each token in `[0, K)`, or -1 for tokens that belong to no step.

    Returns:
        `torch.Tensor` of shape `(B, T)`: the token advantages.
    """
    _check_traj(traj_adv, weights_of_level, "weights_of_level")
    weights = _gather_steps(weights_of_level, step_ids, fill=1.0)
    traj = traj_adv.to(_out_dtype(traj_adv, weights_of_level))
    return traj[:, None] * weights.to(traj.dtype)
