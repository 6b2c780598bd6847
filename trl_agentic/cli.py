"""Command line: `trl-agentic train --config configs/<x>.yaml [--field value ...]` (also `python -m trl_agentic`), and
`trl-agentic eval [--field value ...]`: BFCL multi-turn accuracy per category of a local model or adapter
(`trl_agentic.envs.bfcl.evaluate.BFCLEvalArguments`).

Arguments are parsed with TRL's `TrlParser` into `TaskArguments`, `AgenticGRPOConfig` and TRL's `ModelConfig`, the
convention of `trl grpo --config`: a YAML file gives the values, command-line flags override them. Every config is
validated while it is parsed, so a bad value fails before any model is loaded. Works under
`accelerate launch ... -m trl_agentic train --config ...`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

from .gloo_exit import register_gloo_exit_pause

USAGE = """usage: trl-agentic <command> [options]

commands:
  train --config CONFIG.yaml [--field value ...]   train with AgenticGRPOTrainer (fields of TaskArguments,
                                                   AgenticGRPOConfig and trl.ModelConfig); `trainer: async_grpo`
                                                   selects AsyncAgenticGRPOTrainer (AsyncAgenticGRPOConfig fields)
  eval [--config CONFIG.yaml] [--field value ...]  BFCL multi-turn accuracy per category with the official
                                                   checker (fields of BFCLEvalArguments: --model_name_or_path,
                                                   --adapter_path, --categories, --split, --limit, --output ...)
"""

DEFAULT_MODEL = "smollm2-135m"
TRAINERS = ("grpo", "async_grpo")


@dataclass
class TrainerArguments:
    """Which trainer `trl-agentic train` runs."""

    trainer: str = field(
        default="grpo",
        metadata={
            "help": "'grpo': AgenticGRPOTrainer (TRL's GRPOTrainer); 'async_grpo': AsyncAgenticGRPOTrainer (TRL's "
            "AsyncGRPOTrainer, needs vLLM and a vLLM server; see docs/async.md).",
            "choices": list(TRAINERS),
        },
    )

    def __post_init__(self):
        if self.trainer not in TRAINERS:
            raise ValueError(f"`trainer` must be one of {list(TRAINERS)}, got {self.trainer!r}.")


def trainer_kind(argv: list[str]) -> str:
    """The `trainer` field of a `train` command line (its YAML config, then a `--trainer` flag), validated."""
    from trl import TrlParser

    # Without its own -h: `train --help` reaches the full parser of `make_parser(kind)`.
    parser = TrlParser((TrainerArguments,), prog="trl-agentic train", add_help=False)
    (choice, _) = parser.parse_args_and_config(args=list(argv), return_remaining_strings=True)
    return choice.trainer


def async_model_config():
    """TRL's `ModelConfig` without the fields `AsyncGRPOConfig` has too (`dtype`, `trust_remote_code`): one flag, read
    by the trainer (an argument parser cannot hold two options of one name)."""
    import dataclasses

    from trl import ModelConfig

    from .async_grpo.config import AsyncAgenticGRPOConfig

    taken = {f.name for f in dataclasses.fields(AsyncAgenticGRPOConfig)}
    own = [
        (f.name, f.type, field(default_factory=f.default_factory, metadata=f.metadata))
        if f.default_factory is not dataclasses.MISSING
        else (f.name, f.type, field(default=f.default, metadata=f.metadata))
        for f in dataclasses.fields(ModelConfig)
        if f.name not in taken
    ]
    return dataclasses.make_dataclass(
        "AsyncModelConfig",
        own,
        namespace={"__post_init__": ModelConfig.__post_init__, "__module__": ModelConfig.__module__},
    )


def make_parser(trainer: str | None = None):
    """The `train` parser: `(TaskArguments, AgenticGRPOConfig, ModelConfig)`; with `trainer` given, the config of that
    trainer and a fourth dataclass, `TrainerArguments` (so a YAML `trainer:` key is accepted)."""
    from trl import ModelConfig, TrlParser

    from .tasks import TaskArguments

    if trainer == "async_grpo":
        from .async_grpo.config import AsyncAgenticGRPOConfig as Config
    else:
        from .config import AgenticGRPOConfig as Config
    if trainer is None:
        return TrlParser((TaskArguments, Config, ModelConfig), prog="trl-agentic train")
    if trainer == "async_grpo":
        ModelConfig = async_model_config()  # noqa: N806
    return TrlParser((TaskArguments, Config, ModelConfig, TrainerArguments), prog="trl-agentic train")


def _stage(title: str) -> None:
    print(f"\n=== {title} ===", flush=True)


class _Clock:
    """Wall and CPU time of the pipeline's stages (CPU time of this process, all threads)."""

    def __init__(self):
        self.stages: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.stages[name] = {
                "wall_s": round(time.perf_counter() - wall, 1),
                "cpu_s": round(time.process_time() - cpu, 1),
            }

    def total(self) -> float:
        return round(sum(s["wall_s"] for s in self.stages.values()), 1)


