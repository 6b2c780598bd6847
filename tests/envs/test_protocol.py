"""Checkpoint/restore helpers and TRL-compatible tool discovery (`trl_agentic.envs.protocol`)."""

import random
import socket
import threading

import pytest
from transformers.utils import get_json_schema

from trl_agentic.envs.calculator import CalculatorEnv
from trl_agentic.envs.protocol import check_checkpointable, checkpoint_env, restore_env, tool_methods
from trl_agentic.envs.python_sandbox import PythonSandboxEnv


class CounterEnv:
    """Plain environment: no `_checkpoint`/`_restore`, so the default deep copy applies."""

    def __init__(self):
        self.count = 0
        self.history: list[list[int]] = []
        self.rng = random.Random(0)

    def reset(self, **row) -> None:
        self.count = 0
        self.history = []

    def get_reward(self) -> float:
        return float(self.count)

    def increment(self, amount: int) -> str:
        """
        Add to the counter.

        Args:
            amount: How much to add.
        """
        self.count += amount
        self.history.append([amount, self.rng.randint(0, 1000)])
        return str(self.count)

    @property
    def doubled(self) -> int:
        raise AssertionError("tool discovery must not evaluate properties")

    def _helper(self) -> None:
        pass


class SocketEnv(CounterEnv):
    def __init__(self):
        super().__init__()
        self.connection = socket.socket()


class LockEnv(CounterEnv):
    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()


class CustomStateEnv(SocketEnv):
    """Holds a socket, but saves only what matters."""

    def _checkpoint(self) -> int:
        return self.count

    def _restore(self, state: int) -> None:
        self.count = state


class HalfStateEnv(CounterEnv):
    def _checkpoint(self) -> int:
        return self.count


class SlotsEnv:
    __slots__ = ("count",)

    def reset(self, **row) -> None:
        pass


@pytest.fixture
def closing():
    """Closes sockets created by the test's environments."""
    envs = []
    yield envs.append
    for env in envs:
        env.connection.close()


def test_tool_methods_match_trl_discovery():
    env = CounterEnv()
    tools = tool_methods(env)
    assert list(tools) == ["increment"]  # not reset, get_reward, _helper, properties or dunders
    assert tools["increment"](2) == "2"  # bound to the instance
    assert env.count == 2
    assert list(tool_methods(CalculatorEnv())) == ["calculate"]
    assert list(tool_methods(PythonSandboxEnv())) == ["python"]
    assert list(tool_methods(CustomStateEnv.__new__(CustomStateEnv))) == ["increment"]  # _checkpoint is no tool


@pytest.mark.parametrize("factory", [CounterEnv, CalculatorEnv, PythonSandboxEnv])
def test_every_tool_has_a_valid_json_schema(factory):
    env = factory()
    for name, method in tool_methods(env).items():
        for function in (method, getattr(type(env), name)):  # TRL passes bound methods; check the plain function too
            schema = get_json_schema(function)
            assert schema["type"] == "function"
            schema = schema["function"]
            assert schema["name"] == name
            assert schema["description"]
            parameters = schema["parameters"]
            assert "self" not in parameters["properties"]
            assert set(parameters["required"]) == set(parameters["properties"])
            # Docstring indentation must not leak into what the model reads.
            descriptions = [schema["description"], schema.get("return", {}).get("description", "")]
            descriptions += [spec["description"] for spec in parameters["properties"].values()]
            assert not any("\n " in text for text in descriptions), descriptions
            for spec in parameters["properties"].values():
                assert spec["type"] == "string" or spec["type"] == "integer"
                assert spec["description"]


def test_default_checkpoint_round_trip():
    env = CounterEnv()
    env.increment(3)
    state = checkpoint_env(env)
    after_checkpoint = [env.rng.random() for _ in range(3)]

    env.increment(4)
    env.history[0].append(99)  # mutate a nested object in place: the checkpoint must not see it
    env.extra = "added after the checkpoint"
    restore_env(env, state)
    assert env.count == 3
    assert env.history == [state["history"][0]] and len(env.history[0]) == 2
    assert not hasattr(env, "extra")
    assert [env.rng.random() for _ in range(3)] == after_checkpoint  # the RNG state was restored too

    # The same checkpoint can be restored again, even after the restored state was modified.
    env.increment(10)
    env.history[0].append(7)
    restore_env(env, state)
    assert env.count == 3 and len(env.history[0]) == 2


def test_custom_checkpoint_methods_are_used(closing):
    env = CustomStateEnv()
    closing(env)
    check_checkpointable(env)  # the socket is fine: the env saves its own state
    env.increment(5)
    state = checkpoint_env(env)
    assert state == 5
    env.increment(1)
    restore_env(env, state)
    assert env.count == 5


@pytest.mark.parametrize(
    ("factory", "attribute", "kind"), [(SocketEnv, "connection", "socket"), (LockEnv, "lock", "lock")]
)
def test_uncopyable_env_gets_a_clear_error(factory, attribute, kind, closing):
    env = factory()
    if factory is SocketEnv:
        closing(env)
    with pytest.raises(TypeError) as info:
        check_checkpointable(env)
    message = str(info.value)
    assert factory.__qualname__ in message
    assert repr(attribute) in message
    assert kind in message.lower()
    assert "_checkpoint" in message and "_restore" in message


def test_copyable_env_passes_check():
    check_checkpointable(CounterEnv())
    check_checkpointable(CalculatorEnv())
    check_checkpointable(PythonSandboxEnv())


def test_half_defined_state_methods_are_rejected():
    env = HalfStateEnv()
    for call in (check_checkpointable, checkpoint_env):
        with pytest.raises(TypeError, match=r"HalfStateEnv defines `_checkpoint` but not `_restore`"):
            call(env)
    with pytest.raises(TypeError, match="_restore"):
        restore_env(env, 0)


def test_slots_env_is_rejected_with_advice():
    with pytest.raises(TypeError, match=r"SlotsEnv has no instance `__dict__`.*_checkpoint"):
        check_checkpointable(SlotsEnv())
