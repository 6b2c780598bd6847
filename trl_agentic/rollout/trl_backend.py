"""`RolloutBackend` on top of a live `GRPOTrainer`: TRL's own generation, parsing and templating."""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch
from trl.chat_template_utils import parse_response

from ..rank_errors import error_summary
from .parsing import parse_tool_calls
from .rendering import ChatRenderer

logger = logging.getLogger(__name__)


def _has_response_parser(tokenizer) -> bool:
    return (
        getattr(tokenizer, "response_template", None) is not None
        or getattr(tokenizer, "response_schema", None) is not None
    )


def needs_equal_counts(trainer) -> bool:
    """Whether every process must pass the same number of prompts to one generation call.

    TRL's vLLM generation gathers the prompts of every process (server mode, or the tensor-parallel group in colocate
    mode) and hands process k the outputs `[k * n, (k + 1) * n)`, `n` being its *own* prompt count: right only if all
    counts are equal. Otherwise a process silently gets completions of another process's prompts.
    """
    return trainer.accelerator.num_processes > 1 and bool(getattr(trainer, "use_vllm", False))


_SERVER_LEN_ATTR = "_trl_agentic_server_max_model_len"


def server_max_model_len(trainer) -> int | None:
    """The vLLM server's `--max-model-len`, on every process; `None` if its client cannot tell or the request fails.

    Read once per trainer (the first rollout: every process builds its `TrainerBackend` there, so every process makes
    the broadcast together) and kept: it does not change during a run. Only the main process holds TRL's client (and
    talks to the server): it reads the length from the server's `/v1/models` (10 s at most) and sends it to the
    others. A failed read is `None` on every process, with a warning (the model config's length is used), not an
    error on the main process that would leave the others waiting in the broadcast.
    """
    if hasattr(trainer, _SERVER_LEN_ATTR):
        return getattr(trainer, _SERVER_LEN_ATTR)
    from accelerate.utils import broadcast_object_list

    value = [None]
    if trainer.accelerator.is_main_process:
        client = getattr(trainer.vllm_generation, "vllm_client", None)
        try:
            if hasattr(client, "get_max_model_len"):  # TRL's async client has it; 1.16's synchronous one does not
                value[0] = client.get_max_model_len()
            elif hasattr(client, "_get") and hasattr(client, "base_url"):
                value[0] = client._get(f"{client.base_url}/v1/models", timeout=10)["data"][0].get("max_model_len")
        except Exception as error:  # noqa: BLE001 - a budget from the model config is better than a stopped run
            logger.warning(
                f"Could not read the vLLM server's max_model_len ({type(error).__name__}: {error}); the rollout loop "
                "budgets contexts with the model config's max_position_embeddings."
            )
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(value)
    setattr(trainer, _SERVER_LEN_ATTR, value[0])
    return value[0]


def generate_single_turn(
    trainer, contexts: list[list[int]], limit: int | None = None
) -> tuple[list[list[int]], list[list[float]] | None]:
    """`trainer._generate_single_turn(contexts, num_generations=1)` for a per-process number of contexts.

    Every process must make this call together (generation can be a collective), each with its own contexts, possibly
    a different number of them. When TRL needs equal counts (`needs_equal_counts`), the calls are padded to the
    largest count with copies of the first context and the extra outputs dropped.

    `limit`: the most tokens any context of the call can keep; the engine is asked for no more
    (`GenerationMixin._generation_limit`). With several processes every one passes a limit and the largest is used
    by all: TRL's vLLM generation sends every process's prompts in one request with the main process's length.

    Returns:
        `(completion_ids, logprobs)`, one entry per context (`logprobs` is None without vLLM).
    """
    n = len(contexts)
    if needs_equal_counts(trainer):
        accelerator = trainer.accelerator
        most = int(accelerator.reduce(torch.tensor([n], device=accelerator.device), reduction="max").item())
        filler = list(contexts[0]) if contexts else [trainer._tokenizer.eos_token_id]
        contexts = list(contexts) + [filler] * (most - n)
    if limit is not None and trainer.accelerator.num_processes > 1:
        accelerator = trainer.accelerator
        limit = int(accelerator.reduce(torch.tensor([limit], device=accelerator.device), reduction="max").item())
    scope = trainer._generation_limit(limit) if hasattr(trainer, "_generation_limit") else nullcontext()
    with scope:
        ids, logprobs = trainer._generate_single_turn(contexts, None, {}, num_generations=1)
    return ids[:n], (logprobs[:n] if logprobs is not None else None)