def train(task_args, training_args, model_args):
    """Build the task and the trainer, train, save (and push to the Hub when `push_to_hub`).

    With the `TaskArguments` stage options, the run is the quickstart pipeline: warm start (SFT) → held-out evaluation
    → GRPO → held-out evaluation → adapter, `eval_results.json`, `curves.png`, `report.html`, `trajectories.jsonl`.
    """
    from trl import get_peft_config

    from .models import check_pushable, resolve_model_path
    from .tasks import build_task
    from .trainer import AgenticGRPOTrainer, check_before_model

    clock = _Clock()
    _check_context_deletion(task_args, training_args)
    check_before_model(training_args)  # before the warm start: a typo in an import path costs nothing
    check_pushable(model_args.model_name_or_path or DEFAULT_MODEL, training_args.push_to_hub)
    task = build_task(task_args)
    _check_heldout_problems(
        task,
        task_args,
        heldout_eval=task_args.heldout_eval,
        tracin_enabled=training_args.tracin_enabled,
        eval_strategy=training_args.eval_strategy != "no",
    )
    tracin_validation = _tracin_validation(task, task_args) if training_args.tracin_enabled else None
    with clock("model"):
        model_path = resolve_model_path(model_args.model_name_or_path or DEFAULT_MODEL)
    peft_config = get_peft_config(model_args)
    model_init_kwargs = dict(training_args.model_init_kwargs or {})
    model_init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = model_init_kwargs
    model, processing_class = model_path, None
    eval_results: dict[str, dict] = {}
    eval_records: dict[str, list[dict]] = {}
    warmstart_info = None
    main_process = _is_main_process()

    if task_args.warmstart_steps or task_args.heldout_eval_base_model:
        model, processing_class = _load(model_path, model_init_kwargs)
    if task_args.heldout_eval and task_args.heldout_eval_base_model:
        _stage("Held-out evaluation of the base model")
        with clock("eval_base"):
            _evaluate_into(
                "base model", model, processing_class, task, task_args, training_args, eval_results, eval_records
            )
    if task_args.warmstart_steps:
        _stage(_warm_start_title(task, task_args))
        with clock("warmstart"):
            result = _warm_start(model, processing_class, task, task_args, training_args, peft_config)
        model, peft_config = result.model, None  # GRPO continues training the warm-start adapter
        training_args.model_init_kwargs = None
        losses = [e["loss"] for e in result.log_history if "loss" in e]
        warmstart_info = {
            "steps": task_args.warmstart_steps,
            "traces": result.num_traces,
            "faulty_traces": result.faulty_traces,
            "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None,
        }
        print(f"Warm start done: loss {warmstart_info['first_loss']:.3f} -> {warmstart_info['final_loss']:.3f}.")

    grpo_stage = "Stage 2/2: GRPO" if task_args.warmstart_steps else "GRPO"
    trainer = AgenticGRPOTrainer(
        model=model,
        reward_funcs=task.reward_funcs,
        args=training_args,
        train_dataset=task.train_dataset,
        eval_dataset=task.eval_dataset if training_args.eval_strategy != "no" else None,
        tracin_eval_dataset=tracin_validation,
        environment_factory=task.environment_factory,
        tools=task.tools or None,
        peft_config=peft_config,
        processing_class=processing_class,
    )
    recorder = None
    if task_args.write_report:
        from .reporting import TrajectoryRecorder

        recorder = TrajectoryRecorder(trainer.processing_class).attach(trainer)
    if not training_args.disable_tqdm:
        from .reporting import install_compact_progress

        install_compact_progress(trainer)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    before = "before GRPO" if task_args.warmstart_steps else "before training"
    if task_args.heldout_eval:
        _stage(f"Held-out evaluation {before} ({len(task.eval_dataset)} problems)")
        with clock("eval_before"):
            _evaluate_into(
                before, policy, trainer.processing_class, task, task_args, training_args, eval_results, eval_records
            )

    _stage(
        f"{grpo_stage} with the tool: {training_args.max_steps} steps x {_rollouts_per_step(training_args)} rollouts "
        f"({training_args.num_generations} per problem), rollback "
        f"{'on' if training_args.enable_tool_rollback else 'off'}, negative samples "
        f"{'on' if training_args.save_negative_samples else 'off'}"
    )
    with clock("grpo"):
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if training_args.should_save:  # the process that wrote it (not the first process of every machine)
        print(f"Model saved to {training_args.output_dir}.")

    after = "after GRPO" if task_args.warmstart_steps else "after training"
    if task_args.heldout_eval:
        _stage(f"Held-out evaluation {after}")
        with clock("eval_after"):
            _evaluate_into(
                after, policy, trainer.processing_class, task, task_args, training_args, eval_results, eval_records
            )

    if main_process and (task_args.heldout_eval or task_args.write_report):
        _finish(trainer, task, task_args, training_args, clock, eval_results, eval_records, warmstart_info, recorder)
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def _check_heldout_problems(task, task_args, **needs: bool) -> None:
    """Refuse, before any model loads, a run whose options in `needs` (held-out evaluation, TracIn's validation
    prompts, the trainer's evaluation) need held-out problems when the task has none (they crashed once the model had
    loaded)."""
    if task.eval_dataset is not None and len(task.eval_dataset) > 0:
        return
    names = ", ".join(f"`{name}`" for name, on in needs.items() if on)
    if names:
        source = (
            "`bfcl_heldout_fraction` (with `bfcl_categories` and `bfcl_classes`) leaves no held-out task"
            if task_args.task == "bfcl"
            else f"`num_eval_tasks` is {task_args.num_eval_tasks}"
        )
        raise ValueError(f"{names} needs held-out problems, but the task has none: {source}.")


