"""`AsyncAgenticGRPOTrainer` in real asynchronous runs against a real vLLM CPU server started here.

The policy is the vLLM tier's tiny calculator policy (`vllm_helpers.build_calculator_policy`: whole turns as single
tokens, a failing call `1/0`, a good call, an answer), so rollbacks happen in every step; the embedded SmolLM2 is used
by the example and the benchmark (docs/async.md says why: it never calls the tool before a warm start).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(calculator_policy_dir, tmp_path_factory):
    from trl_agentic.async_grpo.server import VLLMServer

    log = tmp_path_factory.mktemp("async-vllm") / "server.log"
    with VLLMServer(calculator_policy_dir, max_lora_rank=8, max_loras=6, log_path=str(log)) as s:
        yield s


def _negatives(rows):
    from trl_agentic.rollout.types import RowKind

    return [r for r in rows if r["kind"] == RowKind.NEGATIVE]


def test_rollback_and_negative_rows_fire_in_an_async_run(server, calculator_policy_dir, tmp_path):
    import requests
    from async_helpers import async_config, build, logged, rollback_overrides, total

    from trl_agentic.advantages import group_advantages, negative_sample_rewards
    from trl_agentic.rollout.types import RowKind

    # The expected advantages below are over every row of a group (episodes and negatives): the seed's `all_rows`.
    args = async_config(tmp_path / "out", server.url, **rollback_overrides(group_baseline="all_rows"))
    trainer = build(calculator_policy_dir, args)
    loads = []
    original = trainer.vllm_client.load_lora_adapter

    def recording(name, path, *a, **k):
        loads.append(name)
        return original(name, path, *a, **k)

    trainer.vllm_client.load_lora_adapter = recording
    trainer.train()
    rows = trainer._observed_rows
    assert trainer.state.global_step == 2
    # vLLM #42125: a new adapter name at every sync (one cold sync at train begin, one per step), never TRL's fixed
    # `trl-policy` (a second run against this server would collide with it).
    base = trainer._lora_name
    assert base.startswith("trl-policy-") and loads == [f"{base}-v{n}" for n in (1, 2, 3)]
    served = {m["id"] for m in requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    assert f"{base}-v3" in served
    assert {r["policy_versions"][0] for r in rows} <= {1, 2, 3}
    # Rollbacks ran in the worker and produced negative rows that reached the trainer.
    assert total(trainer, "rollback/attempts_total") > 0
    negatives = _negatives(rows)
    assert negatives, "no negative row reached the trainer"
    penalty = negative_sample_rewards([["ZeroDivisionError"]], args.negative_sample_reward, None)[0]
    assert all(r["reward"] == penalty and r["advantage"] <= 0.0 for r in negatives)
    # Variable-size groups: a group with a negative row has more rows than conversations.
    by_group: dict[int, list] = {}
    for r in rows:
        by_group.setdefault(r["group_id"], []).append(r)
    # Complete: every row the worker pushed for the group reached the trainer (not left in the queue at the end).
    complete = [g for g in by_group.values() if len(g) == g[0]["group_rows"]]
    assert any(len([r for r in g if r["kind"] == RowKind.NEGATIVE]) for g in by_group.values())
    # The advantages are the synchronous trainer's: group_advantages over (episodes + negatives) of each full group.
    # A group whose baseline held a row that was not pushed (a lost rollout's regular row) cannot be recomputed here.
    complete = [g for g in complete if g[0]["baseline_rows"] == len(g)]
    for g in complete:
        regular = [r for r in g if r["kind"] == RowKind.REGULAR]
        if len(regular) != args.num_generations:
            continue  # a group split across steps by the stale-drop or the step boundary is not checked here
        rewards = [r["reward"] for r in g]
        import torch

        expected = group_advantages(torch.tensor(rewards), torch.zeros(len(g), dtype=torch.long))
        expected = [min(e, 0.0) if r["kind"] == RowKind.NEGATIVE else e for e, r in zip(expected.tolist(), g)]
        assert [r["advantage"] for r in g] == pytest.approx(expected, abs=1e-5)
    # A negative row trains its failed turn only: one run of model tokens, then the masked error result where it fits
    # the budget (left out where it does not, as the regular row leaves it out: it follows every trained token).
    for r in negatives:
        trained = np.nonzero(r["completion_mask"])[0]
        assert len(trained) >= 1 and (np.diff(trained) == 1).all()
    # Staleness per row kind is logged, and every row kind obeys max_staleness.
    assert logged(trainer, "sample/staleness_negative_max")
    assert all(r["staleness"] <= args.max_staleness for r in rows)
    assert all(r["model_version"] <= r["policy_versions"][0] for r in rows)


def test_refused_adapter_load_is_a_clear_error_and_resume_continues(server, calculator_policy_dir, tmp_path):
    """The server refuses a policy's adapter (a name it already holds: HTTP 400); the step-1 checkpoint survives and a
    resumed run trains on from it, publishing its adapters under a new name."""
    import torch
    from async_helpers import async_config, build, rollback_overrides
    from safetensors.torch import load_file

    out = tmp_path / "out"
    args = async_config(out, server.url, save_strategy="steps", save_steps=1, **rollback_overrides())
    trainer = build(calculator_policy_dir, args)
    steps = []

    def refuse_second_step(*a, **k):
        steps.append(trainer.state.global_step)
        if trainer.state.global_step == 2:
            trainer.model_version -= 1  # the next sync republishes a name the server holds: vLLM answers 400
        return original(*a, **k)

    original = trainer._sync_weight
    trainer._sync_weight = refuse_second_step  # instance attribute: TRL's step callback holds the bound method
    for cb in trainer.callback_handler.callbacks:
        if getattr(cb, "fn", None) is not None and getattr(cb.fn, "__name__", "") == "_sync_weight":
            cb.fn = refuse_second_step
    with pytest.raises(RuntimeError, match="refused the policy of version .*resume_from_checkpoint"):
        trainer.train()
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / "adapter_model.safetensors").exists() and (checkpoint / "rollout_state.json").exists()
    saved = load_file(str(checkpoint / "adapter_model.safetensors"))

    resumed = build(calculator_policy_dir, async_config(out, server.url, save_strategy="no", **rollback_overrides()))
    assert resumed._lora_name != trainer._lora_name
    loaded = {}
    original_load = resumed._load_from_checkpoint

    def capture(*a, **k):
        result = original_load(*a, **k)
        for name, p in resumed.model.named_parameters():
            if "lora_" in name:
                loaded[name] = p.detach().clone()
        return result

    resumed._load_from_checkpoint = capture
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    # The resumed run started from the checkpoint's adapter weights.
    assert loaded and len(saved) == len(loaded)
    for key, value in saved.items():
        match = [n for n in loaded if n.replace(".default", "").endswith(key.removeprefix("base_model.model."))]
        assert match, key
        assert torch.equal(loaded[match[0]], value)


def test_killed_server_is_a_clear_error(calculator_policy_dir, tmp_path):
    """A server killed mid-run: training stops with an error naming the server and the checkpoints, not a hang."""
    import threading

    from async_helpers import async_config, build, rollback_overrides

    from trl_agentic.async_grpo.server import VLLMServer

    with VLLMServer(calculator_policy_dir, max_lora_rank=8, max_loras=6, log_path=str(tmp_path / "s.log")) as doomed:
        out = tmp_path / "out"
        args = async_config(out, doomed.url, max_steps=50, save_strategy="steps", save_steps=1, **rollback_overrides())
        trainer = build(calculator_policy_dir, args)

        def kill_after_first_checkpoint():
            while not (out / "checkpoint-1").exists():
                threading.Event().wait(0.2)
            doomed.kill()

        threading.Thread(target=kill_after_first_checkpoint, daemon=True).start()
        with pytest.raises(RuntimeError, match=f"vLLM server at {doomed.url} failed.*resume_from_checkpoint"):
            trainer.train()
    assert (out / "checkpoint-1" / "adapter_model.safetensors").exists()


def test_user_turns_and_a_token_level_estimator_in_an_async_run(server, calculator_policy_dir, tmp_path):
    from async_helpers import HOST_GENERATIONS, TwoQuestionCalculatorEnv, async_config, build, total

    HOST_GENERATIONS.clear()
    args = async_config(tmp_path / "out", server.url, advantage_estimator="async_helpers:scaled_token_estimator")
    trainer = build(calculator_policy_dir, args, environment_factory=TwoQuestionCalculatorEnv)
    trainer.train()
    assert trainer.state.global_step == 2
    assert total(trainer, "conversation/user_turns_total") > 0
    # The estimator's host generated from the server with the policy's current adapter (what RLVCR's alternative
    # thinking uses), at most the requested 3 tokens, with their sampling log-probs.
    assert HOST_GENERATIONS
    base = trainer._lora_name
    for model, ids, logprobs in HOST_GENERATIONS:
        assert model.startswith(f"{base}-v") and 1 <= len(ids) <= 3 and len(logprobs) == len(ids)
    rows = trainer._observed_rows
    token_rows = [r for r in rows if isinstance(r["advantage"], np.ndarray)]
    assert token_rows and len(token_rows) == len(rows)
    for r in token_rows:
        trained = np.nonzero(r["completion_mask"])[0]
        values = r["advantage"][trained]
        assert values[0] == pytest.approx(2 * values[-1]) or len(set(values.tolist())) == 1
        assert (r["advantage"][: trained[0]] == 0).all()  # nothing on the prompt


def test_tracin_filtered_step_in_an_async_run(server, calculator_policy_dir, tmp_path):
    from async_helpers import async_config, build, calculator_dataset, logged, rollback_overrides

    args = async_config(
        tmp_path / "out",
        server.url,
        tracin_enabled=True,
        # 2 x 8 validation trajectories, run together: with the tiny policy's ~30 % tool-call bonus (`build`'s
        # `ToolCallBonusCalculatorEnv`: any call that returned) a group without reward spread is likely at 4 rollouts
        # (0.7^4 = 0.24, and V would be 0), at 8 it is 0.06 per group.
        tracin_val_batch_size=2,
        tracin_val_num_generations=8,
        tracin_val_refresh_steps=2,  # V at step 0 only
        tracin_selection="top_fraction",
        tracin_top_fraction=0.5,
        gradient_checkpointing=True,  # TRL's asynchronous default (non-reentrant): the filter's passes run checkpointed
        **rollback_overrides(),
    )
    trainer = build(calculator_policy_dir, args, tracin_eval_dataset=calculator_dataset(4))
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.accelerator.unwrap_model(trainer.model).is_gradient_checkpointing
    assert not trainer._tracin.disable_checkpointing
    selected = logged(trainer, "tracin/num_selected")
    assert len(selected) == 2 and all(1 <= n <= 4 for n in selected)  # half of each micro-batch of 8 rows
    (norm,) = logged(trainer, "tracin/val_grad_norm")
    assert norm > 0  # V is not zero: the selection below is TracIn's, not the keep-everything rule
    assert len(logged(trainer, "perf/tracin_refresh_s")) == len(logged(trainer, "perf/tracin_val_rollout_s")) == 1
    kinds = [row["kind"] for row in trainer._tracin.val_rows]
    assert kinds.count(0) == 16  # a regular row per validation trajectory (2 x 8, run together) ...
    assert set(kinds) <= {0, 1}  # ... and the negative rows of their rolled-back turns, as in training
    last = trainer._tracin.last
    assert int(last["selected"].sum()) == 4 and last["scores"].shape == (8,)


def _matched_snapshots(rows):
    """Snapshot rows whose episode's regular (last-segment) row was also consumed."""
    from trl_agentic.rollout.types import RowKind

    episodes = {(r["group_id"], r["episode"]) for r in rows if r["kind"] == RowKind.REGULAR}
    return [r for r in rows if r["kind"] == RowKind.SNAPSHOT and (r["group_id"], r["episode"]) in episodes]


