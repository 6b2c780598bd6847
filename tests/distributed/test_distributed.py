"""Multi-process tests: `accelerate launch` with 2 CPU processes (gloo DDP, DeepSpeed ZeRO-2 and ZeRO-3).

Each test launches `scripts/train_scripted.py` (scripted generation on the tiny model, see its docstring) with a CPU
copy of a shipped `configs/accelerate/*.yaml` and checks the per-rank dumps. Every launch runs in its own process
group under a timeout: a hang (e.g. unmatched collectives) kills the whole group and fails the test, after each rank
printed its stack (`--stack_dump_after`).

Run: `python -m pytest tests/distributed -q -m distributed` (about 5 minutes on 2 CPU cores; docs/distributed.md).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import yaml

from trl_agentic.rollout.types import RowKind

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
SCRIPT = SCRIPTS / "train_scripted.py"
TIMEOUT = 420  # seconds per launch: ~1 min normally, several on a loaded shared machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_config(name: str, tmp_path: Path, num_processes: int = 2) -> Path:
    """A CPU copy of a shipped accelerate config (the shipped files are GPU-ready)."""
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    config.update(use_cpu=True, num_processes=num_processes, mixed_precision="no")
    path = tmp_path / f"{name}_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(
    config: Path,
    out: Path,
    *script_args: str,
    script: Path | None = SCRIPT,
    dumps: str = "rank*.json",
    timeout: float = TIMEOUT,
) -> list[dict]:
    """Run a script (or, with `script=None`, `-m trl_agentic`) under `accelerate launch`; return each rank's dump.

    Fails the test on a non-zero exit or a timeout; retries once when the rendezvous port was taken meanwhile.
    """
    out.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        returncode, log_path = _launch_once(config, out, script, script_args, timeout)
        if returncode == 0 or attempt or "address already in use" not in log_path.read_text(errors="replace").lower():
            break
    if returncode != 0 or (script is not None and not (out / "DONE").exists()):
        errors = "".join(p.read_text() for p in sorted(out.glob("error_rank*.txt")))
        pytest.fail(f"accelerate launch failed (exit {returncode}):\n{errors}\n{_tail(log_path)}")
    records = [json.loads(p.read_text()) for p in sorted(out.glob(dumps))]
    return sorted(records, key=lambda r: r["rank"])


def _launch_once(config: Path, out: Path, script: Path | None, script_args, timeout: float) -> tuple[int, Path]:
    port = _free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd += ["--main_process_port", str(port)]
    if script is None:
        cmd += ["-m", "trl_agentic", *script_args]
    else:
        cmd += [str(script), "--out", str(out), "--stack_dump_after", str(timeout - 45), *script_args]
    log_path = out / "launch.log"
    with open(log_path, "w") as log:
        # Own process group: on timeout the launcher *and* its workers are killed, nothing keeps running.
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"accelerate launch timed out after {timeout}s (hang?):\n{_tail(log_path)}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return returncode, log_path


def _tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def _rows(record: dict, kind: RowKind | None = None) -> list[dict]:
    rows = [r for b in record["batches"] for r in b["rows"]]
    return rows if kind is None else [r for r in rows if r["kind"] == int(kind)]


def _content_index(records: list[dict]) -> dict:
    """Rows (padding excluded) keyed by content: (prompt, completion, kind) -> sorted [(group, advantage, mask)]."""
    index = defaultdict(list)
    for record in records:
        for r in _rows(record):
            if r["kind"] != RowKind.PADDING:
                index[(tuple(r["prompt"]), tuple(r["completion"]), r["kind"])].append(
                    (r["group"], r["advantage"], tuple(r["loss_mask"]))
                )
    return {k: sorted(v) for k, v in index.items()}


def _stat(record: dict, name: str) -> int:
    return sum(s[name] for s in record["loop_stats"] if s is not None)


def _all_generation_calls(record: dict) -> int:
    return _stat(record, "generation_calls") + _stat(record, "dummy_generation_calls")


def _lora_moved(out: Path) -> tuple[float, float]:
    """(largest change of a LoRA weight, largest |lora_B| at the start) between the run's start and its saved adapter."""
    from safetensors.torch import load_file

    initial = torch.load(out / "initial_state.pt")
    final = load_file(out / "final" / "adapter_model.safetensors")
    assert final, "the saved adapter is empty"
    moved, start_b = 0.0, 0.0
    for key, value in final.items():
        before = initial[key.replace(".weight", ".default.weight")]
        assert before.shape == value.shape, key
        assert torch.isfinite(value).all(), key
        moved = max(moved, (value.float() - before).abs().max().item())
        if "lora_B" in key:
            start_b = max(start_b, before.abs().max().item())
    return moved, start_b