def _tracin_validation(task, task_args):
    """TracIn's validation prompts, before any model loads: the held-out problems of the task built from `task_seed +
    10` that the run neither evaluates nor trains on (`tasks.validation_rows`). Validating on the evaluated problems
    would let their rewards choose the training rows, and the evaluation would no longer be held out."""
    from .tasks import VALIDATION_SEED_OFFSET, problem_key, validation_rows

    used = {
        problem_key(row)
        for dataset in (task.eval_dataset, task.train_dataset, task.warmstart_dataset)
        if dataset is not None
        for row in dataset
    }
    rows = validation_rows(task_args, used)
    if len(rows):
        return rows
    if task_args.task == "bfcl":
        source, remedy = (
            "the held-out tasks of this `task_seed`'s scenario split that the run does not evaluate",
            "set `num_eval_tasks` below the number of held-out tasks (0 evaluates them all) or raise "
            "`bfcl_heldout_fraction`",
        )
    elif ":" in task_args.task:
        source, remedy = (
            f"the held-out problems of your task built with `task_seed + {VALIDATION_SEED_OFFSET}`, minus those this "
            "run evaluates or trains on (compared by `trl_agentic.tasks.problem_key`: the `expression`, `world`, "
            "`bfcl_id` or `task_seed` column, else the last prompt message)",
            "make your builder draw other held-out problems for another `task_seed`, and give its rows a column "
            "that names the problem (e.g. `task_seed`), or train with the Python API and pass `tracin_eval_dataset`",
        )
    else:
        source, remedy = (
            f"the held-out problems of the task built from `task_seed + {VALIDATION_SEED_OFFSET}` that the run neither "
            "evaluates nor trains on",
            "lower `num_eval_tasks`"
            + (" or raise `textworld_heldout_fraction`" if task_args.task == "textworld" else ""),
        )
    raise ValueError(f"`tracin_enabled` needs validation prompts, {source}, and there are none: {remedy}.")