def _stop_once_snapshot_matched(trainer):
    from transformers import TrainerCallback

    class StopOnceSnapshotMatched(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if _matched_snapshots(trainer._observed_rows):
                control.should_training_stop = True

    return StopOnceSnapshotMatched()


def test_context_snapshots_in_an_async_run(tmp_path_factory):
    """A policy that calls `delete_context`: each deletion closes a segment, which reaches the trainer as a snapshot
    row of its group carrying its episode's reward and advantage (TRL's fork: one advantage per conversation)."""
    from async_helpers import SNAPSHOT_TURNS, async_config, build, total
    from vllm_helpers import build_calculator_policy

    from trl_agentic.async_grpo.server import VLLMServer
    from trl_agentic.rollout.types import RowKind

    folder = tmp_path_factory.mktemp("snap")
    policy = build_calculator_policy(folder / "snapshot-policy", turn_tokens=SNAPSHOT_TURNS, biases=(0.9, 0.9, 0.7))
    # The tool schemas of `calculate` and `delete_context` make a ~2000-token prompt with the byte-level tokenizer.
    log = str(folder / "server.log")
    with VLLMServer(policy, max_lora_rank=8, max_loras=6, max_model_len=4096, max_num_seqs=8, log_path=log) as server:
        args = async_config(
            folder / "out", server.url, max_steps=12, enable_context_snapshots=True, max_snapshots_per_episode=4
        )
        trainer = build(policy, args)
        # Which rows the first steps consume depends on the order in which rollouts finish (about 1 produced row in 14
        # is a snapshot; a fixed 3 steps once consumed none): train until a snapshot row and a row of its episode
        # reached the trainer, at most 12 steps.
        trainer.add_callback(_stop_once_snapshot_matched(trainer))
        trainer.train()
    assert _matched_snapshots(trainer._observed_rows), "no snapshot row with its episode reached the trainer"
    assert total(trainer, "snapshots/closed_total") > 0
    rows = trainer._observed_rows
    snapshots = [r for r in rows if r["kind"] == RowKind.SNAPSHOT]
    assert snapshots, "no snapshot row reached the trainer"
    matched = 0
    for snap in snapshots:
        episode = [
            r
            for r in rows
            if r["kind"] == RowKind.REGULAR and (r["group_id"], r["episode"]) == (snap["group_id"], snap["episode"])
        ]
        # snapshot_advantage="episode": outside the baseline, its episode's reward -> its episode's advantage
        if episode:  # the episode's last segment may sit in a micro-batch after the last step
            assert episode[0]["reward"] == snap["reward"]
            assert episode[0]["advantage"] == pytest.approx(snap["advantage"], abs=1e-6)
            matched += 1
        assert snap["completion_mask"].sum() > 0
    assert matched >= 1


def test_every_feature_on_the_embedded_model(tmp_path_factory):
    """SmolLM2-135M (the embedded model) + LoRA against a real server, every feature switched on at once: rollback,
    negatives, snapshots, further user turns, the RLVCR estimator and the TracIn filter. The untrained model rarely
    calls a tool, so this checks that one asynchronous step runs end to end with all of them, not that they fire (the
    tests above make each fire on a tiny policy)."""
    from async_helpers import TwoQuestionCalculatorEnv, async_config, build, calculator_dataset, logged

    from trl_agentic.async_grpo.server import VLLMServer
    from trl_agentic.models import resolve_model_path

    folder = tmp_path_factory.mktemp("smollm2")
    model = resolve_model_path("smollm2-135m")
    with VLLMServer(model, max_lora_rank=8, max_loras=6, log_path=str(folder / "server.log")) as server:
        args = async_config(
            folder / "out",
            server.url,
            max_steps=1,
            per_device_train_batch_size=4,
            num_generations=2,
            max_completion_length=32,
            max_tool_calling_iterations=2,
            enable_tool_rollback=True,
            rollback_on_errors=["ValueError", "ZeroDivisionError", "ToolCallParseError"],
            save_negative_samples=True,
            enable_context_snapshots=True,
            advantage_estimator="rlvcr",
            tracin_enabled=True,
            tracin_val_batch_size=1,
            tracin_val_num_generations=2,
            # One step needs 4 rows: generating no further keeps the server off the core(s) the step trains on.
            max_inflight_tasks=2,
            queue_maxsize=4,
        )
        trainer = build(
            model, args, environment_factory=TwoQuestionCalculatorEnv, tracin_eval_dataset=calculator_dataset(2)
        )
        trainer.train()
    assert trainer.state.global_step == 1
    assert logged(trainer, "tracin/num_selected") and logged(trainer, "rlvcr/invalid_format")
    # Each rollout's first turn either ends in an answer, and then the environment's second question is asked or
    # dropped for lack of room, or is cut by the 32-token budget (then no question: the rollout ends), or calls a tool.
    # Which one the untrained model samples varies from run to run (stop 47's CI sampled only cut turns), so this
    # checks that the counters of the step's rollouts saw one of the first two; that the question is asked whenever
    # an answer ends is checked on a policy that answers, test_user_turns_and_a_token_level_estimator_in_an_async_run.
    asked = logged(trainer, "conversation/user_turns_total") + logged(trainer, "conversation/user_turns_dropped_total")
    assert sum(asked) + sum(logged(trainer, "tools/truncated_turns_total")) > 0


def test_mask_truncated_completions_in_an_async_run(server, calculator_policy_dir, tmp_path):
    """`mask_truncated_completions` (TRL's asynchronous config has no such field) in a real run: a 2-token budget
    cuts many conversations (counted by the worker); none of their rows reaches the trainer (every regular row that
    does ends with a stop token, TRL's rule), while their rewards stayed in their groups' statistics (`baseline_rows`
    above the rows pushed). With every feature off the worker's class is ours too."""
    from async_helpers import async_config, build, rollback_overrides, total

    from trl_agentic.async_grpo.worker import AgenticAsyncRolloutLoop
    from trl_agentic.rollout.types import RowKind

    args = async_config(
        tmp_path / "out", server.url, max_completion_length=2, mask_truncated_completions=True, **rollback_overrides()
    )
    trainer = build(calculator_policy_dir, args)
    assert trainer.rollout_worker._loop_kwargs["mask_truncated_completions"] is True
    trainer.train()
    assert trainer.state.global_step == 2
    stops = {*trainer.eos_token_ids, trainer.processing_class.pad_token_id}
    regular = [r for r in trainer._observed_rows if r["kind"] == RowKind.REGULAR]
    assert regular and all(int(r["input_ids"][-1]) in stops for r in regular)
    assert total(trainer, "tools/truncated_turns_total") > 0
    assert any(r["baseline_rows"] > r["group_rows"] for r in trainer._observed_rows)

    off = async_config(tmp_path / "off", server.url, mask_truncated_completions=True)
    plain = build(calculator_policy_dir, off)
    assert plain.rollout_worker._loop_cls is AgenticAsyncRolloutLoop
    assert plain.rollout_worker._loop_kwargs["mask_truncated_completions"] is True


def test_max_turn_tokens_in_an_async_run(server, calculator_policy_dir, tmp_path):
    """`max_turn_tokens=1` in a real run: every request asks vLLM for one token (the tiny policy's turns are one or
    two turn tokens and an end of turn), so every trained row holds exactly one generated token per turn, and the
    worker counts the turns the cap cut."""
    from async_helpers import async_config, build, total

    from trl_agentic.rollout.types import RowKind

    args = async_config(tmp_path / "out", server.url, max_turn_tokens=1, max_steps=1)
    trainer = build(calculator_policy_dir, args)
    trainer.train()
    regular = [r for r in trainer._observed_rows if r["kind"] == RowKind.REGULAR]
    assert regular and all(int(np.asarray(r["completion_mask"]).sum()) == 1 for r in regular)
    assert total(trainer, "tools/turn_cap_truncations_total") > 0


def test_a_warm_start_is_served_merged_in_an_async_run(tmp_path, capsys):
    """`trl-agentic train` with `trainer: async_grpo` and `warmstart_steps`, for real: the warm start's adapter merged
    into `output_dir/warmstart-merged`, a vLLM server started on that folder, one asynchronous step whose adapter is
    saved on that base (the tiny random Qwen3 and its byte-level tokenizer, with heads of 32, which vLLM's CPU
    attention supports: it has no kernel for the tiny model's 16)."""
    import json
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from trl_agentic.cli import main
    from trl_agentic.models import build_tiny_model

    tiny = build_tiny_model(tmp_path / "tiny")
    config = Qwen3ForCausalLM.from_pretrained(tiny).config
    config.hidden_size, config.head_dim, config.intermediate_size = 64, 32, 128
    torch.manual_seed(0)
    model = str(tmp_path / "tiny32")
    Qwen3ForCausalLM(config).save_pretrained(model)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(model)
    out = tmp_path / "out"
    config = Path(__file__).resolve().parents[2] / "configs" / "async_calculator.yaml"
    argv = ["train", "--config", str(config), "--model_name_or_path", model, "--output_dir", str(out)]
    argv += ["--warmstart_steps", "1", "--warmstart_batch_size", "2", "--max_steps", "1", "--disable_tqdm", "true"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "16"]
    argv += ["--max_inflight_tasks", "2", "--queue_maxsize", "4"]
    assert main(argv) == 0
    merged = out / "warmstart-merged"
    assert (merged / "config.json").exists() and not (merged / "adapter_config.json").exists()
    assert not (out / "warmstart-merged-partial").exists()
    # The trained adapter's base is the merged folder, and the server was started on it.
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(merged)
    assert f"Starting a vLLM server for {merged} " in capsys.readouterr().out  # the path `VLLMServer` was given


def test_a_killed_trainer_takes_its_server_down(calculator_policy_dir, tmp_path):
    """The process that started a `VLLMServer` is SIGKILLed (no `finally`, no `stop()`): the server and its engine
    processes (its whole session) exit, instead of holding their memory and cores (seen live: a `trl-agentic train`
    stopped by SIGTERM left its server running)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(
        f"""
        import time
        from trl_agentic.async_grpo.server import VLLMServer
        server = VLLMServer({str(calculator_policy_dir)!r}, max_lora_rank=8, max_loras=6, log_path={str(tmp_path / "s.log")!r})
        server.start()
        print(server.process.pid, flush=True)
        time.sleep(3600)
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        session = int(trainer.stdout.readline())  # the server leads its own session
    except ValueError:  # the server did not start: no pid printed
        trainer.kill()
        raise

    def members():
        pids = []
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, ValueError):
                continue
            if entry.isdigit() and int(fields[3]) == session and fields[0] != "Z":
                pids.append(int(entry))
        return pids

    assert len(members()) >= 3  # the supervisor, the API server and at least its engine process
    trainer.kill()
    trainer.wait()
    deadline = time.monotonic() + 120  # a hang guard: vLLM shuts its engine down on SIGTERM
    while members() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = members()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"server processes outlived the trainer: {left}"


