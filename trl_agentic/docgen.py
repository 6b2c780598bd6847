"""Generate `docs/configuration.md` from the help texts of the config dataclasses.

Run `python -m trl_agentic.docgen` after changing a field; `tests/test_docs.py` fails when the file is stale.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from trl import GRPOConfig

from .async_grpo.config import _AsyncOwnFields
from .cli import TrainerArguments
from .config import AgenticGRPOConfig
from .tasks import TaskArguments

HEADER = """# Configuration reference

Generated from the dataclass help texts by `python -m trl_agentic.docgen` (do not edit by hand).
Every field of TRL's [`GRPOConfig`](https://huggingface.co/docs/trl/grpo_trainer) and `trl.ModelConfig` is accepted
too; only the fields trl-agentic adds are listed here. Set them in the YAML file given to
`trl-agentic train --config`, as `--field value` flags, or as keyword arguments of `AgenticGRPOConfig`.
"""

ASYNC_INTRO = (
    "Every field of TRL's `AsyncGRPOConfig` and the feature fields of `AgenticGRPOConfig` above (same names, defaults "
    "and meaning; all but `vllm_lora_sync`), plus these (refused there: `tool_timeout`, `row_selection`, "
    "`eval_strategy`, `eval_on_start`; docs/async.md):"
)


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def _type_name(hint) -> str:
    # From resolved hints, not `Field.type`: argument parsers rewrite `Field.type` in place.
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _table(cls, fields) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = ["| field | type | default | description |", "| --- | --- | --- | --- |"]
    for f in fields:
        kind = _type_name(hints[f.name])
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        choices = f.metadata.get("choices")
        if choices:
            help_text += f" Choices: {', '.join(f'`{c}`' for c in choices)}."
        # GFM splits a row on every unescaped `|`, even inside a code span (`int | None`).
        kind, default = kind.replace("|", "\\|"), _default(f).replace("|", "\\|")
        lines.append(f"| `{f.name}` | `{kind}` | `{default}` | {help_text} |")
    return lines


def render() -> str:
    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    ours = [f for f in dataclasses.fields(AgenticGRPOConfig) if f.name not in base]
    out = [HEADER, "## `AgenticGRPOConfig` (trainer)", ""]
    out += _table(AgenticGRPOConfig, ours)
    out += ["", "## `TaskArguments` (`trl-agentic train` only)", ""]
    out += _table(TaskArguments, dataclasses.fields(TaskArguments))
    out += ["", "## `TrainerArguments` (`trl-agentic train` only)", ""]
    out += _table(TrainerArguments, dataclasses.fields(TrainerArguments))
    out += ["", "## `AsyncAgenticGRPOConfig` (`trainer: async_grpo`)", "", ASYNC_INTRO, ""]
    own = [f for f in dataclasses.fields(_AsyncOwnFields) if f.name in _AsyncOwnFields.__annotations__]
    out += _table(_AsyncOwnFields, own)
    return "\n".join(out) + "\n"


USAGE = "usage: python -m trl_agentic.docgen [OUTPUT]  (default: docs/configuration.md)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and (argv[0].startswith("-") or len(argv) > 1):  # `--help` is no file name to write to
        print(USAGE)
        return 0 if argv[0] in ("-h", "--help") else 2
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
