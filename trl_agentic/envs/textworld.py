"""A small deterministic household text world for multi-step agentic RL (e.g. RLVCR's multi-level thinking).

Five rooms, five containers (three of them closed until opened) and seven objects. A task is "put the <object> in
the <container>"; the object starts somewhere else, possibly inside a closed container in another room, so a task
takes a few navigation, open, take and put actions. Transitions are deterministic; only the task layout is drawn from
`task_seed`.

Two classes share the world:

* `TextWorldEnv`: the text API (`reset`, `step`, `done`, `get_reward`), for a loop that parses the action out of the
  model's `<action>...</action>` block itself. It also has the tool method `act`.
* `TextWorldToolEnv`: the same world for TRL's tool calling (`environment_factory=TextWorldToolEnv`). TRL exposes
  every public method of an environment class except `reset` and `get_reward` as a tool, so this class has exactly
  one public method, `act`.

Both implement the `_checkpoint() -> state` / `_restore(state)` protocol with a cheap explicit copy of the state.
"""

import functools
import random
from collections import deque
from typing import Any

from ..rlvcr.parsing import LEVEL_SYSTEM_PROMPT

__all__ = [
    "CONTAINERS",
    "EXITS",
    "OBJECTS",
    "ROOMS",
    "TEXTWORLD_RULES",
    "TextWorldEnv",
    "TextWorldToolEnv",
    "make_textworld_tasks",
    "split_worlds",
    "world_key",
]

ROOMS = ("kitchen", "hallway", "living room", "bedroom", "bathroom")

EXITS = {
    "kitchen": ("hallway", "living room"),
    "hallway": ("kitchen", "living room", "bedroom", "bathroom"),
    "living room": ("kitchen", "hallway"),
    "bedroom": ("hallway",),
    "bathroom": ("hallway",),
}

# container -> (room, openable). Openable containers start closed; the others are always open.
CONTAINERS = {
    "fridge": ("kitchen", True),
    "cabinet": ("kitchen", True),
    "box": ("living room", False),
    "drawer": ("bedroom", True),
    "basket": ("bathroom", False),
}

OBJECTS = ("apple", "mug", "book", "key", "soap", "towel", "coin")

TEXTWORLD_RULES = """You are in a small house with five rooms: kitchen, hallway, living room, bedroom and bathroom.
Valid actions:
- look: describe the room you are in
- inventory: list what you are carrying
- go <room>: move to an adjacent room
- open <container> / close <container>: open or close a container in this room
- take <object>: pick up an object on the floor or in an open container of this room
- put <object> in <container>: place an object you carry in an open container of this room
After each action you receive an observation. You have at most {max_steps} actions."""

_ARTICLES = frozenset({"the", "a", "an"})
_MAX_ECHO = 60  # characters of an invalid action echoed back in the observation


def _normalize(action: str) -> list[str]:
    """Lower-case words of an action, without punctuation at the end, articles and the "to" of "go to"."""
    words = action.lower().strip().rstrip(".!").split()
    words = [w for w in words if w not in _ARTICLES]
    if len(words) >= 2 and words[0] == "go" and words[1] == "to":
        words = [words[0]] + words[2:]
    return words


def _echo(action: str) -> str:
    action = " ".join(str(action).split())
    return action if len(action) <= _MAX_ECHO else action[:_MAX_ECHO] + "..."


def _join(items: list[str]) -> str:
    return ", ".join(items) if items else "nothing"


