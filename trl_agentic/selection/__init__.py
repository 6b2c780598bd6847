"""Cheap row selectors for GRPO (`row_selection`): the controls a learned filter such as TracIn must beat, and
rejection-sampled self-training (RFT/STaR) as a GRPO-free way to learn from the policy's own rollouts."""

from .rules import SELECTION_MODES, max_variance_rows, max_variance_subset, random_rows, successful_rows

__all__ = ["SELECTION_MODES", "max_variance_rows", "max_variance_subset", "random_rows", "successful_rows"]