def test_a_sigtermed_trainer_takes_its_rollout_worker_and_server_down(calculator_policy_dir, tmp_path):
    """A real asynchronous run (every feature off: TRL's loop in `TRLRolloutLoop`) against a server it started,
    stopped by SIGTERM mid-training, which runs no `finally`: TRL's rollout worker child exits with it
    (`worker.die_with_trainer`), and so the server's graceful shutdown, which waits for the worker's connections,
    completes and its whole session exits. Before, the worker and the server kept running (seen live). A shutdown that
    still waits (one connection never closed, in CI on 2026-12-04) is cut short by the supervisor's SIGKILL after its
    grace (`server.die_with_parent`; `tests/test_server_lifetime.py` tests that with a server that ignores SIGTERM)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    here = os.path.dirname(__file__)
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {here!r})
        from async_helpers import async_config, build
        from trl_agentic.async_grpo.server import VLLMServer

        server = VLLMServer({str(calculator_policy_dir)!r}, max_lora_rank=8, max_loras=6,
                            log_path={str(tmp_path / "s.log")!r})
        server.start()
        print(server.process.pid, flush=True)
        args = async_config({str(tmp_path / "out")!r}, server.url, max_steps=10_000)
        build({str(calculator_policy_dir)!r}, args).train()
        """
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)

    def stat(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            return None
        return None if fields[0] == "Z" else fields

    def pids(where):
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := stat(p)) is not None and where(s)]

    def spawned(pid):  # a multiprocessing spawn child (TRL's worker), not its resource tracker
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"spawn_main" in f.read()
        except OSError:
            return False

    session, workers = None, []
    try:
        session = int(trainer.stdout.readline())  # the server leads its own session
        deadline = time.monotonic() + 600  # hang guards, not speeds
        while not workers and time.monotonic() < deadline:  # TRL's worker child, spawned by `train()`
            assert trainer.poll() is None, "the trainer exited before its rollout worker started"
            workers = [w for w in pids(lambda s: int(s[1]) == trainer.pid and int(s[3]) != session) if spawned(w)]
            time.sleep(0.5)
        assert workers, "no rollout worker child appeared"
        time.sleep(20)  # the worker has started generating: its connections to the server are open
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=120)
        deadline = time.monotonic() + 180  # vLLM shuts its engine down on SIGTERM
        while (pids(lambda s: int(s[3]) == session) or any(stat(w) for w in workers)) and time.monotonic() < deadline:
            time.sleep(0.5)
        left_workers = [w for w in workers if stat(w)]
        left_server = pids(lambda s: int(s[3]) == session)
        assert not left_workers, f"the rollout worker outlived the trainer: {left_workers}"
        assert not left_server, f"server processes outlived the trainer: {left_server}"
    finally:
        if trainer.poll() is None:
            trainer.kill()
        for pid in workers + (pids(lambda s: int(s[3]) == session) if session else []):
            if stat(pid):
                os.kill(pid, signal.SIGKILL)