class TextWorldEnv:
    """The household text world with a plain text API.

    Call `reset(task_seed=...)` to start a task, then `step(action)` until `done`; `get_reward()` scores the episode.
    Every call of `step` before the episode ends counts as one step, valid or not, and the episode ends when the goal
    is reached or after `max_steps` steps.

    Reward: 1.0 when the goal object is in the goal container, else 0.0. With `step_cost > 0`, a success earns
    `max(0, 1 - step_cost * steps)` instead, to favour short solutions; a failure is always 0.0.

    Under TRL's `environment_factory` both `step` and `act` would be exposed as tools; use `TextWorldToolEnv` there.
    """

    def __init__(self):
        self.reset()

    def reset(
        self,
        task_seed: int = 0,
        max_steps: int = 20,
        step_cost: float = 0.0,
        show_actions: bool = True,
        **kwargs: Any,
    ) -> str:
        """Start the task drawn from `task_seed`.

        Args:
            task_seed (`int`, *optional*, defaults to `0`):
                Seed of the task layout (goal, object positions, start room).
            max_steps (`int`, *optional*, defaults to `20`):
                Number of steps after which the episode ends.
            step_cost (`float`, *optional*, defaults to `0.0`):
                Reward deducted per step from a success.
            show_actions (`bool`, *optional*, defaults to `True`):
                Whether observations end with the list of currently valid actions.
            **kwargs:
                Other fields of a dataset row (e.g. `prompt`), ignored: TRL passes the whole row to `reset`.

        Returns:
            `str`: the initial observation. TRL appends it to the last user message of the prompt.
        """
        if max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {max_steps}.")
        rng = random.Random(int(task_seed))
        self.task_seed = int(task_seed)
        self.max_steps = int(max_steps)
        self.step_cost = float(step_cost)
        self.show_actions = bool(show_actions)
        self.goal_container = rng.choice(sorted(CONTAINERS))
        self.goal_object = rng.choice(OBJECTS)
        self.floor = {room: [] for room in ROOMS}
        self.contents = {container: [] for container in CONTAINERS}
        self.is_open = {container: not openable for container, (_, openable) in CONTAINERS.items()}
        # The goal object starts anywhere except in the goal container; two distractors start anywhere.
        places = [("floor", room) for room in ROOMS] + [("in", c) for c in sorted(CONTAINERS)]
        self._place(self.goal_object, rng.choice([p for p in places if p != ("in", self.goal_container)]))
        for obj in rng.sample([o for o in OBJECTS if o != self.goal_object], 2):
            self._place(obj, rng.choice(places))
        self.location = rng.choice(ROOMS)
        self.inventory = []
        self.steps = 0
        self.invalid_actions = 0
        self.success = False
        self._done = False
        return self._with_actions(self._describe())

    @property
    def done(self) -> bool:
        """Whether the episode is over (goal reached or out of steps)."""
        return self._done

    @property
    def goal(self) -> str:
        """The task in words, e.g. "put the apple in the fridge"."""
        return f"put the {self.goal_object} in the {self.goal_container}"

    @property
    def admissible_actions(self) -> list[str]:
        """The actions that are valid in the current state, in a fixed order."""
        actions = ["look", "inventory"]
        actions += [f"go {room}" for room in EXITS[self.location]]
        for container in self._containers_here():
            if CONTAINERS[container][1]:
                actions.append(f"{'close' if self.is_open[container] else 'open'} {container}")
        actions += [f"take {obj}" for obj in self._reachable_objects()]
        for obj in self.inventory:
            actions += [f"put {obj} in {c}" for c in self._containers_here() if self.is_open[c]]
        return actions

    def get_reward(self) -> float:
        """Score of the episode so far.

        Returns:
            `float`: `max(0, 1 - step_cost * steps)` if the goal is reached, else 0.0.
        """
        if not self.success:
            return 0.0
        return max(0.0, 1.0 - self.step_cost * self.steps)

    def step(self, action: str) -> str:
        """Perform one action.

        Args:
            action (`str`):
                The action text, e.g. `"go kitchen"`, `"open fridge"`, `"take apple"`, `"put apple in fridge"`.
                Case, articles, "go to" and a final period are tolerated.

        Returns:
            `str`: the observation. An invalid action changes nothing (but counts as a step) and gets a message
            starting with "Nothing happens:".
        """
        if self._done:
            return "The episode is over."
        self.steps += 1
        if not isinstance(action, str):
            action = str(action)
        message, valid = self._apply(_normalize(action), action)
        if not valid:
            self.invalid_actions += 1
        if self.goal_object in self.contents[self.goal_container]:
            self.success = True
            self._done = True
            return f"{message}\nTask complete!"
        if self.steps >= self.max_steps:
            self._done = True
            return f"{message}\nThe episode is over: you are out of steps."
        return self._with_actions(message)

    def act(self, action: str) -> str:
        """Perform one action in the house and return what you observe.

        Args:
            action: The action to perform, one of "look", "inventory", "go <room>", "open <container>",
                "close <container>", "take <object>" or "put <object> in <container>".

        Returns:
            The observation after the action.
        """
        return self.step(action)

    def _checkpoint(self) -> dict:
        """A copy of the whole mutable state, for `_restore`."""
        return {
            "task_seed": self.task_seed,
            "max_steps": self.max_steps,
            "step_cost": self.step_cost,
            "show_actions": self.show_actions,
            "goal_object": self.goal_object,
            "goal_container": self.goal_container,
            "floor": {room: list(objs) for room, objs in self.floor.items()},
            "contents": {c: list(objs) for c, objs in self.contents.items()},
            "is_open": dict(self.is_open),
            "location": self.location,
            "inventory": list(self.inventory),
            "steps": self.steps,
            "invalid_actions": self.invalid_actions,
            "success": self.success,
            "done": self._done,
        }

    def _restore(self, state: dict) -> None:
        """Return to a state taken by `_checkpoint` (the state can be restored again later)."""
        self.task_seed = state["task_seed"]
        self.max_steps = state["max_steps"]
        self.step_cost = state["step_cost"]
        self.show_actions = state["show_actions"]
        self.goal_object = state["goal_object"]
        self.goal_container = state["goal_container"]
        self.floor = {room: list(objs) for room, objs in state["floor"].items()}
        self.contents = {c: list(objs) for c, objs in state["contents"].items()}
        self.is_open = dict(state["is_open"])
        self.location = state["location"]
        self.inventory = list(state["inventory"])
        self.steps = state["steps"]
        self.invalid_actions = state["invalid_actions"]
        self.success = state["success"]
        self._done = state["done"]

    def _oracle_actions(self) -> list[str]:
        """A shortest plan from the current state to the goal (for tests, demonstrations and sanity checks)."""
        plan = []
        location = self.location
        opened = set()

        def walk(target: str) -> None:
            nonlocal location
            route = self._route(location, target)
            plan.extend(f"go {room}" for room in route)
            location = target

        def ensure_open(container: str) -> None:
            if not self.is_open[container] and container not in opened:
                plan.append(f"open {container}")
                opened.add(container)

        obj = self.goal_object
        if obj not in self.inventory:
            kind, where = self._goal_place()
            if kind == "floor":
                walk(where)
            else:
                walk(CONTAINERS[where][0])
                ensure_open(where)
            plan.append(f"take {obj}")
        walk(CONTAINERS[self.goal_container][0])
        ensure_open(self.goal_container)
        plan.append(f"put {obj} in {self.goal_container}")
        return plan

    # ---- internals ----

    def _goal_place(self) -> tuple[str, str]:
        """Where the goal object lies, as `_place` takes it: `("in", container)` or `("floor", room)` (not carried)."""
        obj = self.goal_object
        where = next((c for c, objs in self.contents.items() if obj in objs), None)
        if where is not None:
            return "in", where
        return "floor", next(room for room, objs in self.floor.items() if obj in objs)

    def _place(self, obj: str, place: tuple[str, str]) -> None:
        kind, where = place
        (self.floor[where] if kind == "floor" else self.contents[where]).append(obj)

    def _containers_here(self) -> list[str]:
        return [c for c, (room, _) in CONTAINERS.items() if room == self.location]

    def _reachable_objects(self) -> list[str]:
        objs = list(self.floor[self.location])
        for c in self._containers_here():
            if self.is_open[c]:
                objs += self.contents[c]
        return objs

    @staticmethod
    def _route(start: str, target: str) -> list[str]:
        """Rooms visited after `start` on a shortest path to `target` (breadth-first search)."""
        previous = {start: None}
        queue = deque([start])
        while queue:
            room = queue.popleft()
            for nxt in EXITS[room]:
                if nxt not in previous:
                    previous[nxt] = room
                    queue.append(nxt)
        route = []
        while target != start:
            route.append(target)
            target = previous[target]
        return route[::-1]

    def _describe(self) -> str:
        containers = []
        for c in self._containers_here():
            if not self.is_open[c]:
                containers.append(f"{c} (closed)")
            else:
                containers.append(f"{c} (open, contains: {_join(self.contents[c])})")
        return (
            f"You are in the {self.location}.\n"
            f"Containers: {_join(containers)}.\n"
            f"On the floor: {_join(self.floor[self.location])}.\n"
            f"Exits: {', '.join(EXITS[self.location])}.\n"
            f"You are carrying: {_join(self.inventory)}."
        )

    def _with_actions(self, message: str) -> str:
        if not self.show_actions:
            return message
        return f"{message}\nAvailable actions: {', '.join(self.admissible_actions)}."

    def _apply(self, words: list[str], raw: str) -> tuple[str, bool]:
        """Apply a normalised action; returns (message, valid)."""
        if not words:
            return "Nothing happens: the action is empty.", False
        verb, rest = words[0], " ".join(words[1:])
        if verb == "look" and not rest:
            return self._describe(), True
        if verb == "inventory" and not rest:
            return f"You are carrying: {_join(self.inventory)}.", True
        if verb == "go" and rest:
            if rest not in ROOMS:
                return f"Nothing happens: there is no room called '{_echo(rest)}'.", False
            if rest == self.location:
                return f"Nothing happens: you are already in the {rest}.", False
            if rest not in EXITS[self.location]:
                return f"Nothing happens: the {rest} is not adjacent to the {self.location}.", False
            self.location = rest
            return self._describe(), True
        if verb in ("open", "close") and rest:
            return self._open_close(verb, rest)
        if verb == "take" and rest:
            return self._take(rest)
        if verb == "put" and rest:
            return self._put(words[1:])
        return (
            f"Nothing happens: unknown action '{_echo(raw)}'. Valid actions are look, inventory, go <room>, "
            "open <container>, close <container>, take <object> and put <object> in <container>.",
            False,
        )

    def _container_here(self, name: str) -> tuple[str | None, str]:
        if name not in CONTAINERS:
            return None, f"Nothing happens: there is no container called '{_echo(name)}'."
        if CONTAINERS[name][0] != self.location:
            return None, f"Nothing happens: there is no {name} in the {self.location}."
        return name, ""

    def _open_close(self, verb: str, name: str) -> tuple[str, bool]:
        container, error = self._container_here(name)
        if container is None:
            return error, False
        if not CONTAINERS[container][1]:
            return f"Nothing happens: the {container} cannot be opened or closed.", False
        want_open = verb == "open"
        if self.is_open[container] == want_open:
            return f"Nothing happens: the {container} is already {'open' if want_open else 'closed'}.", False
        self.is_open[container] = want_open
        if want_open:
            return f"You open the {container}. It contains: {_join(self.contents[container])}.", True
        return f"You close the {container}.", True

    def _take(self, rest: str) -> tuple[str, bool]:
        obj, _, source = rest.partition(" from ")
        if obj not in OBJECTS:
            return f"Nothing happens: there is no object called '{_echo(obj)}'.", False
        if obj in self.inventory:
            return f"Nothing happens: you are already carrying the {obj}.", False
        if source:
            container, error = self._container_here(source)
            if container is None:
                return error, False
            if not self.is_open[container]:
                return f"Nothing happens: the {container} is closed.", False
            if obj not in self.contents[container]:
                return f"Nothing happens: there is no {obj} in the {container}.", False
            self.contents[container].remove(obj)
        elif obj in self.floor[self.location]:
            self.floor[self.location].remove(obj)
        else:
            # Objects in closed containers are invisible.
            container = next((c for c in self._containers_here() if self.is_open[c] and obj in self.contents[c]), None)
            if container is None:
                return f"Nothing happens: you see no {obj} here.", False
            self.contents[container].remove(obj)
        self.inventory.append(obj)
        return f"You take the {obj}.", True

    def _put(self, words: list[str]) -> tuple[str, bool]:
        split = next((i for i, w in enumerate(words) if w in ("in", "on", "into")), None)
        if split is None or split == 0 or split == len(words) - 1:
            return "Nothing happens: use 'put <object> in <container>'.", False
        obj, name = " ".join(words[:split]), " ".join(words[split + 1 :])
        if obj not in self.inventory:
            return f"Nothing happens: you are not carrying '{_echo(obj)}'.", False
        container, error = self._container_here(name)
        if container is None:
            return error, False
        if not self.is_open[container]:
            return f"Nothing happens: the {container} is closed.", False
        self.inventory.remove(obj)
        self.contents[container].append(obj)
        return f"You put the {obj} in the {container}.", True


