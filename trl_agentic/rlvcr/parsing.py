"""The multi-level thinking step format of RLVCR / CoPO: parser, renderer and level-forcing prompts.

One assistant turn is one step::

    <level>k</level>
    <think>...</think>
    <action>...</action>

with `k` in 1..4 (CogRouter's cognitive levels) and only whitespace between the blocks. The parser is built from
`str.find` calls (no regular expressions), so it runs in linear time on any input and never raises.
"""

import numbers
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TAGS",
    "LEVEL1_THINK",
    "LEVEL_FORCING_TEMPLATES",
    "LEVEL_NAMES",
    "LEVEL_SYSTEM_PROMPT",
    "PARSE_ERROR_REASONS",
    "ParsedStep",
    "StepParseError",
    "StepTags",
    "cut_before_action",
    "level_forcing_prompt",
    "parse_step",
    "render_prefix",
    "render_step",
]

LEVELS = (1, 2, 3, 4)

# The paper's fixed level-1 think text (a real think block, not an empty one).
LEVEL1_THINK = "Okay, I think I have finished thinking."

LEVEL_NAMES = {
    1: "Instinctive Response",
    2: "Situational Awareness",
    3: "Experience Integration",
    4: "Strategic Planning",
}

# Every `StepParseError.reason`, so a trainer can initialise one counter per reason.
PARSE_ERROR_REASONS = (
    "not_text",  # the input is not a `str`
    "no_level",  # no level open tag
    "leading_text",  # strict mode: something other than whitespace before the level block
    "unclosed_tag",  # an open tag without its close tag
    "nested_tag",  # a block's content contains one of the six tags
    "bad_level",  # the level is not one of 1, 2, 3, 4
    "no_think",  # no think block after the level block
    "no_action",  # no action block after the think block
    "unexpected_text",  # something other than whitespace between two blocks
    "empty_action",  # the action content is blank
    "trailing_text",  # strict mode: something other than whitespace after the action block
    "internal_error",  # a bug in the parser (or `tags` is not a `StepTags`); reported instead of raised
)


@dataclass(frozen=True)
class StepTags:
    """The six tag strings of the step format.

    Args:
        level_open (`str`, *optional*, defaults to `"<level>"`):
            Opens the level block.
        level_close (`str`, *optional*, defaults to `"</level>"`):
            Closes the level block.
        think_open (`str`, *optional*, defaults to `"<think>"`):
            Opens the think block.
        think_close (`str`, *optional*, defaults to `"</think>"`):
            Closes the think block.
        action_open (`str`, *optional*, defaults to `"<action>"`):
            Opens the action block.
        action_close (`str`, *optional*, defaults to `"</action>"`):
            Closes the action block.

    Tags are matched exactly (case-sensitive). They must be non-empty and none may contain another, otherwise the
    format is ambiguous; the constructor raises `ValueError` in that case.
    """

    level_open: str = "<level>"
    level_close: str = "</level>"
    think_open: str = "<think>"
    think_close: str = "</think>"
    action_open: str = "<action>"
    action_close: str = "</action>"

    def __post_init__(self):
        tags = self.all()
        for tag in tags:
            if not isinstance(tag, str) or not tag:
                raise ValueError(f"Step tags must be non-empty strings, got {tags!r}.")
        for i, a in enumerate(tags):
            for j, b in enumerate(tags):
                if i != j and a in b:
                    raise ValueError(f"Step tag {a!r} occurs inside tag {b!r}; the format would be ambiguous.")

    def all(self) -> tuple[str, ...]:
        """The six tags, in format order.

        Returns:
            `tuple[str, ...]`: `(level_open, level_close, think_open, think_close, action_open, action_close)`.
        """
        return (
            self.level_open,
            self.level_close,
            self.think_open,
            self.think_close,
            self.action_open,
            self.action_close,
        )


DEFAULT_TAGS = StepTags()