def _check_context_deletion(task_args, training_args) -> None:
    """Refuse, before any model loads, a log search whose prompts and warm-start traces delete context
    (`logsearch_context_deletion`, the default) in a run without the `delete_context` tool (`enable_context_snapshots`
    off): the warm start would teach calls to a tool the rollouts do not have."""
    if (
        task_args.task == "logsearch"
        and task_args.logsearch_context_deletion
        and not training_args.enable_context_snapshots
    ):
        raise ValueError(
            "`task: logsearch` with `logsearch_context_deletion: true` (the default) needs `enable_context_snapshots: "
            "true` (its prompts and warm-start traces use `delete_context`); set `logsearch_context_deletion: false` "
            "for a run without it."
        )


def _rollouts_per_step(args) -> str:
    """Fresh rollouts per optimizer step: a step trains `gradient_accumulation_steps` micro-batches on every process,
    and each generation batch is trained on `num_iterations` times (TRL's generation batch spans
    `steps_per_generation` micro-batches, which need not be one step's)."""
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    return f"{rows / getattr(args, 'num_iterations', 1):g}"


def train_async(task_args, training_args, model_args):
    """`trainer: async_grpo`: AsyncAgenticGRPOTrainer on the task, against a vLLM server (started here when
    `vllm_server_start`), then the optional held-out evaluations of the synchronous pipeline."""
    from trl import get_peft_config

    from .async_grpo import AsyncAgenticGRPOTrainer
    from .async_grpo.server import VLLMServer
    from .async_grpo.trainer import check_before_model
    from .models import check_pushable, resolve_model_path
    from .tasks import build_task

    clock = _Clock()
    _check_context_deletion(task_args, training_args)
    # Before the warm start and the server: the trainer checks them again (it may be built without the CLI).
    check_before_model(training_args)
    check_pushable(model_args.model_name_or_path or DEFAULT_MODEL, training_args.push_to_hub)
    if training_args.push_to_hub and task_args.warmstart_steps:
        raise ValueError(
            "`push_to_hub=True` with `warmstart_steps` and `trainer: async_grpo`: GRPO trains a new adapter on the "
            "merged warm-start model, a folder on this machine (`warmstart-merged`), so the pushed adapter's base "
            "model would be a path nobody else can load. Push from the synchronous trainer, or without a warm start."
        )
    task = build_task(task_args)
    _check_heldout_problems(
        task, task_args, heldout_eval=task_args.heldout_eval, tracin_enabled=training_args.tracin_enabled
    )
    tracin_validation = _tracin_validation(task, task_args) if training_args.tracin_enabled else None
    model_path = resolve_model_path(model_args.model_name_or_path or DEFAULT_MODEL)
    peft_config = get_peft_config(model_args)
    if task_args.warmstart_steps:
        model_path = _async_warm_start(task, task_args, training_args, model_path, peft_config)
    server = None
    if training_args.vllm_server_start and _is_main_process():
        rank = peft_config.r if peft_config is not None else 8
        server = VLLMServer(
            model_path,
            max_lora_rank=rank,
            max_loras=training_args.max_staleness + 2,
            log_path=os.path.join(training_args.output_dir, "vllm-server.log"),
            dtype=str(training_args.dtype).removeprefix("torch."),  # the trainer's: both see the same weights
        )
        os.makedirs(training_args.output_dir, exist_ok=True)
        _stage(f"Starting a vLLM server for {model_path} (log: {server.log_path})")
        training_args.vllm_server_base_url = server.start().url
    try:
        trainer = AsyncAgenticGRPOTrainer(
            model=model_path,
            reward_funcs=task.reward_funcs,
            args=training_args,
            train_dataset=task.train_dataset,
            tracin_eval_dataset=tracin_validation,
            environment_factory=task.environment_factory,
            tools=task.tools or None,
            peft_config=peft_config,
        )
        _stage(f"Asynchronous GRPO: {training_args.max_steps} steps against {training_args.vllm_server_base_url}")
        with clock("grpo"):
            trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model(training_args.output_dir)
    finally:
        if server is not None:
            server.stop()
    if task_args.heldout_eval:
        # Every process enters (`_evaluate_into` evaluates on the main one; the others wait for it there).
        results, records = {}, {}
        policy = trainer.accelerator.unwrap_model(trainer.model)
        _stage(f"Held-out evaluation after training ({len(task.eval_dataset)} problems)")
        with clock("eval_after"):
            _evaluate_into(
                "after training", policy, trainer.processing_class, task, task_args, training_args, results, records
            )
        if _is_main_process():  # `write_report` is refused for this trainer (`main`): `eval_results.json` only
            _finish(trainer, task, task_args, training_args, clock, results, records, None, None)
    return trainer