class TextWorldToolEnv:
    """`TextWorldEnv` for TRL's tool calling: `act` is the only tool.

    Use it as `GRPOTrainer(..., environment_factory=TextWorldToolEnv)` with rows from
    `make_textworld_tasks(..., tool_format=True)`. The reward comes from `get_reward`.
    """

    def __init__(self):
        self._world = TextWorldEnv()

    @property
    def world(self) -> TextWorldEnv:
        """The wrapped text world."""
        return self._world

    @property
    def done(self) -> bool:
        """Whether the episode is over."""
        return self._world.done

    def reset(self, **kwargs: Any) -> str:
        """Start a task; see `TextWorldEnv.reset` for the fields read from the dataset row.

        Args:
            **kwargs:
                The dataset row.

        Returns:
            `str`: the initial observation.
        """
        return self._world.reset(**kwargs)

    def get_reward(self) -> float:
        """Score of the episode; see `TextWorldEnv.get_reward`.

        Returns:
            `float`: the reward.
        """
        return self._world.get_reward()

    def act(self, action: str) -> str:
        """Perform one action in the house and return what you observe.

        Args:
            action: The action to perform, one of "look", "inventory", "go <room>", "open <container>",
                "close <container>", "take <object>" or "put <object> in <container>".

        Returns:
            The observation after the action.
        """
        return self._world.step(action)

    def _checkpoint(self) -> dict:
        return self._world._checkpoint()

    def _restore(self, state: dict) -> None:
        self._world._restore(state)


