"""`TracInMixin._tracin_state_dict` / `_tracin_load_state_dict` round-trip through `torch.save` / `torch.load`.

The end-to-end check (a SIGKILLed run resumed from a checkpoint reuses the saved V) is `tests/test_kill_resume.py`.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trl_agentic.tracin.lora_gradient import LoraGradient
from trl_agentic.tracin.trainer_mixin import TracInMixin, TracInState


class _Stub(TracInMixin):
    """Just the attributes the two methods read."""

    def __init__(self, state: TracInState | None):
        self._tracin = state
        self.accelerator = SimpleNamespace(device=torch.device("cpu"))


def _fresh() -> TracInState:
    return TracInState(dataset=[{"prompt": "p"}], fused=True, disable_checkpointing=False)


def _roundtrip(source: _Stub, target: _Stub, tmp_path) -> None:
    path = tmp_path / "tracin_state.pt"
    torch.save(source._tracin_state_dict(), path)
    target._tracin_load_state_dict(torch.load(path, weights_only=True))  # weights_only: what the trainer uses


def test_state_round_trips_through_a_file(tmp_path):
    generator = torch.Generator().manual_seed(0)
    direction = {
        "model.layers.0.self_attn.q_proj": LoraGradient(
            A=torch.randn(4, 8, generator=generator), B=torch.randn(16, 4, generator=generator)
        ),
        "model.layers.1.mlp.down_proj": LoraGradient(
            A=torch.randn(4, 12, generator=generator, dtype=torch.float64),
            B=torch.randn(8, 4, generator=generator, dtype=torch.float64),
        ),
    }
    saved = _fresh()
    saved.direction, saved.refreshed_at, saved.refreshes = direction, 3, 2
    saved.last = {"scores": torch.ones(2)}
    restored = _Stub(_fresh())

    _roundtrip(_Stub(saved), restored, tmp_path)

    state = restored._tracin
    assert (state.refreshed_at, state.refreshes, state.direction_is_zero) == (3, 2, False)
    assert list(state.direction) == list(direction)
    for name, grad in direction.items():
        got = state.direction[name]
        assert isinstance(got, LoraGradient)
        assert torch.equal(got.A, grad.A) and got.A.dtype == grad.A.dtype
        assert torch.equal(got.B, grad.B) and got.B.dtype == grad.B.dtype
    assert state.last == {}  # inspection only, not saved
    # The restored V is a copy: the next refresh or an in-place reduction cannot touch the saved run's tensors.
    state.direction["model.layers.0.self_attn.q_proj"].A.zero_()
    assert direction["model.layers.0.self_attn.q_proj"].A.any()


def test_zero_or_missing_direction_round_trips(tmp_path):
    zero = _fresh()
    zero.direction = {"layer": LoraGradient(A=torch.zeros(2, 3), B=torch.zeros(5, 2))}
    zero.direction_is_zero, zero.refreshed_at, zero.refreshes = True, 0, 1
    restored = _Stub(_fresh())
    _roundtrip(_Stub(zero), restored, tmp_path)
    assert restored._tracin.direction_is_zero and not restored._tracin.direction["layer"].A.any()

    restored = _Stub(_fresh())
    _roundtrip(_Stub(_fresh()), restored, tmp_path)  # saved before the first refresh
    assert restored._tracin.direction is None and restored._tracin.refreshed_at == -1


def test_tracin_off_saves_and_loads_nothing():
    off = _Stub(None)
    assert off._tracin_state_dict() is None
    off._tracin_load_state_dict({"direction": None, "direction_is_zero": False, "refreshed_at": 5, "refreshes": 9})
    assert off._tracin is None