def _assert_trained(records: list[dict]) -> None:
    for record in records:
        assert record["losses"], f"rank {record['rank']} computed no loss"
        assert all(math.isfinite(x) for x in record["losses"]), record["losses"]
        logged = [h["loss"] for h in record["log_history"] if "loss" in h]
        assert logged and all(math.isfinite(x) for x in logged)
    # Every rank trains on the same number of rows (padding included) and the same global token count.
    sizes = {tuple(len(b["rows"]) for b in r["batches"]) for r in records}
    assert len(sizes) == 1, sizes
    for i in range(len(records[0]["batches"])):
        items = {r["batches"][i]["num_items_in_batch"] for r in records}
        assert len(items) == 1, items
        assert items.pop() == sum(r["batches"][i]["local_loss_tokens"] for r in records)
    # Same number of generation calls on every rank: generation is a collective under ZeRO-3.
    assert len({r["generation_calls"] for r in records}) == 1, [r["generation_calls"] for r in records]


# ----------------------------------------------------------------------------------------------------------------------
def test_shipped_accelerate_configs_are_gpu_ready():
    expected = {
        "single": ("NO", None),
        "ddp": ("MULTI_GPU", None),
        "zero2": ("DEEPSPEED", 2),
        "zero3": ("DEEPSPEED", 3),
        "zero3_offload": ("DEEPSPEED", 3),
    }
    for name, (distributed_type, stage) in expected.items():
        text = (CONFIGS / f"{name}.yaml").read_text()
        config = yaml.safe_load(text)
        assert config["distributed_type"] == distributed_type, name
        assert config["use_cpu"] is False, name
        assert "CPU" in text, f"{name}.yaml should say how to run on CPU"
        assert config["num_processes"] == (1 if name == "single" else 8), name
        if stage is not None:
            assert config["deepspeed_config"]["zero_stage"] == stage, name
    offload = yaml.safe_load((CONFIGS / "zero3_offload.yaml").read_text())["deepspeed_config"]
    assert offload["offload_param_device"] == "cpu" and offload["offload_optimizer_device"] == "cpu"
    assert yaml.safe_load((CONFIGS / "zero3.yaml").read_text())["deepspeed_config"]["offload_param_device"] == "none"


def _parity_args(model: str) -> list[str]:
    """The `parity` scenario: 12 rollouts in groups of 4, 6 per rank in the 2-process layout (see its docstring)."""
    return ["--model", model, "--scenario", "parity", "--rows_per_rank", "6", "--num_generations", "4"]