def world_key(env: TextWorldEnv) -> str:
    """What makes two tasks the same task: the goal, where the goal object starts and the start room.

    Two task seeds with the same key differ only in where the two distractor objects lie, which changes the
    observations a little and the shortest plan not at all. E.g. `"apple>fridge|floor:bedroom|hallway"`.

    Args:
        env (`TextWorldEnv`): A world right after `reset`.

    Returns:
        `str`: The key.
    """
    kind, where = env._goal_place()
    return f"{env.goal_object}>{env.goal_container}|{kind}:{where}|{env.location}"


@functools.cache
def _world_plans() -> dict[str, int]:
    """Every world key (7 objects x 5 containers x 9 starting places x 5 start rooms = 1575) with the length of
    its shortest plan, computed on the layout itself (no distractors)."""
    env = TextWorldEnv()
    plans = {}
    places = [("floor", room) for room in ROOMS] + [("in", c) for c in sorted(CONTAINERS)]
    for obj in OBJECTS:
        for container in sorted(CONTAINERS):
            for place in places:
                if place == ("in", container):
                    continue
                for room in ROOMS:
                    env.reset()
                    env.goal_object, env.goal_container, env.location = obj, container, room
                    env.floor = {r: [] for r in ROOMS}
                    env.contents = {c: [] for c in CONTAINERS}
                    env._place(obj, place)
                    plans[world_key(env)] = len(env._oracle_actions())
    return plans