@dataclass(frozen=True)
class ParsedStep:
    """A well-formed step.

    All spans are `(start, end)` character offsets into the parsed text, so `text[start:end]` gives the piece (map
    them to tokens with a tokenizer's offset mapping). `think` and `action` are the block contents with surrounding
    whitespace removed, and their spans cover exactly that stripped content: `text[slice(*think_span)] == think`.

    Args:
        level (`int`):
            The thinking level, 1..4.
        think (`str`):
            The think content, stripped (may be empty).
        action (`str`):
            The action content, stripped (never empty).
        level_span (`tuple[int, int]`):
            The whole level block, tags included (`"<level>2</level>"`).
        think_span (`tuple[int, int]`):
            The stripped think content.
        action_span (`tuple[int, int]`):
            The stripped action content.
        step_span (`tuple[int, int]`):
            From the level open tag to the end of the action close tag.
    """

    level: int
    think: str
    action: str
    level_span: tuple[int, int]
    think_span: tuple[int, int]
    action_span: tuple[int, int]
    step_span: tuple[int, int]


@dataclass(frozen=True)
class StepParseError:
    """Why a text is not a well-formed step (returned, never raised).

    Args:
        reason (`str`):
            A short machine-readable code, one of `PARSE_ERROR_REASONS`.
        position (`int`, *optional*, defaults to `-1`):
            Character offset where the problem was detected, -1 when it has none.
    """

    reason: str
    position: int = -1


def _stripped_span(text: str, start: int, end: int) -> tuple[int, int]:
    """The span of `text[start:end]` without its leading and trailing whitespace."""
    piece = text[start:end]
    left = len(piece) - len(piece.lstrip())
    if left == len(piece):
        return start, start
    right = len(piece) - len(piece.rstrip())
    return start + left, end - right


def _has_tag(text: str, start: int, end: int, tags: StepTags) -> bool:
    # `str.find` with bounds avoids copying the (possibly huge) slice once per tag.
    return any(text.find(tag, start, end) >= 0 for tag in tags.all())


def _is_blank(text: str, start: int, end: int) -> bool:
    return not text[start:end].strip()


def _block(text: str, pos: int, open_tag: str, close_tag: str, tags: StepTags):
    """Find `open_tag ... close_tag` at or after `pos`.

    Returns `(open_start, content_start, content_end, block_end)` or a `StepParseError`; `None` when `open_tag` does
    not occur at all.
    """
    open_start = text.find(open_tag, pos)
    if open_start < 0:
        return None
    content_start = open_start + len(open_tag)
    content_end = text.find(close_tag, content_start)
    if content_end < 0:
        return StepParseError("unclosed_tag", open_start)
    if _has_tag(text, content_start, content_end, tags):
        return StepParseError("nested_tag", content_start)
    return open_start, content_start, content_end, content_end + len(close_tag)


def _parse(text: str, tags: StepTags, strict: bool) -> "ParsedStep | StepParseError":
    level_block = _block(text, 0, tags.level_open, tags.level_close, tags)
    if level_block is None:
        return StepParseError("no_level")
    if isinstance(level_block, StepParseError):
        return level_block
    level_start, level_content_start, level_content_end, pos = level_block
    if strict and not _is_blank(text, 0, level_start):
        return StepParseError("leading_text", 0)
    # Compare strings instead of calling int(): int() accepts "٣", "+3", "0_3" and raises on huge digit strings.
    level_text = text[level_content_start:level_content_end].strip()
    if level_text not in ("1", "2", "3", "4"):
        return StepParseError("bad_level", level_content_start)

    think_block = _block(text, pos, tags.think_open, tags.think_close, tags)
    if think_block is None:
        return StepParseError("no_think", pos)
    if isinstance(think_block, StepParseError):
        return think_block
    think_start, think_content_start, think_content_end, think_end = think_block
    if not _is_blank(text, pos, think_start):
        return StepParseError("unexpected_text", pos)

    action_block = _block(text, think_end, tags.action_open, tags.action_close, tags)
    if action_block is None:
        return StepParseError("no_action", think_end)
    if isinstance(action_block, StepParseError):
        return action_block
    action_start, action_content_start, action_content_end, step_end = action_block
    if not _is_blank(text, think_end, action_start):
        return StepParseError("unexpected_text", think_end)
    if strict and not _is_blank(text, step_end, len(text)):
        return StepParseError("trailing_text", step_end)

    think_span = _stripped_span(text, think_content_start, think_content_end)
    action_span = _stripped_span(text, action_content_start, action_content_end)
    if action_span[0] == action_span[1]:
        return StepParseError("empty_action", action_content_start)
    return ParsedStep(
        level=int(level_text),
        think=text[think_span[0] : think_span[1]],
        action=text[action_span[0] : action_span[1]],
        level_span=(level_start, pos),
        think_span=think_span,
        action_span=action_span,
        step_span=(level_start, step_end),
    )