def _warm_start_title(task, task_args, then: str = "") -> str:
    """The warm start's stage title: the traces a task's own episodes give are solved ones, without rejected calls
    (only the arithmetic trace generator writes them, `warmstart_error_fraction`)."""
    own = task.make_traces is not None
    errors = "" if own else f", {task_args.warmstart_error_fraction:.0%} with a rejected call first"
    return (
        f"Stage 1/2: warm start — SFT on {task_args.warmstart_steps * task_args.warmstart_batch_size} "
        f"{'solved' if own else 'synthetic tool-use'} traces ({task_args.warmstart_steps} steps{errors}){then}"
    )


def _async_warm_start(task, task_args, training_args, model_path: str, peft_config) -> str:
    """Stage 1 of `trainer: async_grpo` with `warmstart_steps`: the synchronous pipeline's SFT warm start, its adapter
    merged into a model folder (`output_dir/warmstart-merged`) that the vLLM server serves and the asynchronous
    trainer loads. GRPO then trains a new LoRA adapter on the merged weights (the synchronous pipeline continues the
    warm-start adapter instead): the same starting policy, a fresh adapter. A resumed run reuses the folder (its
    checkpoint's adapter was trained on those weights) and refuses to run without it."""
    import gc
    import shutil

    import torch
    from accelerate import PartialState

    from .warmstart import save_merged

    folder = _merged_warm_start(training_args)
    if training_args.resume_from_checkpoint:  # `main` checked that the folder is there
        _stage(f"Stage 1/2: warm start — reusing the merged model in {folder} (resumed run)")
        return folder
    model, tokenizer = _load(model_path, {"dtype": training_args.dtype})
    _stage(_warm_start_title(task, task_args, ", merged into a model folder for the vLLM server"))
    result = _warm_start(model, tokenizer, task, task_args, training_args, peft_config)
    losses = [e["loss"] for e in result.log_history if "loss" in e]
    state = PartialState()
    # One writer: per node with `save_on_each_node` (nodes without a shared disk), else the main process (TRL's rule).
    if state.is_local_main_process if training_args.save_on_each_node else state.is_main_process:
        partial = folder + "-partial"
        shutil.rmtree(partial, ignore_errors=True)
        save_merged(result.model, tokenizer, partial)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(partial, folder)  # never a half-written folder where a server or a resumed run looks
    state.wait_for_everyone()
    del model, result
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the vLLM server may start on this GPU next
    print(f"Warm start done: loss {losses[0]:.3f} -> {losses[-1]:.3f}; merged model in {folder}.")
    return folder


def _warm_start(model, tokenizer, task, task_args, training_args, peft_config):
    """The SFT warm start of both pipelines (`run_task_warmstart` with the run's settings)."""
    from .warmstart import run_task_warmstart

    result = run_task_warmstart(
        model,
        tokenizer,
        task,
        task_args,
        peft_config=peft_config,
        output_dir=os.path.join(training_args.output_dir, "warmstart"),
        seed=training_args.seed,
        use_cpu=training_args.use_cpu,
        bf16=training_args.bf16,
        compact_progress=not training_args.disable_tqdm,
        # The GRPO prompts' tools, template arguments and tool-result cut: the warm start trains what rollouts see.
        context_snapshots=training_args.enable_context_snapshots,
        template_kwargs=training_args.chat_template_kwargs,
        max_tool_output_chars=training_args.max_tool_output_chars,
    )
    _warn_traces_over_budget(result, training_args.max_completion_length)
    return result