@functools.cache  # every build of a text-world set calls it (frozensets: safe to share)
def split_worlds(heldout_fraction: float, max_plan_steps: int = 0) -> tuple[frozenset[str], frozenset[str]]:
    """Split the text worlds (`world_key`) into training and held-out ones.

    The split is fixed: a seeded shuffle of the keys, cut at `heldout_fraction` within each shortest-plan length (so
    that every length, and any `max_plan_steps` filter, keeps that share held out), the same for every `task_seed`, so
    that no set built from any seed puts a held-out world into training.

    Args:
        heldout_fraction (`float`): Share of the worlds held out, in [0, 1].
        max_plan_steps (`int`, *optional*, defaults to `0`): Keep only worlds whose shortest plan has at most this
            many steps (0: all).

    Returns:
        `tuple[frozenset[str], frozenset[str]]`: The training and the held-out world keys.
    """
    if not 0.0 <= heldout_fraction <= 1.0:
        raise ValueError(f"`heldout_fraction` must be in [0, 1], got {heldout_fraction}.")
    train: set[str] = set()
    heldout: set[str] = set()
    by_length: dict[int, list[str]] = {}
    for key, length in sorted(_world_plans().items()):
        by_length.setdefault(length, []).append(key)
    for length, keys in sorted(by_length.items()):
        if max_plan_steps and length > max_plan_steps:
            continue
        random.Random(length).shuffle(keys)
        cut = round(heldout_fraction * len(keys))
        heldout.update(keys[:cut])
        train.update(keys[cut:])
    return frozenset(train), frozenset(heldout)


