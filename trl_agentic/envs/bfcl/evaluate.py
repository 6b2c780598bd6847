"""BFCL multi-turn accuracy per category of a local model or LoRA adapter, with the official checker.

`trl-agentic eval --model_name_or_path smollm2-135m [--adapter_path DIR] --categories base miss_param` (see
[`BFCLEvalArguments`]) rolls the model out on the chosen tasks with the project's multi-turn tool loop
(`trl_agentic.evaluation.evaluate_policy`: the chat template with the task's tools as TRL renders them, TRL's response
parser without its typing of arguments by the tools' schemas, as BFCL runs the model's JSON values, the environment's
user turns) and scores every conversation with the official checker (`reward.bfcl_reward`).
Accuracy is the share of valid conversations per category, as in BFCL's leaderboard; `turn_credit` is our per-turn
partial credit (not BFCL's), reported beside `no_call_turn_credit`, what a conversation that never calls a tool gets
on the same tasks (`checker.no_call_turn_credit`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...field_checks import check_finite, check_integer
from .checker import no_call_turn_credit
from .data import CATEGORIES, category_of, get_task
from .dataset import environment_factories, make_rows, sample_rows, select_tasks, split_scenarios
from .reward import bfcl_reward, bfcl_turn_credit


@dataclass
class BFCLEvalArguments:
    """
    Arguments of `trl-agentic eval` (BFCL multi-turn accuracy per category).

    Args:
        model_name_or_path (`str`, *optional*, defaults to `"smollm2-135m"`):
            A local model folder or a built-in model name (`trl_agentic.models`); a folder with a LoRA adapter
            (`adapter_config.json`) is loaded on its base model.
        adapter_path (`str`, *optional*):
            A LoRA adapter folder to load on `model_name_or_path`.
        categories (`list[str]`, *optional*, defaults to all four):
            BFCL multi-turn categories: `base`, `miss_func`, `miss_param`, `long_context`.
        classes (`list[str]`, *optional*):
            Keep only tasks whose API classes are all among these (default: every task).
        split (`str`, *optional*, defaults to `"heldout"`):
            `"heldout"`, `"train"` (scenario split of `trl_agentic.envs.bfcl.dataset.split_scenarios`) or `"all"`.
        heldout_fraction (`float`, *optional*, defaults to `0.25`):
            Share of held-out scenarios (the same split as the `bfcl` training task with the same seed).
        split_seed (`int`, *optional*, defaults to `0`):
            Seed of the scenario split.
        limit (`int`, *optional*, defaults to `0`):
            Tasks per category at most (a seeded sample); 0 evaluates them all.
        hide_excluded (`bool`, *optional*, defaults to `True`):
            Hide each task's `excluded_function`s (see `env.tool_group`).
        system_prompt (`str`, *optional*):
            A system message before the first user message (default: none, as BFCL's function-calling mode).
        max_completion_length (`int`, *optional*, defaults to `4096`):
            Token budget of a whole conversation after the prompt (assistant, tool and user turns).
        max_turn_tokens (`int`, *optional*, defaults to `256`):
            Tokens generated per assistant turn at most.
        max_tool_calling_iterations (`int`, *optional*, defaults to `40`):
            Tool rounds per conversation at most.
        batch_size (`int`, *optional*, defaults to `8`):
            Conversations rolled out together.
        temperature (`float`, *optional*, defaults to `0.0`):
            0 decodes greedily (deterministic), otherwise the sampling temperature.
        seed (`int`, *optional*, defaults to `0`):
            Seed of the sampling and of `limit`'s sample.
        dtype (`str`, *optional*, defaults to `"float32"`):
            Model weights' dtype.
        output (`str`, *optional*):
            Write the results (per category and per task) to this JSON file.
        progress (`bool`, *optional*, defaults to `True`):
            Show a progress bar.
    """

    model_name_or_path: str = field(default="smollm2-135m", metadata={"help": "Local model folder or built-in name."})
    adapter_path: str | None = field(default=None, metadata={"help": "LoRA adapter folder to load on the model."})
    categories: list[str] = field(
        default_factory=lambda: list(CATEGORIES), metadata={"help": "BFCL multi-turn categories."}
    )
    classes: list[str] | None = field(default=None, metadata={"help": "Keep tasks whose API classes are all these."})
    split: str = field(default="heldout", metadata={"help": "heldout, train or all."})
    heldout_fraction: float = field(default=0.25, metadata={"help": "Share of held-out scenarios."})
    split_seed: int = field(default=0, metadata={"help": "Seed of the scenario split."})
    limit: int = field(default=0, metadata={"help": "Tasks per category at most (0: all)."})
    hide_excluded: bool = field(default=True, metadata={"help": "Hide each task's excluded functions."})
    system_prompt: str | None = field(default=None, metadata={"help": "System message before the first turn."})
    max_completion_length: int = field(default=4096, metadata={"help": "Token budget of a conversation."})
    max_turn_tokens: int = field(default=256, metadata={"help": "Tokens per assistant turn at most."})
    max_tool_calling_iterations: int = field(default=40, metadata={"help": "Tool rounds per conversation at most."})
    batch_size: int = field(default=8, metadata={"help": "Conversations rolled out together."})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy, else the sampling temperature."})
    seed: int = field(default=0, metadata={"help": "Seed of the sampling and of the `limit` sample."})
    dtype: str = field(default="float32", metadata={"help": "Model weights' dtype."})
    output: str | None = field(default=None, metadata={"help": "Write the results to this JSON file."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})

    def __post_init__(self):
        unknown = set(self.categories) - set(CATEGORIES)
        if unknown or not self.categories:
            raise ValueError(f"`categories` must be among {list(CATEGORIES)}, got {self.categories}.")
        if self.split not in ("heldout", "train", "all"):
            raise ValueError(f"`split` must be heldout, train or all, got {self.split!r}.")
        # YAML values reach the fields unconverted: a float or a boolean in an integer field is refused here.
        check_finite("heldout_fraction", self.heldout_fraction)
        if not 0.0 <= self.heldout_fraction <= 1.0:
            raise ValueError(f"`heldout_fraction` must be in [0, 1], got {self.heldout_fraction}.")
        for name in ("max_completion_length", "max_turn_tokens", "max_tool_calling_iterations", "batch_size"):
            check_integer(name, getattr(self, name), 1)
        check_integer("limit", self.limit, 0)
        for name in ("seed", "split_seed"):
            check_integer(name, getattr(self, name))
        check_finite("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be a finite number >= 0, got {self.temperature}.")
        if self.classes is not None:
            from .data import API_CLASSES

            if not set(self.classes) <= set(API_CLASSES):
                raise ValueError(f"`classes` must be among {list(API_CLASSES)}, got {self.classes}.")
        import torch

        dtype = getattr(torch, self.dtype, None)  # what `load_policy` looks up
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"`dtype` must name a torch floating-point dtype (e.g. float32, bfloat16), got {self.dtype!r}."
            )
        # Local files only (`load_policy`): a missing folder fails here rather than when the model loads.
        if not _local_model(self.model_name_or_path):
            raise ValueError(
                "`model_name_or_path` must be a local model or adapter folder, a built-in model name or a model in the "
                f"local Hugging Face cache, got {self.model_name_or_path!r}."
            )
        if self.adapter_path is not None and not os.path.isfile(
            os.path.join(self.adapter_path, "adapter_config.json")
        ):
            raise ValueError(
                f"`adapter_path` must be a LoRA adapter folder (with adapter_config.json), got {self.adapter_path!r}."
            )


def _local_model(name_or_path: str) -> bool:
    """Whether `load_policy` finds the model without the network: a folder, a built-in name, or a Hub model whose
    config is in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    from ...models import is_builtin_model

    if os.path.isdir(name_or_path) or is_builtin_model(name_or_path):
        return True
    try:
        return isinstance(try_to_load_from_cache(name_or_path, "config.json"), str)
    except ValueError:  # not a valid Hub id either (e.g. an absolute path)
        return False


def _check_output(path: str) -> None:
    """Make `path`'s folder and check that a file can be written there, so an unusable `output` fails before the
    evaluation rather than after it."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    try:
        if os.path.isdir(path):
            raise IsADirectoryError(f"{path} is a folder")
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"`output` {path!r} cannot be written: {e}") from e


def eval_rows(args: BFCLEvalArguments) -> list[dict]:
    """The dataset rows `args` selects: categories, API classes, split and per-category `limit`."""
    scenarios = None
    if args.split != "all":
        train, heldout = split_scenarios(args.heldout_fraction, args.split_seed)
        scenarios = heldout if args.split == "heldout" else train
    rows = []
    for category in args.categories:
        tasks = select_tasks([category], classes=args.classes, scenarios=scenarios)
        chosen = make_rows(tasks, hide_excluded=args.hide_excluded, system_prompt=args.system_prompt)
        rows += sample_rows(chosen, args.limit, args.seed)
    if not rows:
        raise ValueError("No BFCL task matches the chosen categories, classes and split.")
    return rows


def evaluate_bfcl(
    model,
    tokenizer,
    rows: Sequence[dict],
    *,
    hide_excluded: bool = True,
    max_completion_length: int = 4096,
    max_turn_tokens: int = 256,
    max_tool_calling_iterations: int = 40,
    batch_size: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    desc: str = "BFCL multi-turn",
) -> dict:
    """
    Roll a model out on BFCL rows and score every conversation with the official checker.

    Args:
        model: Causal LM (plain or `PeftModel`).
        tokenizer: Its tokenizer (tool-calling chat template).
        rows (`Sequence[dict]`): Rows of `dataset.make_rows`.
        hide_excluded, max_completion_length, max_turn_tokens, max_tool_calling_iterations, batch_size, temperature,
        seed, progress: See [`BFCLEvalArguments`].
        desc (`str`, *optional*): Label of the progress bar.

    Returns:
        `dict`: `categories` (per category: `accuracy`, `turn_credit`, `no_call_turn_credit`, `num_tasks`),
        `overall` (the same over all rows), `tasks` (per task: `id`, `category`, `valid`, `turn_credit`,
        `no_call_turn_credit`, `tool_calls`, `completion_tokens`) and `seconds`.
    """
    from ...evaluation import evaluate_policy

    # Rows of one tool group share the prompt prefix (the tool schemas): batch them together for prefix caching.
    order = sorted(range(len(rows)), key=lambda k: (rows[k]["environment"], k))
    ordered = [dict(rows[k]) for k in order]
    start = time.perf_counter()
    result = evaluate_policy(
        model,
        tokenizer,
        ordered,
        environment_factory=environment_factories(ordered, hide_excluded=hide_excluded),
        reward_funcs=[bfcl_reward, bfcl_turn_credit],
        max_completion_length=max_completion_length,
        max_tool_calling_iterations=max_tool_calling_iterations,
        batch_size=batch_size,
        temperature=temperature,
        seed=seed,
        progress=progress,
        desc=desc,
        max_turn_tokens=max_turn_tokens,
        batch_by="environment",
        typed_arguments=False,  # BFCL runs the model's JSON values: `"lines": "1"` is not the integer 1
    )
    tasks = [None] * len(rows)
    for k, row, record in zip(order, ordered, result.records):
        tasks[k] = {
            "id": row["bfcl_id"],
            "category": category_of(row["bfcl_id"]),
            "valid": record["rewards"][0] == 1.0,
            "turn_credit": record["rewards"][1],
            "no_call_turn_credit": no_call_turn_credit(get_task(row["bfcl_id"])),
            "tool_calls": record["tool_calls"],
            "completion_tokens": record["completion_tokens"],
        }
    return {
        "categories": summarize_by_category(tasks),
        "overall": _summary(tasks),
        "tasks": tasks,
        "seconds": time.perf_counter() - start,
    }


def _summary(tasks: list[dict]) -> dict:
    n = len(tasks)
    return {
        "accuracy": sum(t["valid"] for t in tasks) / n if n else math.nan,
        "turn_credit": sum(t["turn_credit"] for t in tasks) / n if n else math.nan,
        "no_call_turn_credit": sum(t.get("no_call_turn_credit", math.nan) for t in tasks) / n if n else math.nan,
        "num_tasks": n,
    }


def summarize_by_category(tasks: list[dict]) -> dict[str, dict]:
    """Accuracy, mean turn credit and count per category (in `CATEGORIES` order)."""
    groups = defaultdict(list)
    for task in tasks:
        groups[task["category"]].append(task)
    return {c: _summary(groups[c]) for c in CATEGORIES if c in groups}


def format_results(results: dict) -> str:
    """A fixed-width table: one line per category and one for all tasks; turn credit beside its no-call baseline."""
    lines = [f"{'category':<14}{'tasks':>7}{'accuracy':>10}{'turn credit':>13}{'no-call baseline':>18}"]
    for name, summary in [*results["categories"].items(), ("all", results["overall"])]:
        lines.append(
            f"{name:<14}{summary['num_tasks']:>7}{summary['accuracy']:>10.1%}{summary['turn_credit']:>13.1%}"
            f"{summary.get('no_call_turn_credit', math.nan):>18.1%}"
        )
    return "\n".join(lines)


def load_policy(model_name_or_path: str, adapter_path: str | None = None, dtype: str = "float32"):
    """
    A model (with its LoRA adapter, if any) and its tokenizer, from local files only.

    Args:
        model_name_or_path (`str`): Model folder, built-in name, or a LoRA adapter folder (loaded on its base model).
        adapter_path (`str`, *optional*): A LoRA adapter folder to load on the model.
        dtype (`str`, *optional*, defaults to `"float32"`): Weights' dtype.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...models import resolve_model_path

    torch_dtype = getattr(torch, dtype)
    if adapter_path is None and os.path.isfile(os.path.join(str(model_name_or_path), "adapter_config.json")):
        adapter_path = str(model_name_or_path)
        with open(os.path.join(adapter_path, "adapter_config.json"), encoding="utf-8") as f:
            model_name_or_path = json.load(f)["base_model_name_or_path"]
    base = resolve_model_path(model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
    tokenizer_path = base
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
        if os.path.isfile(os.path.join(adapter_path, "tokenizer_config.json")):
            tokenizer_path = adapter_path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def run_eval(args: BFCLEvalArguments) -> dict:
    """`trl-agentic eval`: select the rows, load the policy, evaluate, print the table, write `args.output`."""
    rows = eval_rows(args)  # config and task errors before any model loads
    if args.output:
        _check_output(args.output)
    model, tokenizer = load_policy(args.model_name_or_path, args.adapter_path, args.dtype)
    results = evaluate_bfcl(
        model,
        tokenizer,
        rows,
        hide_excluded=args.hide_excluded,
        max_completion_length=args.max_completion_length,
        max_turn_tokens=args.max_turn_tokens,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        batch_size=args.batch_size,
        temperature=args.temperature,
        seed=args.seed,
        progress=args.progress,
    )
    results["arguments"] = {k: v for k, v in vars(args).items()}
    print(format_results(results), flush=True)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.output}")
    return results