@pytest.mark.timeout(2 * TIMEOUT + 120)  # two launches (2 processes, then 1), each under its own TIMEOUT
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_variable_rows_across_processes_match_one_process(tiny_model_dir, tmp_path, loss_type):
    """2 DDP processes vs 1 process on the union of their generation batches: same rows, advantages, loss, gradient.

    With `grpo` (a per-row mean), rank 1's micro-batches hold more zero-weight padding rows than rank 0's: every real
    row must still weigh 1 / (real rows) as in the 1-process run.

    Layout: 4 rollouts per group, 3 per device and 2 micro-steps, so each rank generates 6 rollouts (rank 0 rows 0-5,
    rank 1 rows 6-11) and group 1 (rows 4-7) is split across the ranks. The 1-process run has 6 per device: the same
    sampler yields the same 12 rows. Scripted failures give rank 0 three negative rows (one rollout exhausts its
    retries, the group-0 cap of 2 binds) and rank 1 two.
    """
    common = [
        *_parity_args(tiny_model_dir),
        "--gradient_accumulation_steps",
        "2",
        "--max_negative_samples_per_group",
        "2",
        "--optim",
        "sgd",
        "--learning_rate",
        "0.1",
        "--record_grads",
        "--loss_type",
        loss_type,
    ]
    multi = launch(cpu_config("ddp", tmp_path), tmp_path / "ddp", *common, "--per_device_train_batch_size", "3")
    (single,) = launch(
        cpu_config("single", tmp_path, 1), tmp_path / "single", *common, "--per_device_train_batch_size", "6"
    )
    assert [r["num_processes"] for r in multi] == [2, 2] and single["num_processes"] == 1
    assert "MULTI_CPU" in multi[0]["distributed_type"], multi[0]["distributed_type"]
    _assert_trained(multi)

    # The ranks really are unbalanced: different negative rows, so one rank carries zero-weight padding rows.
    negatives = [len(_rows(r, RowKind.NEGATIVE)) for r in multi]
    assert negatives == [3, 2], negatives
    padding = [_rows(r, RowKind.PADDING) for r in multi]
    assert len(padding[1]) > len(padding[0])
    assert all(r["advantage"] == 0 and not any(r["loss_mask"]) for p in padding for r in p)
    for record in multi:
        assert all(len(b["rows"]) % 2 == 0 for b in record["batches"])  # a multiple of steps_per_generation
    # The split group has rows, and a negative, on both ranks.
    for record in multi:
        group1 = [r for r in _rows(record) if r["group"] == 1]
        assert any(r["kind"] == RowKind.NEGATIVE for r in group1), record["rank"]
    # Idle iterations of rank 1 were matched by dummy generation calls.
    assert _all_generation_calls(multi[0]) == _all_generation_calls(multi[1])
    assert _stat(multi[1], "dummy_generation_calls") > 0 and multi[1]["scripted_dummy_calls"] > 0

    # Same rows (by content), same group ids, same advantages, same trainable tokens.
    ours, ref = _content_index(multi), _content_index([single])
    assert len(ref) == 12 + 5 and ours.keys() == ref.keys()
    for key in ref:
        assert [(g, m) for g, _, m in ours[key]] == [(g, m) for g, _, m in ref[key]]
        for (_, a, _), (_, b, _) in zip(ours[key], ref[key]):
            assert abs(a - b) <= 1e-6, (a, b)
    assert any(a != 0 for v in ref.values() for _, a, _ in v)
    assert multi[0]["batches"][0]["num_items_in_batch"] == single["batches"][0]["num_items_in_batch"]

    # Global normalisers (tokens for dapo, rows for grpo): the mean over ranks of the summed micro-step losses is the
    # 1-process loss.
    multi_loss = sum(sum(r["losses"]) for r in multi) / 2
    assert len(single["losses"]) == 2 and all(len(r["losses"]) == 2 for r in multi)
    assert abs(multi_loss - sum(single["losses"])) <= 1e-6, (multi_loss, single["losses"])

    # Same gradient at the optimizer step (DDP averages the ranks' gradients) and the same weights after it.
    grads = [torch.load(tmp_path / "ddp" / f"grads_rank{r}.pt") for r in range(2)]
    ref_grads = torch.load(tmp_path / "single" / "grads_rank0.pt")
    assert ref_grads.keys() == grads[0].keys() == grads[1].keys()
    assert max(g.abs().max().item() for g in ref_grads.values()) > 1e-3
    for name, g in ref_grads.items():
        assert torch.equal(grads[0][name], grads[1][name]), name
        assert torch.allclose(grads[0][name], g, rtol=0, atol=1e-6), name
    final_multi = torch.load(tmp_path / "ddp" / "final_state.pt")
    final_single = torch.load(tmp_path / "single" / "final_state.pt")
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], final_single[k]) for k in start)
    for name, w in final_single.items():
        assert torch.allclose(final_multi[name], w, rtol=0, atol=1e-6), name


TRL_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "num_items_in_batch")


