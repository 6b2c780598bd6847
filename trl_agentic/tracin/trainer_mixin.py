"""TracIn-filtered training step for `AgenticGRPOTrainer` (mixin; inactive unless `tracin_enabled`)."""

from __future__ import annotations


class TracInMixin:
    """Mixed into `AgenticGRPOTrainer` before `GRPOTrainer`. Does nothing unless `args.tracin_enabled`."""

    def _init_tracin(self, tracin_eval_dataset=None) -> None:
        if getattr(self.args, "tracin_enabled", False):
            raise NotImplementedError("TracIn-filtered training is not wired into the trainer yet.")