def parse_step(text: str, tags: StepTags = DEFAULT_TAGS, *, strict: bool = True) -> ParsedStep | StepParseError:
    """Parse one assistant turn `<level>k</level><think>...</think><action>...</action>`.

    Whitespace (including newlines) is allowed between the blocks and inside them. The parser never raises, on any
    input: malformed text gives a `StepParseError` whose `reason` is one of `PARSE_ERROR_REASONS`. It runs in time
    linear in `len(text)` (a handful of `str.find` scans, no regular expressions).

    A block's content may not contain any of the six tags (`"nested_tag"`): a think block that mentions `<action>`
    would make the "everything before `<action>`" prefix of RLVCR ambiguous. The level-1 think text is not checked
    against `LEVEL1_THINK`.

    Args:
        text (`str`):
            The decoded assistant turn (without special tokens such as EOS).
        tags (`StepTags`, *optional*, defaults to `DEFAULT_TAGS`):
            The tag strings.
        strict (`bool`, *optional*, defaults to `True`):
            When `True`, only whitespace may come before the level block and after the action block
            (`"leading_text"` / `"trailing_text"` otherwise). When `False`, text around the step is ignored and the
            first level block is parsed.

    Returns:
        `ParsedStep | StepParseError`: the parsed step, or why there is none.
    """
    if not isinstance(text, str):
        return StepParseError("not_text")
    try:
        return _parse(text, tags, strict)
    except Exception:  # pragma: no cover - defensive: the contract is "never raises"
        return StepParseError("internal_error")


def _as_level(level, allowed=LEVELS) -> int:
    # Accept numpy / torch integer scalars, refuse bools and floats (2.0 would render as "2.0").
    if isinstance(level, bool) or not isinstance(level, numbers.Integral) or int(level) not in allowed:
        raise ValueError(f"`level` must be one of {tuple(allowed)}, got {level!r}.")
    return int(level)


def _check_render(level: int, think: str, action: str, tags: StepTags) -> None:
    for name, value in (("think", think), ("action", action)):
        if any(tag in value for tag in tags.all()):
            raise ValueError(f"`{name}` contains a step tag, so the rendered step would not parse: {value!r}.")


def render_prefix(level: int, think: str | None = None, tags: StepTags = DEFAULT_TAGS) -> str:
    """The canonical step text up to and including the action open tag.

    This is the context under which RLVCR scores the original action: `render_step(level, think, action)` is exactly
    `render_prefix(level, think) + action + tags.action_close`.

    Args:
        level (`int`):
            The thinking level, 1..4.
        think (`str`, *optional*):
            The think content, inserted verbatim. `None` is allowed for level 1 only and means `LEVEL1_THINK`.
        tags (`StepTags`, *optional*, defaults to `DEFAULT_TAGS`):
            The tag strings.

    Returns:
        `str`: `"<level>k</level>\\n<think>{think}</think>\\n<action>"`.
    """
    level = _as_level(level)
    if think is None:
        if level != 1:
            raise ValueError(f"`think` may only be None for level 1, got level={level!r}.")
        think = LEVEL1_THINK
    _check_render(level, think, "", tags)
    return (
        f"{tags.level_open}{level}{tags.level_close}\n{tags.think_open}{think}{tags.think_close}\n{tags.action_open}"
    )