@pytest.mark.timeout(TIMEOUT + 120)  # one launch (both trainers, one after the other) under its own TIMEOUT
@pytest.mark.parametrize(
    "launcher, num_generations, loss_type",
    [
        # 12 rows per generation batch in groups of 4: group 1 (rows 4-7) is split across the ranks; per-row loss.
        ("ddp", 4, "grpo"),
        # Groups of 6 (a size whose mean TRL's nanmean and a segment sum round differently), one per rank; the
        # token-level loss normalised by the global token count.
        ("zero2", 6, "dapo"),
    ],
)
def test_features_off_matches_grpo_trainer_on_two_processes(
    tiny_model_dir, tmp_path, launcher, num_generations, loss_type
):
    """Features off on 2 processes (DDP on gloo, DeepSpeed ZeRO-2): `AgenticGRPOTrainer` equals TRL's `GRPOTrainer`
    on 2 processes, bit for bit on every rank: rewards, the batches each rank trains on, every micro-step loss, the
    logged metrics and the weights after 4 optimizer steps (2 generation batches of 12 rows, real sampling,
    non-integer rewards). `scripts/parity_trl.py` trains both in one launch."""
    out = tmp_path / "run"
    args = ["--model", tiny_model_dir, "--num_generations", str(num_generations), "--loss_type", loss_type]
    records = launch(
        cpu_config(launcher, tmp_path), out, *args, script=SCRIPTS / "parity_trl.py", dumps="parity_rank*.json"
    )
    assert [r["num_processes"] for r in records] == [2, 2]
    assert ("MULTI_CPU" if launcher == "ddp" else "DEEPSPEED") in records[0]["distributed_type"]
    refs = [torch.load(out / f"GRPOTrainer_rank{rank}.pt") for rank in (0, 1)]
    for rank, ref in enumerate(refs):
        ours = torch.load(out / f"AgenticGRPOTrainer_rank{rank}.pt")
        assert len(ref["rewards"]) == len(ours["rewards"]) == 2
        for mine, theirs in zip(ours["rewards"], ref["rewards"]):
            assert torch.equal(mine, theirs), rank
        assert len(ref["batches"]) == len(ours["batches"]) == 2
        for batch, ref_batch in zip(ours["batches"], ref["batches"]):
            for key in TRL_KEYS:
                assert torch.equal(batch[key], ref_batch[key]), (rank, key)
            assert ref_batch["prompt_ids"].size(0) == 6  # this rank's half of the 12 rows
            assert torch.equal(batch["group_id"], (torch.arange(6) + 6 * rank) // num_generations)
        assert len(ref["losses"]) == len(ours["losses"]) == 4
        for mine, theirs in zip(ours["losses"], ref["losses"]):
            assert torch.equal(mine, theirs), rank
        steps = [h for h in ours["history"] if "loss" in h]
        ref_steps = [h for h in ref["history"] if "loss" in h]
        assert len(steps) == len(ref_steps) == 4
        for step, ref_step in zip(steps, ref_steps):
            assert {k: step[k] for k in ref_step} == ref_step, rank
        assert ref["weights"].keys() == ours["weights"].keys()
        for key, value in ref["weights"].items():
            assert torch.equal(ours["weights"][key], value), (rank, key)
    # The comparison can fail: the ranks trained on different rows with non-zero advantages and non-integer rewards,
    # every rank ended with the same weights, and training moved them.
    assert not torch.equal(refs[0]["batches"][0]["completion_ids"], refs[1]["batches"][0]["completion_ids"])
    assert all(b["advantages"].abs().sum() > 0 for ref in refs for b in ref["batches"])
    assert any(r != r.round() for r in refs[0]["rewards"][0].flatten())
    for key, value in refs[0]["weights"].items():
        assert torch.equal(refs[1]["weights"][key], value), key
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(start[k], refs[0]["weights"][k]) for k in start)


@pytest.mark.parametrize(
    "scenario, extra",
    [
        ("rank0_fails", ["--max_tool_retries", "2"]),
        (
            "rank0_retries_snapshots",
            ["--max_tool_retries", "3", "--max_negative_samples_per_group", "4", "--snapshots"],
        ),
    ],
)
def test_rank_divergent_rollouts_finish_under_zero3(tiny_model_dir, tmp_path, scenario, extra):
    """ZeRO-3 + LoRA, real (collective) generation calls and reference log-probs (`beta > 0`): only rank 0's tools
    fail, so only rank 0 rolls back, regenerates (and takes snapshots); rank 1 idles. Both must finish."""
    records = launch(
        cpu_config("zero3", tmp_path),
        tmp_path / "run",
        "--model",
        tiny_model_dir,
        "--scenario",
        scenario,
        "--rows_per_rank",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--num_generations",
        "2",
        "--beta",
        "0.04",
        "--lora",
        "--exercise_model",
        *extra,
    )
    assert "DEEPSPEED" in records[0]["distributed_type"]
    _assert_trained(records)
    rank0, rank1 = records
    assert _stat(rank0, "rollback_attempts") >= 2 * (3 if "--snapshots" in extra else 2)
    assert _stat(rank0, "regenerated_tokens") > 0 and len(_rows(rank0, RowKind.NEGATIVE)) > 0
    assert _stat(rank1, "rollback_attempts") == 0 and not _rows(rank1, RowKind.NEGATIVE)
    if "--snapshots" in extra:
        assert _stat(rank0, "snapshots") == 2 * 2 and len(_rows(rank0, RowKind.SNAPSHOT)) == 2 * 2
        assert _stat(rank1, "snapshots") == 0 and not _rows(rank1, RowKind.SNAPSHOT)
    # Rank 1 matched rank 0's extra generation rounds with dummy calls.
    assert _all_generation_calls(rank0) == _all_generation_calls(rank1)
    assert _stat(rank1, "dummy_generation_calls") > 0 and _stat(rank0, "dummy_generation_calls") == 0
    moved, start_b = _lora_moved(tmp_path / "run")
    assert start_b == 0.0 and moved > 1e-4