def _task_seeds(
    rng: random.Random,
    n: int,
    env: TextWorldEnv,
    max_steps: int,
    max_plan_steps: int,
    worlds: frozenset[str] | None = None,
    distinct_worlds: bool = False,
) -> list[int]:
    """`n` distinct task seeds; with `max_plan_steps`, of tasks whose shortest plan is that short at most; with
    `worlds`, of tasks whose `world_key` is one of them; with `distinct_worlds`, of `n` different worlds."""
    if n == 0:  # no warm start, no held-out tasks: nothing to draw (the search below would find "fewer than 0")
        return []
    if not max_plan_steps and worlds is None:
        return rng.sample(range(2**31), n)  # the historical draw: datasets stay what they were
    plans = _world_plans()
    allowed = [k for k in (plans if worlds is None else worlds) if not max_plan_steps or plans[k] <= max_plan_steps]
    if distinct_worlds and n > len(allowed):
        raise ValueError(
            f"Only {len(allowed)} distinct text worlds are available here (plans of at most {max_plan_steps or 'any'} "
            f"steps), fewer than the {n} asked for."
        )
    if not allowed:
        raise ValueError(f"No text world has a plan of at most {max_plan_steps} steps (`textworld_max_plan_steps`).")
    allowed_set = set(allowed)
    seeds: list[int] = []
    seen_seeds: set[int] = set()
    seen_worlds: set[str] = set()
    # Worlds are equally likely (1 in 1575 per draw): this bound is never reached while `n` worlds exist.
    for _ in range(10_000 * (n + len(plans))):
        task_seed = rng.randrange(2**31)
        if task_seed in seen_seeds:
            continue
        seen_seeds.add(task_seed)
        env.reset(task_seed=task_seed, max_steps=max_steps)
        key = world_key(env)
        if key not in allowed_set or (distinct_worlds and key in seen_worlds):
            continue
        seen_worlds.add(key)
        seeds.append(task_seed)
        if len(seeds) == n:
            return seeds
    raise RuntimeError(f"Drew only {len(seeds)} of {n} text-world tasks.")


def make_textworld_tasks(
    n: int,
    seed: int = 0,
    *,
    max_steps: int = 20,
    step_cost: float = 0.0,
    show_actions: bool = True,
    tool_format: bool = False,
    max_plan_steps: int = 0,
    split: str | None = None,
    heldout_fraction: float = 0.25,
) -> list[dict]:
    """Dataset rows for the text world.

    Each row has a conversational `prompt` (a system message with the rules and the goal, and a user message that the
    environment's `reset` completes with the initial observation) and the fields `reset` reads (`task_seed`,
    `max_steps`, `step_cost`, `show_actions`), plus `goal` and `world` (`world_key`) for reading.

    Args:
        n (`int`):
            Number of tasks.
        seed (`int`, *optional*, defaults to `0`):
            Seed from which the distinct task seeds are drawn.
        max_steps (`int`, *optional*, defaults to `20`):
            Step budget of each episode.
        step_cost (`float`, *optional*, defaults to `0.0`):
            Reward deducted per step from a success.
        show_actions (`bool`, *optional*, defaults to `True`):
            Whether observations list the valid actions.
        tool_format (`bool`, *optional*, defaults to `False`):
            `False`: the system prompt is `LEVEL_SYSTEM_PROMPT` (answer with `<level>`, `<think>`, `<action>`
            blocks). `True`: the system prompt asks for calls of the `act` tool (for `TextWorldToolEnv`).
        max_plan_steps (`int`, *optional*, defaults to `0`):
            Keep only tasks whose shortest plan has at most this many steps (0: any). A rollout budget of k tool
            rounds can solve only tasks of plans up to k steps.
        split (`str`, *optional*):
            `"train"`: only training worlds of `split_worlds(heldout_fraction)`; `"heldout"`: only held-out worlds, each
            row a different one (raises `ValueError` when fewer than `n` exist). `None`: any world (rows of one seed
            can then share worlds with rows of another).
        heldout_fraction (`float`, *optional*, defaults to `0.25`):
            Share of held-out worlds of the split (with `split`).

    Returns:
        `list[dict]`: the rows.
    """
    if split not in (None, "train", "heldout"):
        raise ValueError(f"`split` must be None, 'train' or 'heldout', got {split!r}.")
    worlds = None if split is None else split_worlds(heldout_fraction)[split == "heldout"]
    rng = random.Random(seed)
    env = TextWorldEnv()
    rows: list[dict] = []
    for task_seed in _task_seeds(rng, n, env, max_steps, max_plan_steps, worlds, distinct_worlds=split == "heldout"):
        env.reset(task_seed=task_seed, max_steps=max_steps)
        rules = TEXTWORLD_RULES.format(max_steps=max_steps)
        if tool_format:
            system = (
                f"{rules}\nPerform each action by calling the `act` tool with the action text. Stop calling tools "
                f"once the task is complete.\n\nYour task is to: {env.goal}."
            )
        else:
            system = f"{LEVEL_SYSTEM_PROMPT}\n\n{rules}\n\nYour task is to: {env.goal}."
        rows.append(
            {
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": "Observation:\n"}],
                "task_seed": task_seed,
                "max_steps": max_steps,
                "step_cost": step_cost,
                "show_actions": show_actions,
                "goal": env.goal,
                "world": world_key(env),
            }
        )
    return rows