def render_step(level: int, think: str | None, action: str, tags: StepTags = DEFAULT_TAGS) -> str:
    """The canonical text of a step.

    `parse_step(render_step(level, think, action))` gives back `level`, `think.strip()` and `action.strip()` whenever
    the action is not blank.

    Args:
        level (`int`):
            The thinking level, 1..4.
        think (`str` or `None`):
            The think content, inserted verbatim. `None` is allowed for level 1 only and means `LEVEL1_THINK`.
        action (`str`):
            The action content, inserted verbatim.
        tags (`StepTags`, *optional*, defaults to `DEFAULT_TAGS`):
            The tag strings.

    Returns:
        `str`: `"<level>k</level>\\n<think>{think}</think>\\n<action>{action}</action>"`.

    Raises:
        `ValueError`: if `level` is not 1..4 or `think` / `action` contain a tag.
    """
    level = _as_level(level)
    _check_render(level, "" if think is None else think, action, tags)
    return render_prefix(level, think, tags) + action + tags.action_close


def cut_before_action(generated: str, tags: StepTags = DEFAULT_TAGS) -> str | None:
    """Extract the think content of a generated alternative, cutting before its action.

    The alternative thinking of RLVCR is generated under a level-forcing prompt; only its think content is kept (the
    original action is appended later). The content runs from the first think open tag to the think close tag, or to
    the action open tag when the model forgot to close the think block.

    Args:
        generated (`str`):
            The generated text (it may start with the level block, or directly with the think block).
        tags (`StepTags`, *optional*, defaults to `DEFAULT_TAGS`):
            The tag strings.

    Returns:
        `str | None`: the stripped think content, or `None` when there is no usable think block: no think open tag,
        neither a think close nor an action open tag after it (e.g. the generation was truncated), blank content, or
        content that contains another tag.
    """
    if not isinstance(generated, str):
        return None
    start = generated.find(tags.think_open)
    if start < 0:
        return None
    start += len(tags.think_open)
    end = generated.find(tags.think_close, start)
    action = generated.find(tags.action_open, start)
    if end < 0 or (0 <= action < end):
        end = action
    if end < 0 or _has_tag(generated, start, end, tags):
        return None
    think = generated[start:end].strip()
    return think or None


# Level-forcing templates for generating the alternative thinking of an expanded step (modelled on CogRouter's
# THINK_MODE_{2,3,4}): the thinking is conditioned on the original action, which it must justify. Placeholders are
# replaced literally (not with `str.format`), so braces in a history or a custom template are safe.
LEVEL_FORCING_TEMPLATES = {
    2: """Given the current state and the available actions, assess the situation before acting:

{history}

Now think at Level 2 (Situational Awareness): analyse the current state and the available actions, and explain why \
"{action}" is the best action to take now. Answer in exactly this format:

{level_open}2{level_close}
{think_open}
Current state: [the current state of the environment]
Available actions: [the actions that are possible right now]
Reasoning: [why "{action}" is the best action]
{think_close}
{action_open}{action}{action_close}""",
    3: """Given the current state and the available actions, reflect on your past experience before acting:

{history}

Now think at Level 3 (Experience Integration): reflect on your past actions and their outcomes, and explain why \
"{action}" is the best action to take now. Answer in exactly this format:

{level_open}3{level_close}
{think_open}
Goal: [what needs to be accomplished]
Current state: [the current state of the environment]
Available actions: [the actions that are possible right now]
Reflection: [how effective the recent actions were and what was learned]
Reasoning: [why "{action}" is the best action given this experience]
{think_close}
{action_open}{action}{action_close}""",
    4: """Given the current state and the available actions, plan strategically and evaluate each option before acting:

{history}

Now think at Level 4 (Strategic Planning): consider the task goal, the lessons of past steps and the current state, \
evaluate each candidate action, and explain the future impact of "{action}". Answer in exactly this format:

{level_open}4{level_close}
{think_open}
Goal: [what needs to be accomplished]
Current state: [the current state of the environment]
Available actions: [the actions that are possible right now]
Reflection: [how effective the recent actions were and what was learned]
Evaluation: [how well each candidate action would work]
Reasoning: [why "{action}" is the optimal action]
{think_close}
{action_open}{action}{action_close}""",
}