@pytest.mark.parametrize("zero", ["zero2", "zero3"])
def test_all_features_under_deepspeed(tiny_model_dir, tmp_path, zero):
    """ZeRO-2 / ZeRO-3 + LoRA with every feature on: rollback, negatives and snapshots (more on rank 0), RLVCR CoPO
    advantages with expansion rows (more on rank 1), TracIn-filtered training, old and reference log-probs of the
    extra rows (`steps_per_generation=2` > `gradient_accumulation_steps=1`, `beta > 0`), two optimizer steps on one
    generation batch."""
    records = launch(
        cpu_config(zero, tmp_path),
        tmp_path / "run",
        "--model",
        tiny_model_dir,
        "--scenario",
        "all_features",
        "--rows_per_rank",
        "4",
        "--per_device_train_batch_size",
        "2",
        "--steps_per_generation",
        "2",
        "--num_generations",
        "2",
        "--max_steps",
        "2",
        "--beta",
        "0.04",
        "--max_negative_samples_per_group",
        "2",
        "--snapshots",
        "--lora",
        "--rlvcr",
        "--tracin",
        "--exercise_model",
    )
    assert "DEEPSPEED" in records[0]["distributed_type"]
    _assert_trained(records)
    rank0, rank1 = records
    assert len(rank0["losses"]) == 2 and len(rank1["losses"]) == 2  # two optimizer steps from one generation
    for record in records:
        assert _rows(record, RowKind.NEGATIVE) and _rows(record, RowKind.SNAPSHOT), record["rank"]
        assert _rows(record, RowKind.EXPANSION), record["rank"]
    loop_rows = [len(_rows(r, RowKind.NEGATIVE)) + len(_rows(r, RowKind.SNAPSHOT)) for r in records]
    expansions = [len(_rows(r, RowKind.EXPANSION)) for r in records]
    assert loop_rows[0] > loop_rows[1] and expansions[1] > expansions[0], (loop_rows, expansions)
    # RLVCR generated the alternative thinking in the same number of (collective) calls on both ranks.
    assert rank0["forcing_calls"] == rank1["forcing_calls"] > 0
    logged = {k: v for r in records for h in r["log_history"] for k, v in h.items()}
    assert logged["rlvcr/expanded_steps"] > 0
    # TracIn rolled out its validation prompts and selected rows on both ranks.
    assert rank0["validation_batches"] == rank1["validation_batches"] >= 1
    selected = [r["tracin_selected"] for r in records]
    assert all(selected) and any(any(s) for s in selected)
    assert "tracin/num_selected" in logged
    moved, start_b = _lora_moved(tmp_path / "run")
    assert start_b == 0.0 and moved > 1e-4


