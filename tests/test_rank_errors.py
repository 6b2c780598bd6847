"""The any-rank error protocol (`trl_agentic.rank_errors`) with an error whose `__str__` raises: the failing process
still takes part in the gather of messages and raises its own error, the others a `RuntimeError` naming it. Building
the message with `f"{error}"` raised between the reduction and the gather: the other processes waited in the gather
(until the process group's timeout), and the failing one reported the `__str__` failure instead of its error."""

from types import SimpleNamespace

import pytest
import torch


class BadStr(Exception):
    def __str__(self):
        return self.detail  # never set


def _two_processes(monkeypatch, other_rank_message):
    """An accelerator of two processes whose collectives are this process's value plus the other's."""
    import accelerate.utils

    gathered = []

    def gather_object(values):
        gathered.extend(values)
        return [*values, other_rank_message]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather_object)
    accelerator = SimpleNamespace(
        num_processes=2,
        device=torch.device("cpu"),
        reduce=lambda tensor, reduction="sum": tensor + 1,  # the other process failed too, or not: >0 either way
    )
    return accelerator, gathered


def test_the_failing_process_gathers_a_message_and_raises_its_own_error(monkeypatch):
    from trl_agentic.rank_errors import error_summary, raise_on_every_rank

    accelerator, gathered = _two_processes(monkeypatch, None)
    error = BadStr()
    with pytest.raises(BadStr) as info:
        raise_on_every_rank(accelerator, error, "the advantage estimator")
    assert info.value is error
    assert gathered == ["BadStr: <unprintable: its __str__ raised AttributeError>"] == [error_summary(error)]
    assert error_summary(ValueError("bad shape")) == "ValueError: bad shape"


def test_the_other_processes_name_the_failing_ones_error(monkeypatch):
    from trl_agentic.rank_errors import raise_on_every_rank

    accelerator, gathered = _two_processes(monkeypatch, "BadStr: <unprintable: its __str__ raised AttributeError>")
    with pytest.raises(RuntimeError, match=r"the advantage estimator failed on another process: \{1: 'BadStr: <unp"):
        raise_on_every_rank(accelerator, None, "the advantage estimator")
    assert gathered == [None]


def test_the_rollout_loops_flag_gathers_a_message_and_raises_its_own_error(monkeypatch):
    """The rollout loop's synchronisation point (`trl_backend.any_rank`) builds its message the same way."""
    from trl_agentic.rollout.trl_backend import any_rank

    accelerator, gathered = _two_processes(monkeypatch, None)
    error = BadStr()
    with pytest.raises(BadStr) as info:
        any_rank(accelerator, True, error)
    assert info.value is error
    assert gathered == ["BadStr: <unprintable: its __str__ raised AttributeError>"]
