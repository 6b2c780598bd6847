"""The any-rank error protocol of the distributed data path: an error on one process stops every process.

Every process of a multi-process run makes the same collectives in the same order (gathers, reductions, and, under
DeepSpeed ZeRO-3, every forward pass). A process that raises between two collectives leaves the others waiting in the
next one (a hang until the launcher's timeout) or, worse, pairs their next collective with a different one of its own
(wrong results, or a crash far from the cause). So every local computation of the data path that can raise sits
between two *synchronisation points*: the work runs in a `try`, and the error (or `None`) is handed to
`raise_on_every_rank`, which every process calls at the same place. When any process passed an error, every process
raises there: the failing one its own error, the others a `RuntimeError` naming it and its rank.

Every synchronisation point makes the same collectives (a one-value reduction, then a gather of the messages when any
process failed), so a failing process that jumps ahead to an enclosing synchronisation point (e.g. the batch
augmenter's around an estimator) meets the others at their next one. An error raised by a synchronisation point is
marked as raised on every process: later synchronisation points re-raise it without a collective.

The rollout loop uses the same protocol with a flag on top (`trl_agentic.rollout.trl_backend.any_rank`).
"""

from __future__ import annotations

import torch

__all__ = ["error_summary", "raise_on_every_rank"]

_ON_EVERY_RANK = "_trl_agentic_raised_on_every_rank"


def error_summary(error: BaseException) -> str:
    """`"Type: message"` for the other processes' message. Never raises: an exception whose `__str__` fails (a user
    class reading an attribute it never set) would otherwise raise here, between the reduction and the gather, and
    leave the other processes waiting in the gather with the real error lost."""
    try:
        text = str(error)
    except Exception as e:  # noqa: BLE001 - the message must be built whatever the error's __str__ does
        text = f"<unprintable: its __str__ raised {type(e).__name__}>"
    return f"{type(error).__name__}: {text}"


def raise_on_every_rank(accelerator, error: BaseException | None, where: str) -> None:
    """
    A synchronisation point: raise on every process when any process passes an error.

    Args:
        accelerator: The trainer's `accelerate.Accelerator`.
        error (`BaseException`, *optional*): This process's error, or `None`.
        where (`str`): What failed, for the message of the other processes (e.g. `"the advantage estimator"`).

    Raises:
        The process's own `error` on the process that failed; a `RuntimeError` naming every failed rank's error on the
        others. Nothing when no process failed.
    """
    if error is not None and (accelerator.num_processes == 1 or getattr(error, _ON_EVERY_RANK, False)):
        raise error  # nothing to tell, or every process raises already
    if accelerator.num_processes == 1:
        return
    from accelerate.utils import gather_object

    flag = torch.tensor([0.0 if error is None else 1.0], device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() == 0:
        return
    errors = gather_object([None if error is None else error_summary(error)])
    if error is None:
        failed = {rank: text for rank, text in enumerate(errors) if text is not None}
        error = RuntimeError(f"Stopped because {where} failed on another process: {failed}")
    try:
        setattr(error, _ON_EVERY_RANK, True)
    except AttributeError:  # an exception type that refuses attributes: re-synchronised (harmlessly) if re-raised
        pass
    raise error