def test_different_numbers_of_user_turns_per_rank_under_zero3(tiny_model_dir, tmp_path):
    """Conversations with further user turns (`_next_user_turn`) on rank 0 only, with rollbacks and negatives, ZeRO-3 +
    LoRA and real (collective) generation calls: rank 1 matches rank 0's extra generation rounds with dummy calls and
    both finish; the user turns are environment tokens of the rollouts' rows."""
    records = launch(
        cpu_config("zero3", tmp_path),
        tmp_path / "run",
        "--model",
        tiny_model_dir,
        "--scenario",
        "rank0_fails",
        "--rows_per_rank",
        "2",
        "--user_turns",
        "--lora",
        "--exercise_model",
        "--max_tool_retries",
        "2",
    )
    _assert_trained(records)
    rank0, rank1 = records
    assert _stat(rank0, "user_turns") == 2 * 2 and _stat(rank1, "user_turns") == 0
    logged = [h for h in rank0["log_history"] if "conversation/user_turns" in h]
    assert logged and sum(h["conversation/user_turns"] for h in logged) == 2 * 2  # summed over the ranks
    assert sum(h["conversation/user_turns_dropped"] for h in logged) == 0
    assert _stat(rank0, "rollback_attempts") > 0
    assert _all_generation_calls(rank0) == _all_generation_calls(rank1)
    assert _stat(rank1, "dummy_generation_calls") > 0
    # The user requests are in rank 0's rows, masked out of the loss.
    user_rows = [r for r in _rows(rank0, RowKind.REGULAR) if "Add one more." in _decode(tiny_model_dir, r)]
    assert len(user_rows) == 2
    for row in user_rows:
        text_mask = list(zip(row["completion"], row["loss_mask"]))
        trained = _decode_ids(tiny_model_dir, [t for t, m in text_mask if m])
        assert "Add one more." not in trained and "And another." not in trained
    moved, _ = _lora_moved(tmp_path / "run")
    assert moved > 1e-4


