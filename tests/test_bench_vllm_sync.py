"""The markdown of `python -m trl_agentic.bench.vllm_sync` (`report`): a time ratio in its prose is one measured side
by side in one process; times from different processes are quoted as such, not divided into a ratio."""

from __future__ import annotations

import os

from trl_agentic.bench.vllm_sync import report

MIB = 1024 * 1024
SIDE = {  # part 1, the trainer side on its own (one process)
    "full_walk_s": 0.700,
    "full_walk_copy_s": 0.759,
    "lora_export_s": 0.060,
    "full_tensors": 272,
    "full_bytes": 513 * MIB,
    "lora_bytes": 19 * MIB,
    "repeats": 5,
}
COLOCATE = {  # part 2, another process: steps, syncs, and both syncs side by side in that process
    "kind": "colocate",
    "step_times_s": [30.0, 23.0, 23.0],
    "sync_times_s": [0.069, 0.071, 0.071],
    "same_process": {
        "lora_s": 0.075,
        "full_s": 0.343,
        "repeats": 5,
        "adapter_bytes": int(9.4 * MIB),
        "adapter_dtype": "bfloat16",
        "sync_dir": "/dev/shm/x",
        "full_bytes": 513 * MIB,
    },
}


def test_time_ratios_are_side_by_side_only():
    text = report(SIDE, [COLOCATE], "cmd")
    same = COLOCATE["same_process"]
    assert f"takes {same['full_s'] / same['lora_s']:.1f}× the whole LoRA sync" in text  # 4.6, one process
    cross = SIDE["full_walk_copy_s"] / 0.071  # part 1 over part 2's LoRA sync: 10.7, two processes
    assert f"{cross:.1f}×" not in text
    assert "different processes, not side by side" in text
    # The data ratio is a ratio of sizes, the same in any process.
    assert f"{SIDE['full_bytes'] / SIDE['lora_bytes']:.0f}× less data" in text


def test_a_full_sync_run_of_several_steps_is_quoted_without_ratios():
    """With a `colocate-full` run of several steps the prose quoted `full_sync / lora_sync` and a step ratio across
    the two processes; it now gives both times."""
    from trl_agentic.bench.vllm_sync import report

    full = {"kind": "colocate-full", "step_times_s": [40.0, 30.0, 30.0], "sync_times_s": [0.9, 0.8, 0.8]}
    text = report(SIDE, [COLOCATE, full], "cmd")
    paragraph = next(p for p in text.split("\n\n") if "Per sync the LoRA sync" in p)
    assert "× the LoRA sync" not in paragraph and "× the LoRA-sync step" not in paragraph
    assert "TRL's whole full sync (into the engine) took 800 ms and its step 30.0 s" in paragraph


def _fake_params(clock, calls, seconds):
    import torch

    def iter_named_params(self):
        calls.append("full")
        clock[0] += seconds
        yield "w", torch.zeros(2)

    return iter_named_params


def test_same_process_syncs_alternate_who_goes_first(monkeypatch, tmp_path):
    """Every repeat ran the LoRA sync before the full walk although the report says "alternating"."""
    import types

    from trl.generation.vllm_generation import VLLMGeneration

    from trl_agentic.bench import vllm_sync

    clock, calls = [0.0], []
    monkeypatch.setattr(vllm_sync.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(VLLMGeneration, "_iter_named_params", _fake_params(clock, calls, 3.0))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 10)

    def sync_weights():
        calls.append("lora")
        clock[0] += 1.0

    generation = types.SimpleNamespace(
        sync_weights=sync_weights,
        lora_request=types.SimpleNamespace(lora_path=str(tmp_path)),
        adapter_dtype="torch.bfloat16",
        sync_dir=str(tmp_path / "sync"),
    )
    result = vllm_sync.same_process_syncs(types.SimpleNamespace(vllm_generation=generation), repeats=4)
    assert calls == ["full", "lora", "full", "full", "lora", "lora", "full", "full", "lora"]  # buffers, then A B, B A
    assert (result["lora_s"], result["full_s"]) == (1.0, 3.0)


def test_trainer_side_warms_the_export_up(monkeypatch):
    """The export's first call (one-off costs) was timed as one of the repeats; it is an untimed warm-up now."""
    import types

    from trl.generation.vllm_generation import VLLMGeneration

    import trl_agentic.vllm_lora as vllm_lora
    from trl_agentic.bench import vllm_sync

    clock, calls, exports = [0.0], [], []
    monkeypatch.setattr(vllm_sync.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(VLLMGeneration, "_iter_named_params", _fake_params(clock, calls, 0.5))
    monkeypatch.setattr(vllm_sync, "_policy", lambda: types.SimpleNamespace())
    monkeypatch.setattr(vllm_lora, "adapter_state_dict", lambda policy, dist: {})

    def save_adapter(policy, path, state):
        clock[0] += 10.0 if not exports else 1.0  # the first call is slow
        exports.append(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(b"x")

    monkeypatch.setattr(vllm_lora, "save_adapter", save_adapter)
    result = vllm_sync.trainer_side(repeats=3)
    assert len(exports) == 4 and result["lora_export_s"] == 1.0
    assert result["full_walk_s"] == 0.5
