"""Datasets of BFCL multi-turn tasks for TRL's multi-environment mode, with train / held-out splits by scenario.

A row is `{"prompt": [first user message], "environment": <tool group name>, "bfcl_id": <official id>}`: TRL picks
the environment class by `environment` (it renders that class's tools into the prompt) and passes `bfcl_id` to
`reset`. The same scenario number (`multi_turn_<category>_<n>`) is the same conversation in every category (with a
function held out, a parameter missing or long API states), so the split is made on scenario numbers: a held-out
scenario is held out in every category.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from .data import API_CLASSES, CATEGORIES, BFCLTask, load_tasks
from .env import environment_class, tool_group

NUM_SCENARIOS = 200


def split_scenarios(heldout_fraction: float = 0.25, seed: int = 0) -> tuple[list[int], list[int]]:
    """
    Split the 200 scenario numbers into training and held-out ones (a seeded shuffle; disjoint, sorted).

    Args:
        heldout_fraction (`float`, *optional*, defaults to `0.25`): Share of held-out scenarios.
        seed (`int`, *optional*, defaults to `0`): Seed of the shuffle.

    Returns:
        `tuple[list[int], list[int]]`: Training and held-out scenario numbers.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"`heldout_fraction` must be in [0, 1], got {heldout_fraction}.")
    numbers = list(range(NUM_SCENARIOS))
    random.Random(seed).shuffle(numbers)
    cut = round(heldout_fraction * NUM_SCENARIOS)
    return sorted(numbers[cut:]), sorted(numbers[:cut])


def select_tasks(
    categories: Iterable[str] = CATEGORIES,
    *,
    classes: Iterable[str] | None = None,
    scenarios: Iterable[int] | None = None,
) -> list[BFCLTask]:
    """
    BFCL tasks of some categories, restricted to API classes and scenario numbers.

    Args:
        categories (`Iterable[str]`, *optional*): Categories (default: all four).
        classes (`Iterable[str]`, *optional*): Keep only tasks all of whose API classes are among these.
        scenarios (`Iterable[int]`, *optional*): Keep only these scenario numbers.

    Returns:
        `list[BFCLTask]`: In category order, then file order.
    """
    allowed = set(classes) if classes is not None else None
    if allowed is not None and not allowed <= set(API_CLASSES):
        raise ValueError(f"Unknown API classes {sorted(allowed - set(API_CLASSES))}: expected some of {API_CLASSES}.")
    wanted = set(scenarios) if scenarios is not None else None
    tasks = []
    for category in categories:
        for task in load_tasks(category):
            if allowed is not None and not set(task.involved_classes) <= allowed:
                continue
            if wanted is not None and task.index not in wanted:
                continue
            tasks.append(task)
    return tasks


def make_rows(
    tasks: Sequence[BFCLTask], *, hide_excluded: bool = True, system_prompt: str | None = None
) -> list[dict]:
    """
    Dataset rows of tasks (see the module docstring).

    Args:
        tasks (`Sequence[BFCLTask]`): The tasks.
        hide_excluded (`bool`, *optional*, defaults to `True`): See `env.tool_group`.
        system_prompt (`str`, *optional*): A system message put before the first user message.
    """
    rows = []
    for task in tasks:
        prompt = [{"role": "user", "content": "\n".join(m["content"] for m in task.turns[0])}]
        if system_prompt:
            prompt.insert(0, {"role": "system", "content": system_prompt})
        rows.append(
            {"prompt": prompt, "environment": tool_group(task, hide_excluded=hide_excluded).name, "bfcl_id": task.id}
        )
    return rows


def environment_factories(rows: Sequence[dict], *, hide_excluded: bool = True) -> dict[str, type]:
    """`environment_factory` for TRL's multi-environment mode: `{environment name: class}` for these rows."""
    from .data import get_task

    factories = {}
    for row in rows:
        group = tool_group(get_task(row["bfcl_id"]), hide_excluded=hide_excluded)
        if group.name != row["environment"]:
            raise ValueError(f"Row {row['bfcl_id']} has environment {row['environment']!r}, expected {group.name!r}.")
        factories[group.name] = environment_class(group)
    return dict(sorted(factories.items()))


def sample_rows(rows: list[dict], limit: int, seed: int) -> list[dict]:
    """At most `limit` rows (a seeded sample, kept in their original order); all of them when `limit` is 0."""
    if not limit or limit >= len(rows):
        return list(rows)
    keep = sorted(random.Random(seed).sample(range(len(rows)), limit))
    return [rows[k] for k in keep]