def _decode_ids(model_dir, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(ids)


def _decode(model_dir, row: dict) -> str:
    return _decode_ids(model_dir, row["completion"])


@pytest.mark.parametrize("where", ["loop", "augment"])
def test_an_error_on_one_rank_stops_every_rank(tiny_model_dir, tmp_path, where):
    """An exception on rank 1 only — in the rollout loop (an environment hook) or in the batch augmentation (a
    per-segment reward) — stops both ranks with an error naming it, under ZeRO-3, instead of leaving rank 0 waiting in
    a collective until the launch times out."""
    out = tmp_path / "run"
    out.mkdir()
    args = ["--model", tiny_model_dir, "--rows_per_rank", "4", "--num_generations", "2"]
    args += ["--scenario", "all_features", "--snapshots", "--fail_on_rank", "1", "--fail_in", where]
    returncode, log = _launch_once(cpu_config("zero3", tmp_path), out, SCRIPT, args, TIMEOUT)
    assert returncode != 0
    errors = {r: (out / f"error_rank{r}.txt").read_text() for r in (0, 1)}
    failure = "environment hook failed on rank 1" if where == "loop" else "segment reward failed on rank 1"
    assert failure in errors[1] and "RuntimeError" in errors[1]
    assert "failed on another process" in errors[0] and failure in errors[0]
    assert not (out / "DONE").exists()


SYNC_TIMEOUT = 300  # seconds per launch of the tests below: model loading, then one generation batch


@pytest.mark.timeout(SYNC_TIMEOUT + 60)
@pytest.mark.parametrize(
    "where,failure,error_type,stage",
    [
        pytest.param(
            "estimator_shape",
            "token-level advantages must have width",
            "ValueError",
            "the advantage estimator",
            id="shape_check_after_the_estimator",
        ),
        pytest.param(
            "estimator_rows",
            "needs one advantage per extra row",
            "ValueError",
            "the advantage estimator",
            id="estimator_rows_without_advantages",
        ),
        pytest.param(
            "rlvcr",
            "RLVCR step parsing failed on rank 1",
            "RuntimeError",
            "the RLVCR estimator",
            id="rlvcr_before_plan",
        ),
    ],
)
def test_a_data_path_error_on_one_rank_stops_every_rank(tiny_model_dir, tmp_path, where, failure, error_type, stage):
    """Issue 35, item 6: the raises inside the distributed data path that 009b255 raised on one rank only (the shape
    check after the estimator's synchronisation, `_append_estimator_rows`'s count check, a failure inside RLVCR before
    its own `reduce(plan)`) stop both ranks with the same error: rank 1 its own, rank 0 a `RuntimeError` naming it.
    Before, rank 0 waited in its next collective until the stack dump (or paired the wrong collectives)."""
    out = tmp_path / "run"
    out.mkdir()
    args = ["--model", tiny_model_dir, "--rows_per_rank", "2", "--num_generations", "2", "--scenario", "rank0_fails"]
    args += ["--fail_on_rank", "1", "--fail_in", where] + (["--rlvcr"] if where == "rlvcr" else [])
    returncode, log = _launch_once(cpu_config("ddp", tmp_path), out, SCRIPT, args, SYNC_TIMEOUT)
    assert returncode != 0
    errors = {r: (out / f"error_rank{r}.txt").read_text() for r in (0, 1) if (out / f"error_rank{r}.txt").exists()}
    assert sorted(errors) == [0, 1], f"a rank did not raise:\n{_tail(log)}"  # a hang would end in the stack dump
    assert failure in errors[1] and error_type in errors[1].strip().splitlines()[-1]
    last = errors[0].strip().splitlines()[-1]
    assert last.startswith("RuntimeError: Stopped because") and stage in last and failure in last
    assert "Timeout (" not in log.read_text(errors="replace")  # no rank reached the stack dump
    assert not (out / "DONE").exists()


def _tracin_index(records: list[dict]) -> dict:
    """Scored rows keyed by content: (prompt, completion, kind) -> sorted [(score, selected)]."""
    index = defaultdict(list)
    for record in records:
        for r in record["tracin_rows"]:
            index[(tuple(r["prompt"]), tuple(r["completion"]), r["kind"])].append((r["score"], r["selected"]))
    return {k: sorted(v) for k, v in index.items()}


def _tracin_run(tiny_model_dir, tmp_path, name: str, processes: int, selection: list[str]) -> list[dict]:
    """The parity scenario with TracIn (fused step): 12 rollouts in one generation batch, SGD, no clipping."""
    common = [
        *_parity_args(tiny_model_dir),
        "--lora",
        "--tracin",
        "--exercise_model",
        "--optim",
        "sgd",
        "--learning_rate",
        "0.1",
        *selection,
    ]
    config = cpu_config(name, tmp_path, processes) if processes == 1 else cpu_config(name, tmp_path)
    # The same 2 validation prompts and 12 training rollouts in both layouts.
    per_process = [
        "--per_device_train_batch_size",
        str(12 // processes),
        "--tracin_val_batch_size",
        str(2 // processes),
    ]
    out = tmp_path / f"{name}_{processes}"
    return launch(config, out, *common, *per_process) + [out]


@pytest.mark.timeout(3 * TIMEOUT + 120)  # three launches (1 process, ZeRO-2, ZeRO-3), each under its own TIMEOUT
@pytest.mark.parametrize(
    "selection",
    [
        pytest.param([], id="positive"),
        # V's row weights: per-row (`grpo`) and per-micro-batch token (`bnpo`) losses normalise by counts a process
        # alone does not know (they weighed V 0.75x on 2 processes, `bnpo` in another direction); `dapo` by the batch's.
        pytest.param(["--loss_type", "grpo"], id="positive_grpo"),
        # One row in all (ceil(0.05 * 17)): one process selects nothing and must still step with the other.
        pytest.param(
            ["--tracin_selection", "top_fraction", "--tracin_top_fraction", "0.05", "--tracin_min_selected", "0"]
            + ["--loss_type", "bnpo"],
            id="one_rank_selects_nothing_bnpo",
        ),
    ],
)
def test_tracin_scores_and_selection_match_one_process(tiny_model_dir, tmp_path, selection):
    """TracIn under DeepSpeed ZeRO-2 and ZeRO-3 (2 processes) against 1 process on the same global batch: the same
    per-row influence scores (1e-6 relative), the same validation gradient V, the same selected rows, and the same
    adapter after the step, for `dapo`, `grpo` and `bnpo`. Rank 0 has 3 negative rows and rank 1 has 2, so the ranks
    also carry padding rows."""
    *single, single_out = _tracin_run(tiny_model_dir, tmp_path, "single", 1, selection)
    ref = _tracin_index(single)
    assert len(ref) == 12 + 5
    scale = max(abs(score) for v in ref.values() for score, _ in v)
    assert scale > 0
    v_ref = torch.tensor(single[0]["tracin_direction"])
    from safetensors.torch import load_file

    adapter_ref = load_file(single_out / "final" / "adapter_model.safetensors")
    moved, _ = _lora_moved(single_out)
    assert moved > 1e-4
    n_selected = sum(chosen for v in ref.values() for _, chosen in v)
    top = "--tracin_selection" in selection
    assert n_selected == (1 if top else sum(score > 0 for v in ref.values() for score, _ in v))
    for zero in ("zero2", "zero3"):
        *records, out = _tracin_run(tiny_model_dir, tmp_path, zero, 2, selection)
        assert "DEEPSPEED" in records[0]["distributed_type"]
        _assert_trained(records)
        ours = _tracin_index(records)
        assert ours.keys() == ref.keys(), zero
        for key, expected in ref.items():
            assert [chosen for _, chosen in ours[key]] == [chosen for _, chosen in expected], (zero, key)
            for (score, _), (ref_score, _) in zip(ours[key], expected):
                assert abs(score - ref_score) <= 1e-6 * scale, (zero, score, ref_score)
        per_rank = [sum(r["selected"] for r in record["tracin_rows"]) for record in records]
        assert sum(per_rank) == n_selected, per_rank
        if top:
            assert 0 in per_rank, per_rank  # the case under test: one process trained on no row
        for record in records:
            v = torch.tensor(record["tracin_direction"])
            assert torch.allclose(v, v_ref, rtol=0, atol=1e-4 * v_ref.abs().max().item()), zero
        adapter = load_file(out / "final" / "adapter_model.safetensors")
        assert adapter.keys() == adapter_ref.keys()
        for key, value in adapter_ref.items():
            assert torch.allclose(adapter[key], value, rtol=0, atol=1e-7), (zero, key)


def test_unequal_generation_calls_get_their_own_vllm_server_outputs(tmp_path):
    """TRL's vLLM server mode slices the gathered outputs by `process_index * len(prompts)`: with 3 contexts on rank 0
    and 1 on rank 1, rank 1 receives one of rank 0's completions. `TrainerBackend` pads the calls to equal counts."""
    records = launch(
        cpu_config("ddp", tmp_path),
        tmp_path / "run",
        script=SCRIPTS / "vllm_server_slicing.py",
        dumps="slicing_rank*.json",
    )
    assert [r["num_processes"] for r in records] == [2, 2] and all(r["equal_counts"] for r in records)
    assert records[1]["raw_ok"] is False  # the TRL behaviour the padding exists for
    assert all(r["fixed_ok"] and r["helper_ok"] for r in records), [r["fixed"] for r in records]
    assert records[0]["fixed"] == [[1003, 7], [1002, 9], [1001, 10]] and records[1]["fixed"] == [[1004, 14]]
    assert all(lp == [-0.5, -0.25] for r in records for lp in r["fixed_logprobs"])


@pytest.mark.parametrize("launcher, warmstart_steps", [("ddp", 0), ("zero2", 2), ("zero3", 2)])
def test_cli_trains_under_accelerate_launch(tiny_model_dir, tmp_path, launcher, warmstart_steps):
    """`accelerate launch --config_file configs/accelerate/<launcher>.yaml -m trl_agentic train --config <task>.yaml`
    (CPU copy, 2 processes) on the tiny model with rollback and negatives: trains one step and saves the LoRA adapter.
    Under DeepSpeed with the warm start first (SFT, then GRPO in the same processes: two trainers, two engines)."""
    out = tmp_path / "out"
    task_config = {
        "task": "calculator",
        "num_train_tasks": 8,
        "num_eval_tasks": 2,
        "model_name_or_path": tiny_model_dir,
        "use_peft": True,
        "lora_r": 4,
        "lora_alpha": 8,
        "lora_target_modules": "all-linear",
        "output_dir": str(out),
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "max_steps": 1,
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 32,
        "enable_tool_rollback": True,
        "save_negative_samples": True,
        "warmstart_steps": warmstart_steps,
        "warmstart_batch_size": 4,
    }
    config_path = tmp_path / "task.yaml"
    config_path.write_text(yaml.safe_dump(task_config))
    launch(cpu_config(launcher, tmp_path), tmp_path, "train", "--config", str(config_path), script=None)
    log = (tmp_path / "launch.log").read_text(errors="replace")
    assert f"Model saved to {out}." in log
    from safetensors.torch import load_file

    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(torch.isfinite(v).all() for v in adapter.values())
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    if warmstart_steps:  # GRPO continued the warm-start adapter (lora_B starts at zero; SFT moved it)
        assert "Warm start done" in log and "Stage 2/2: GRPO" in log
        assert max(v.abs().max().item() for k, v in adapter.items() if "lora_B" in k) > 0