def level_forcing_prompt(
    history: str, level: int, action: str, template: str | None = None, tags: StepTags = DEFAULT_TAGS
) -> str:
    """The prompt that asks the model to think at a given level to justify a given action.

    Placeholders `{history}`, `{action}`, `{level}` and `{level_open}`, `{level_close}`, `{think_open}`,
    `{think_close}`, `{action_open}`, `{action_close}` are replaced literally; other braces are left untouched.

    Args:
        history (`str`):
            The interaction so far (task, observations, previous actions): the context of the original step.
        level (`int`):
            The level to force. Without a custom `template` it must be 2, 3 or 4: level 1 needs no generation, its
            think text is `LEVEL1_THINK`.
        action (`str`):
            The original action, which the generated thinking must justify.
        template (`str`, *optional*):
            A custom template; defaults to `LEVEL_FORCING_TEMPLATES[level]`.
        tags (`StepTags`, *optional*, defaults to `DEFAULT_TAGS`):
            The tag strings filled into the tag placeholders.

    Returns:
        `str`: the prompt text.
    """
    if template is None:
        try:
            level = _as_level(level, tuple(LEVEL_FORCING_TEMPLATES))
        except ValueError:
            raise ValueError(
                f"No default level-forcing template for level={level!r}; levels 2, 3 and 4 have one (level 1 uses "
                "the fixed LEVEL1_THINK and needs no generation)."
            ) from None
        template = LEVEL_FORCING_TEMPLATES[level]
    else:
        level = _as_level(level)
    # History and action go in last, so a placeholder-looking string inside them is never expanded.
    out = template.replace("{level}", str(level))
    for name in ("level_open", "level_close", "think_open", "think_close", "action_open", "action_close"):
        out = out.replace("{" + name + "}", getattr(tags, name))
    pieces = out.split("{history}")
    pieces = [piece.replace("{action}", action) for piece in pieces]
    return history.join(pieces)


LEVEL_SYSTEM_PROMPT = f"""You can think at four levels before each action:
Level 1 - Instinctive Response: act immediately on intuition, without analysis.
Level 2 - Situational Awareness: assess the current state and the available actions before acting.
Level 3 - Experience Integration: also reflect on your past actions and their outcomes to inform the decision.
Level 4 - Strategic Planning: also consider the task goal and evaluate the future impact of each candidate action \
to choose the best one.

At each step, first choose the level that fits the situation and write it inside <level> </level> tags. Then \
reason at that level inside <think> </think> tags. For Level 1, the think block is exactly: "{LEVEL1_THINK}" \
Finally, write one action inside <action> </action> tags. Write nothing before the level block or after the action \
block.

Output format:
EXAMPLE 1:
<level>1</level>
<think>{LEVEL1_THINK}</think>
<action>your next action</action>

EXAMPLE 2:
<level>2</level>
<think>
Current state: [the current state and what you carry]
Available actions: [the actions that are possible right now]
Reasoning: [which action is best and why]
</think>
<action>your next action</action>

EXAMPLE 3:
<level>3</level>
<think>
Goal: [what needs to be accomplished]
Current state: [the current state and what you carry]
Available actions: [the actions that are possible right now]
Reflection: [how effective your recent actions were and what you learned]
Reasoning: [which action is best given this experience]
</think>
<action>your next action</action>

EXAMPLE 4:
<level>4</level>
<think>
Goal: [what needs to be accomplished]
Current state: [the current state and what you carry]
Available actions: [the actions that are possible right now]
Reflection: [how effective your recent actions were and what you learned]
Evaluation: [how well each candidate action would work]
Reasoning: [which action is optimal and why]
</think>
<action>your next action</action>"""