def _warn_traces_over_budget(result, budget: int) -> None:
    """Say when warm-start traces are longer than the GRPO budget: a rollout cuts what they teach."""
    over = [n for n, _ in result.completion_tokens if n > budget]
    if over:
        warnings.warn(
            f"{len(over)} of {len(result.completion_tokens)} warm-start traces are longer than `max_completion_length` "
            f"({budget} tokens; the longest {max(over)}): a rollout is cut where they go on, so what they teach past "
            "the budget cannot score. Raise the budget, or shorten the traces (e.g. `warmstart_error_fraction`).",
            stacklevel=2,
        )


def _merged_warm_start(training_args) -> str:
    """The folder of `trainer: async_grpo`'s merged warm start; raises when a resumed run would need it and it is
    missing (checked before any model loads)."""
    folder = os.path.join(training_args.output_dir, "warmstart-merged")
    if training_args.resume_from_checkpoint and not os.path.isfile(os.path.join(folder, "config.json")):
        raise ValueError(
            f"`resume_from_checkpoint` with `warmstart_steps`: the warm-started model {folder} is missing, and a warm "
            "start trained again need not give the weights the checkpoint's adapter was trained on."
        )
    return folder


def _is_main_process() -> bool:
    from accelerate import PartialState

    return PartialState().is_main_process


def _load(model_path: str, model_init_kwargs: dict):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {k: v for k, v in model_init_kwargs.items() if k != "device_map"}
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left", truncation_side="left")
    if tokenizer.pad_token is None:  # as GRPO and `trl-agentic eval` set it (batched generation needs one)
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs), tokenizer


def _evaluate_into(stage, model, tokenizer, task, task_args, training_args, results, records) -> None:
    """Held-out evaluation on the main process (plain generation: no collectives), the others wait."""
    from accelerate import PartialState

    from .evaluation import evaluate_policy

    state = PartialState()
    if state.is_main_process:
        result = evaluate_policy(
            model,
            tokenizer,
            list(task.eval_dataset),
            environment_factory=task.environment_factory,
            tools=task.tools,
            reward_funcs=task.reward_funcs,
            max_completion_length=training_args.max_completion_length,
            # The rollout limits of training (None: no limit, 0: no tool call, as TRL reads them).
            max_tool_calling_iterations=training_args.max_tool_calling_iterations,
            max_turn_tokens=training_args.max_turn_tokens,
            max_tool_output_chars=training_args.max_tool_output_chars,
            batch_size=task_args.heldout_eval_batch_size,
            temperature=task_args.heldout_eval_temperature,
            top_p=training_args.top_p,
            seed=training_args.seed,
            progress=not training_args.disable_tqdm,
            desc=f"eval {stage}",
            context_snapshots=training_args.enable_context_snapshots,
            context_stub_text=training_args.context_stub_text,
            chat_template_kwargs=training_args.chat_template_kwargs,  # the prompts GRPO renders
            # BFCL's verdict runs the model's JSON values as written (`trl-agentic eval` and `evaluate_bfcl` too).
            **({"typed_arguments": False, "batch_by": "environment"} if task_args.task == "bfcl" else {}),
        )
        results[stage], records[stage] = result.metrics, result.records
        m = result.metrics
        print(
            f"[{stage}] success {m['success_rate']:.1%} | successful tool calls {m['tool_call_success_rate']:.1%} | "
            f"problems with a successful call {m['tool_success_rate']:.1%} | {m['tool_calls_per_problem']:.2f} "
            f"calls/problem | {m['seconds']:.0f} s",
            flush=True,
        )
    state.wait_for_everyone()