class TrainerBackend:
    """Adapter giving `AgenticRolloutLoop` access to a trainer's generation engine (transformers or vLLM).

    Args:
        trainer: The running `AgenticGRPOTrainer`.
    """

    def __init__(self, trainer):
        self.trainer = trainer
        self.tokenizer = trainer._tokenizer
        self.max_completion_length = trainer.max_completion_length
        config = trainer.model.config.text_config if trainer._is_vlm else trainer.model.config
        if trainer.use_vllm and trainer.vllm_mode == "colocate":
            self.max_model_len = trainer.vllm_generation.llm.llm_engine.model_config.max_model_len
        elif trainer.use_vllm and trainer.vllm_mode == "server":
            self.max_model_len = server_max_model_len(trainer) or config.max_position_embeddings
        else:
            self.max_model_len = config.max_position_embeddings
        self.max_iterations = trainer.max_tool_calling_iterations
        self.multi_process = trainer.accelerator.num_processes > 1
        self.equal_counts = needs_equal_counts(trainer)
        # A turn ending otherwise was cut by the budget (TRL's `mask_truncated_completions` uses the same test).
        self.stop_token_ids = {*trainer.eos_token_ids, self.tokenizer.pad_token_id} - {None}
        self._renderer = None

    def _tools_for(self, row: int):
        t = self.trainer
        if t.environment_factories is not None:
            return t._env_tools[t._batch_environments[row]]
        return t.tools

    # One call for every queued context: the loop passes the most tokens any of them can keep (`limit=`).
    takes_call_limit = True

    def generate(self, contexts, limit=None):
        # One batched call for every queued rollout; num_generations=1 because each context is its own history.
        return generate_single_turn(self.trainer, contexts, limit=limit)

    def parse(self, ids, prefix, row, tools=None):
        if _has_response_parser(self.tokenizer):
            tools = self._tools_for(row) if tools is None else tools
            return parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)
        parsed = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=True))
        message = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = parsed.calls
        return message

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def tool_suffix_ids(self, tool_messages):
        return self.trainer._get_tool_suffix_ids(tool_messages)

    @property
    def renderer(self) -> ChatRenderer:
        """Renders prompts, hints and user turns with the trainer's chat template and its arguments."""
        if self._renderer is None:
            t = self.trainer
            self._renderer = ChatRenderer(t.processing_class, t.chat_template, t.chat_template_kwargs)
        return self._renderer

    def hint_ids(self, hint):
        return self.renderer.hint_ids(hint)

    def user_turn_ids(self, content):
        return self.renderer.user_turn_ids(content)

    def render_prompt(self, messages, row, tools=None):
        return self.renderer.prompt_ids(messages, tools=self._tools_for(row) if tools is None else tools)

    def new_environment(self, row, old):
        """A fresh instance of rollout `row`'s environment, put in the trainer's pool (and batch) in place of `old`."""
        t = self.trainer
        name = t._batch_environments[row]
        new = t.environment_factories[name]()
        pool = t._environment_pool[name]
        for k, env in enumerate(pool):
            if env is old:
                pool[k] = new
        return new

    def any_rank(self, flag, error=None):
        return any_rank(self.trainer.accelerator, flag, error)


def any_rank(accelerator, flag: bool, error: BaseException | None = None) -> bool:
    """Whether `flag` is set on any process; when any process passes an `error`, every process raises (the failing
    one its own error, the others a `RuntimeError` naming it), so no process is left waiting in a collective."""
    from accelerate.utils import gather_object

    value = torch.tensor([1.0 if flag else 0.0, 1.0 if error is not None else 0.0], device=accelerator.device)
    total = accelerator.reduce(value, reduction="sum")
    if total[1].item() > 0:
        errors = gather_object([None if error is None else error_summary(error)])
        if error is not None:
            raise error
        failed = {rank: text for rank, text in enumerate(errors) if text is not None}
        raise RuntimeError(f"Stopped because the rollout failed on another process: {failed}")
    return bool(total[0].item() > 0)
