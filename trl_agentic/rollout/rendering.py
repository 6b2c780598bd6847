"""Token-level rendering of tool conversations, identical to `GRPOTrainer`'s, shared by training and evaluation.

The prompt is the conversation plus the assistant header; every later piece (tool results, a rollback hint, a further
user message) is rendered by the chat template itself as the tokens it adds after an assistant turn, and appended to
the trajectory as environment tokens (no re-tokenization of what the model generated, as in TRL's loop).
"""

from __future__ import annotations


def grpo_chat_template(tokenizer) -> str | None:
    """The chat template `GRPOTrainer` renders tool conversations with: `None` (the tokenizer's own) when it is
    prefix-preserving, otherwise TRL's training variant (the rule of TRL 1.16's `GRPOTrainer.__init__`)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    return None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)


class ChatRenderer:
    """Renders prompts and the environment pieces of a trajectory with a tokenizer's chat template.

    Args:
        tokenizer: The policy's tokenizer (with a tool-calling chat template).
        chat_template (`str`, *optional*): The template to use; GRPO's choice for `tokenizer` when unset.
        template_kwargs (`dict`, *optional*): Extra arguments of `apply_chat_template` (TRL's `chat_template_kwargs`).
    """

    _UNSET = object()

    def __init__(self, tokenizer, chat_template=_UNSET, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.chat_template = grpo_chat_template(tokenizer) if chat_template is self._UNSET else chat_template
        self.template_kwargs = dict(template_kwargs or {})

    def _apply(self, messages: list[dict], *, add_generation_prompt: bool, tools=None) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **self.template_kwargs,
        )
        return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)

    def prompt_ids(self, messages: list[dict], tools=None) -> list[int]:
        """The prompt as GRPO tokenizes it: the conversation plus the assistant header."""
        return self._apply(messages, add_generation_prompt=True, tools=tools)

    def _suffix_after(self, prefix_msgs: list[dict], new_msgs: list[dict]) -> list[int]:
        """The tokens the template adds after `prefix_msgs` (cut after their last end-of-turn token, as TRL's
        `_get_tool_suffix_ids` does for Qwen-style "<|im_end|>\\n") for `new_msgs` and the next assistant header."""
        prefix = self._apply(prefix_msgs, add_generation_prompt=False)
        full = self._apply(prefix_msgs + list(new_msgs), add_generation_prompt=True)
        eos = self.tokenizer.eos_token_id
        ends = [k for k, tok in enumerate(prefix) if tok == eos]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("The chat template does not render new messages as an extension of the conversation.")
        return full[len(prefix) :]

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """Tokens appended after an assistant turn for its tool results (TRL's `_get_tool_suffix_ids`)."""
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        return self._suffix_after(dummy, tool_messages)

    def hint_ids(self, hint: str) -> list[int]:
        """Masked hint tokens for `rollback_feedback="hint"`: an end-of-turn token closing the (empty) regenerated
        assistant turn, the hint as a user message and a new assistant header."""
        prefix_msgs = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": ""}]
        return [self.tokenizer.eos_token_id, *self._suffix_after(prefix_msgs, [{"role": "user", "content": hint}])]

    def user_turn_ids(self, content: str) -> list[int]:
        """Tokens of a further user message after a complete assistant turn (which ends with its end-of-turn token)."""
        prefix_msgs = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
        return self._suffix_after(prefix_msgs, [{"role": "user", "content": content}])