def _finish(trainer, task, task_args, training_args, clock, eval_results, eval_records, warmstart_info, recorder):
    import json

    from .evaluation import format_comparison
    from .reporting import plot_curves, write_report

    out = training_args.output_dir
    os.makedirs(out, exist_ok=True)
    history = trainer.state.log_history
    files = []
    summary = {"stage times (wall s)": ", ".join(f"{k} {v['wall_s']:.0f}" for k, v in clock.stages.items())}
    if warmstart_info:
        summary["warm start"] = (
            f"{warmstart_info['steps']} SFT steps on {warmstart_info['traces']} traces "
            f"({warmstart_info['faulty_traces']} with a rejected call first), loss "
            f"{warmstart_info['first_loss']:.3f} → {warmstart_info['final_loss']:.3f}"
        )
    summary["GRPO"] = (
        f"{trainer.state.global_step} steps, {_rollouts_per_step(training_args)} rollouts/step, "
        f"{training_args.num_generations} per problem, max_completion_length {training_args.max_completion_length}"
    )
    summary["agentic features"] = (
        f"rollback {'on' if training_args.enable_tool_rollback else 'off'}, negative samples "
        f"{'on' if training_args.save_negative_samples else 'off'}"
    )
    if task_args.write_report:
        files.append(plot_curves(history, os.path.join(out, "curves.png"), eval_results=eval_results, title=out))
        if recorder is not None:
            files.append(recorder.save_jsonl(os.path.join(out, "trajectories.jsonl")))
            if recorder.errors:
                print(f"Trajectory recorder: {len(recorder.errors)} batches not recorded ({recorder.errors[0]}).")
        files.append(
            write_report(
                os.path.join(out, "report.html"),
                recorder.trajectories if recorder is not None else [],
                title=f"trl-agentic report: {out}",
                summary=summary,
                eval_results=eval_results,
                eval_records=eval_records,
                max_trajectories=task_args.report_max_trajectories,
                system_prompt=task.system_prompt,
            )
        )
    payload = {
        "eval": eval_results,
        "warmstart": warmstart_info,
        "timings": clock.stages,
        "total_wall_s": clock.total(),
        "grpo_steps": trainer.state.global_step,
        "num_eval_problems": len(task.eval_dataset) if task.eval_dataset is not None else 0,
        "eval_decoding": "greedy"
        if task_args.heldout_eval_temperature == 0
        else f"T={task_args.heldout_eval_temperature}",
    }
    path = os.path.join(out, "eval_results.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    files.append(path)
    _stage("Summary")
    if eval_results:
        print(format_comparison(eval_results))
    print(
        "stage times: "
        + ", ".join(f"{k} {v['wall_s']:.0f} s" for k, v in clock.stages.items())
        + f" (total {clock.total():.0f} s)"
    )
    print("wrote: " + ", ".join(str(f) for f in files) + f", and the LoRA adapter in {out}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "eval":
        return evaluate(rest)
    if command != "train":
        print(f"trl-agentic: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    kind = trainer_kind(rest)
    task_args, training_args, model_args, _ = make_parser(kind).parse_args_and_config(args=rest)
    if training_args.tracin_enabled and not model_args.use_peft:
        raise ValueError("`tracin_enabled` needs `use_peft: true`: the influence scores come from the LoRA layers.")
    if kind == "async_grpo" and task_args.warmstart_steps and not training_args.vllm_server_start:
        raise ValueError(
            "`warmstart_steps` with `trainer: async_grpo` needs `vllm_server_start: true`: the warm-started model is a "
            "folder this run writes (the adapter merged), and a server started elsewhere serves another model."
        )
    if kind == "async_grpo":
        for name in ("write_report", "heldout_eval_base_model"):
            if getattr(task_args, name):
                raise ValueError(
                    f"`{name}` is not supported with `trainer: async_grpo`: the asynchronous pipeline writes no report "
                    "and evaluates no base model (`heldout_eval` evaluates after training into `eval_results.json`)."
                )
    if kind == "async_grpo" and task_args.warmstart_steps:
        _merged_warm_start(training_args)
    try:
        if kind == "async_grpo":
            train_async(task_args, training_args, model_args)
        else:
            train(task_args, training_args, model_args)
    finally:
        _shutdown_distributed()
    return 0


def evaluate(argv: list[str]) -> int:
    """`trl-agentic eval`: BFCL multi-turn accuracy per category (arguments validated before any model loads)."""
    from trl import TrlParser

    from .envs.bfcl.evaluate import BFCLEvalArguments, run_eval

    (args,) = TrlParser((BFCLEvalArguments,), prog="trl-agentic eval").parse_args_and_config(args=argv)
    run_eval(args)
    return 0


def _shutdown_distributed() -> None:
    """Destroy the process group once the run is over, and make sure the interpreter exit waits for gloo's worker
    threads (a rank that exits right after its last collective can otherwise abort; see `trl_agentic.gloo_exit`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        register_gloo_exit_pause()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
