"""BFCL multi-turn environment: official schemas, tool groups, user turns, ground-truth replay, rollback."""

import ast
import copy
import json

import pytest
from transformers.utils import get_json_schema

from trl_agentic.envs.bfcl.checker import official_verdict
from trl_agentic.envs.bfcl.data import (
    API_CLASSES,
    CATEGORIES,
    build_api_instances,
    function_docs,
    get_task,
    load_tasks,
)
from trl_agentic.envs.bfcl.env import ADDITIONAL_FUNCTION_PROMPT, environment_class, tool_group
from trl_agentic.envs.bfcl.schema import official_json_schema
from trl_agentic.envs.bfcl.traces import play_ground_truth
from trl_agentic.envs.protocol import (
    UserTurn,
    check_checkpointable,
    checkpoint_env,
    has_user_turns,
    next_user_turn,
    restore_env,
    tool_methods,
)
from trl_agentic.errors import ToolCallError

# Tasks whose ground truth cannot be replayed through the environment, and why.
UNREPLAYABLE = {
    # The ground truth of turn 1 calls `tail`, which this task holds out until turn 3 (`missed_function`). BFCL's
    # executor runs any method of the involved classes whether or not the model was shown it; the environment only
    # exposes a held-out function from its turn on, so the call is refused ("Tool tail not found.").
    "multi_turn_miss_func_49": "ground truth calls the held-out function `tail` in turn 1; it is made available at turn 3",
}


def _state_equal(a: dict, b: dict) -> bool:
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import state_checker

    return state_checker(a, b)["valid"]


# -- schemas ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("class_name", API_CLASSES)
def test_rendered_schemas_are_the_official_docs(class_name):
    """What TRL renders (transformers' get_json_schema on the bound methods) is the official function doc."""
    from trl_agentic.envs.bfcl.env import ToolGroup

    env = environment_class(ToolGroup((class_name,)))()
    tools = tool_methods(env)
    docs = {doc["name"]: doc for doc in function_docs(class_name)}
    assert set(tools) == set(docs)
    for name, doc in docs.items():
        rendered = get_json_schema(tools[name])
        official = official_json_schema(doc)
        if name == "edit_ticket":  # the one `dict` parameter with keys: they are listed in its description
            nested = official["function"]["parameters"]["properties"]["updates"].pop("properties")
            description = rendered["function"]["parameters"]["properties"]["updates"].pop("description")
            official["function"]["parameters"]["properties"]["updates"].pop("description")
            for key, spec in nested.items():
                assert f"{key} ({spec['type']}): {spec['description']}" in description
        assert rendered == official, name
        # The official doc, independently: raw types mapped by hand, required list as in the file.
        raw = doc["parameters"]
        props = rendered["function"]["parameters"]["properties"]
        assert list(props) == list(raw["properties"])
        assert rendered["function"]["parameters"].get("required", []) == raw["required"]
        for param, spec in raw["properties"].items():
            expected = {"float": "number", "dict": "object"}.get(spec["type"], spec["type"])
            assert props[param]["type"] == expected


def test_tool_call_reaches_the_api_with_the_models_arguments():
    task = get_task("multi_turn_base_0")
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    assert env.cd(folder="document") == json.dumps({"current_working_directory": "document"})  # as BFCL writes it
    # The API reports a failure as a returned {"error": ...}: raised as a typed error, rendered by TRL as the same
    # text, counted as a failed call by both loops (a returned value never is).
    api = env._apis[env._owners["mv"]]
    expected = api.mv(source="nope.txt", destination="x")
    assert set(expected) == {"error"}
    with pytest.raises(ToolCallError) as info:
        env.mv(source="nope.txt", destination="x")
    assert info.value.error_type == "ToolError" and str({"error": str(info.value)}) == str(expected)
    with pytest.raises(TypeError):  # an argument the API method does not take
        env.cd(directory="document")
    assert env._turn_calls == [
        ["cd(folder='document')", "mv(source='nope.txt',destination='x')", "cd(directory='document')"]
    ]


# -- tool groups, user turns ------------------------------------------------------------------------------------------


def test_tool_group_hides_excluded_and_held_out_functions():
    task = get_task("multi_turn_miss_func_0")
    assert task.excluded_functions == ["cp"] and task.missed_functions == {3: ["sort"]}
    env = environment_class(tool_group(task))()
    every = {d["name"] for c in task.involved_classes for d in function_docs(c)}
    assert set(tool_methods(env)) == every - {"cp", "sort"}
    shown = environment_class(tool_group(task, hide_excluded=False))()
    assert set(tool_methods(shown)) == every - {"sort"}
    # One class per group, shared by the tasks of the group.
    assert environment_class(tool_group(task)) is type(env)
    assert tool_group(get_task("multi_turn_base_0")).name == "bfcl:GorillaFileSystem+TwitterAPI-cp"


def test_user_turns_follow_the_task_and_add_the_held_out_function():
    task = get_task("multi_turn_miss_func_0")
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    assert has_user_turns(env)
    contents = []
    added = {}
    while (turn := next_user_turn(env, {"role": "assistant", "content": "ok"})) is not None:
        assert isinstance(turn, UserTurn) and turn.remove_tools == []
        contents.append(turn.content)
        added.update({tool.__name__: tool for tool in turn.add_tools})
    # Turns 1..4: two user messages, then BFCL's message with the new function's schema, then the last message.
    assert contents[0] == task.turns[1][0]["content"] and contents[1] == task.turns[2][0]["content"]
    assert contents[2].endswith("\n" + ADDITIONAL_FUNCTION_PROMPT)
    schema = get_json_schema(added["sort"])
    assert contents[2].startswith('{"type": "function", "function": {"name": "sort"')
    assert schema == official_json_schema(next(d for d in function_docs("GorillaFileSystem") if d["name"] == "sort"))
    assert contents[3] == task.turns[4][0]["content"]
    assert len(env._turn_calls) == len(task.turns) == 5
    # The added tool runs on this episode's API state.
    env._apis["GorillaFileSystem"].cd(folder="document")
    assert "sorted_content" in added["sort"](file_name="final_report.pdf")


def test_reset_refuses_a_task_of_another_group():
    env = environment_class(tool_group(get_task("multi_turn_base_0")))()
    with pytest.raises(ValueError, match="environment"):
        env.reset(bfcl_id="multi_turn_base_66")


# -- ground-truth replay (environment level) --------------------------------------------------------------------------


@pytest.mark.parametrize("category", CATEGORIES)
def test_ground_truth_replay_scores_100_percent_with_the_official_checker(category):
    """Every task's ground truth, played tool call by tool call and turn by turn through the environment, is valid
    for the official checker (except the tasks named in UNREPLAYABLE, which fail for the reason given)."""
    failures = {}
    for task in load_tasks(category):
        episode = play_ground_truth(task)
        verdict = episode.env._official_verdict()
        if not verdict["valid"] or episode.tool_errors:
            failures[task.id] = (verdict, episode.tool_errors)
    expected = {k for k in UNREPLAYABLE if k.startswith(f"multi_turn_{category}_")}
    assert set(failures) == expected, {k: v for k, v in failures.items() if k not in expected}
    for task_id in expected:
        verdict, errors = failures[task_id]
        assert errors and "Tool tail not found" in errors[0]


def test_replay_checks_can_fail():
    """The same replay with one ground-truth call dropped, or cut before the last turn, is not valid."""
    task = get_task("multi_turn_base_0")
    calls = play_ground_truth(task).env._turn_calls
    assert official_verdict(task, calls)["valid"]
    dropped = copy.deepcopy(calls)
    dropped[1].pop()  # the grep of turn 1
    verdict = official_verdict(task, dropped)
    assert not verdict["valid"] and verdict["error_type"] == "multi_turn:execution_response_mismatch"
    assert official_verdict(task, calls[:-1])["error_type"] == "multi_turn:force_terminated"


def test_long_context_states_are_loaded_like_the_checker():
    base, long = get_task("multi_turn_base_0"), get_task("multi_turn_long_context_0")
    assert base.initial_config == long.initial_config
    short_fs = build_api_instances(base)["GorillaFileSystem"]
    long_fs = build_api_instances(long)["GorillaFileSystem"]
    assert len(repr(vars(long_fs))) > 2 * len(repr(vars(short_fs)))


def test_a_long_context_episode_and_its_verdicts_leave_later_episodes_as_they_were():
    """TravelAPI's long-context credit cards are `long_context` module dicts that `_load_scenario` merges by reference:
    a booking, rolled back, still charged the card of every later episode, and each verdict on it (the checker's
    replay) charged it again (8200 -> 8000 -> 7800 ...)."""
    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

    task = get_task("multi_turn_long_context_153")
    assert task.involved_classes == ["TravelAPI"]
    card = "4567890145678901"
    official = long_context.CREDIT_CARD_EXTENSION[card]["balance"]
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    api = env._apis["TravelAPI"]
    booking = dict(card_id=card, travel_date="2024-12-15", travel_from="SFO", travel_to="LAX", travel_class="economy")
    before = checkpoint_env(env)
    assert json.loads(env.book_flight(access_token=api.access_token, **booking))["booking_status"]
    assert env._apis["TravelAPI"].credit_card_list[card]["balance"] < official  # charged in this episode
    restore_env(env, before)
    conversation = [
        ["book_flight(access_token='abc123xyz'," + ",".join(f"{k}={v!r}" for k, v in booking.items()) + ")"]
    ]
    for _ in range(2):
        official_verdict(task, conversation + [[] for _ in task.ground_truth[1:]])
    fresh = environment_class(tool_group(task))()
    fresh.reset(bfcl_id=task.id)
    assert fresh._apis["TravelAPI"].credit_card_list[card]["balance"] == official
    assert long_context.CREDIT_CARD_EXTENSION[card]["balance"] == official


# -- rollback on a real API -------------------------------------------------------------------------------------------


def test_rollback_of_a_failing_call_with_side_effects_leaves_the_ground_truth_state():
    """VehicleControlAPI.set_navigation stores the destination, then fails (TypeError) on a non-string one: restoring
    the checkpoint taken before the call, then making the right call, gives the state of a run without the failing
    call (the checker's own state comparison), and the episode's verdict is valid."""
    task = get_task("multi_turn_base_66")
    env = environment_class(tool_group(task))()
    check_checkpointable(env)
    env.reset(bfcl_id=task.id)
    reference = build_api_instances(task)  # the run without the failing call
    checkpoint = checkpoint_env(env)
    with pytest.raises(TypeError):
        env.set_navigation(destination={"street": "1914 7th St", "city": "Berkeley"})
    assert env._apis["VehicleControlAPI"].destination == {"street": "1914 7th St", "city": "Berkeley"}
    assert not _state_equal(env._apis, reference)  # the failed call changed the state...
    restore_env(env, checkpoint)
    assert _state_equal(env._apis, reference)  # ...and the restore undid it, call record included
    assert env._turn_calls == [[]]
    # Finish the conversation with the ground truth: valid, and the state equals the ground-truth run's.
    env.estimate_drive_feasibility_by_mileage(distance=450.0)
    reference["VehicleControlAPI"].estimate_drive_feasibility_by_mileage(distance=450.0)
    assert _state_equal(env._apis, reference)
    for turn, calls in enumerate(
        [
            [("fillFuelTank", {"fuelAmount": 30})],
            [
                ("lockDoors", {"unlock": False, "door": ["driver", "passenger", "rear_left", "rear_right"]}),
                ("pressBrakePedal", {"pedalPosition": 1.0}),
                ("startEngine", {"ignitionMode": "START"}),
            ],
            [("set_navigation", {"destination": "2107 Channing Way, Berkeley, CA"})],
        ],
        start=1,
    ):
        assert next_user_turn(env, {"role": "assistant", "content": "Done."}).content == task.turns[turn][0]["content"]
        for name, arguments in calls:
            getattr(env, name)(**arguments)
    assert next_user_turn(env, {"role": "assistant", "content": "Done."}) is None
    assert env._official_verdict() == {"valid": True}


def test_without_the_restore_the_failed_call_makes_the_episode_invalid():
    """Control for the test above: the failed call left in place changes the state the checker sees."""
    task = get_task("multi_turn_base_66")
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    with pytest.raises(TypeError):
        env.set_navigation(destination={"street": "1914 7th St", "city": "Berkeley"})
    env.estimate_drive_feasibility_by_mileage(distance=450.0)
    verdict = official_verdict(task, env._turn_calls + [["fillFuelTank(fuelAmount=30)"], [], []])
    assert not verdict["valid"] and verdict["error_type"] == "multi_turn:instance_state_mismatch"


def test_checkpoint_restores_random_state_and_can_be_restored_twice():
    """TravelAPI draws ids from a private seeded generator: a restored state draws the same ids again."""
    task = next(t for t in load_tasks("base") if t.involved_classes == ["TravelAPI"])
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    checkpoint = checkpoint_env(env)
    draws = []
    for _ in range(2):
        restore_env(env, checkpoint)
        draws.append([env._apis["TravelAPI"]._random.random() for _ in range(3)])
    assert draws[0] == draws[1]


def test_the_api_never_aliases_the_calls_arguments():
    """TwitterAPI keeps a tweet's `mentions` list and `mention` extends it later: the list of the call (as the
    conversation's message holds it) must stay as the model wrote it."""
    task = get_task("multi_turn_base_147")
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    arguments = {"content": "Up!", "tags": ["#TechBoom"], "mentions": ["@industryexperts"]}
    tweet = json.loads(env.post_tweet(**arguments))
    env.mention(tweet_id=tweet["id"], mentioned_usernames=["@technewsworld"])
    assert arguments["mentions"] == ["@industryexperts"]
    assert env._apis["TwitterAPI"].tweets[tweet["id"]]["mentions"] == ["@industryexperts", "@technewsworld"]


def test_an_argument_name_that_is_code_is_refused_and_never_runs(tmp_path):
    """The checker `eval`s the recorded call string, as BFCL's own pipeline does with its decoder's strings: a JSON key
    written as code ran it in the trainer (touched the file). It is now the `TypeError` of an unknown argument, and
    not recorded."""
    task = get_task("multi_turn_base_0")
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    marker = tmp_path / "ran"
    key = f"file_name=__import__('os').system('touch {marker}') or 'a.txt',content"
    for name in (key, "class", "a b", "x)"):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            env.touch(**{name: "x"})
    assert env._turn_calls == [[]]
    official_verdict(task, [[f"touch({key}='x')"]] + [[] for _ in task.ground_truth[1:]])  # the old recording
    assert marker.exists()  # the checker itself runs whatever string it is given: only ours are checked
    marker.unlink()
    official_verdict(task, env._turn_calls + [[] for _ in task.ground_truth[1:]])
    assert not marker.exists()


def test_a_call_gets_the_argument_values_the_checker_gets():
    """A `NaN` argument (JSON allows it, Python's literal syntax does not) fails in the environment as in the checker's
    replay, and the state is the checker's. Natively, it set the fuel level to nan and reported success."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    task = get_task("multi_turn_base_50")
    assert task.involved_classes == ["VehicleControlAPI"]
    env = environment_class(tool_group(task))()
    env.reset(bfcl_id=task.id)
    with pytest.raises(NameError, match="name 'nan' is not defined"):
        env.fillFuelTank(fuelAmount=float("nan"))
    env.fillFuelTank(fuelAmount=2.5)
    results, instances = multi_turn_utils.execute_multi_turn_func_call(
        env._turn_calls[0], task.initial_config, task.involved_classes, "test_env_replay", task.id, is_evaL_run=True
    )
    for key in [k for k in vars(multi_turn_utils) if k.startswith("test_env_replay_")]:
        del vars(multi_turn_utils)[key]
    assert results[0] == "Error during execution: name 'nan' is not defined"
    fuel = env._apis["VehicleControlAPI"].fuelLevel
    assert fuel == instances["VehicleControlAPI"].fuelLevel and fuel == fuel  # not nan


def test_a_fresh_instance_restored_from_a_checkpoint_continues_the_episode():
    """What the loop does after a timed-out call: a new instance of the class, restored, its tools re-bound by name
    (including a held-out function a user turn added)."""
    task = get_task("multi_turn_miss_func_0")
    old = environment_class(tool_group(task))()
    old.reset(bfcl_id=task.id)
    for _ in range(3):  # to turn 3, where `sort` is added
        user = next_user_turn(old, {"role": "assistant", "content": "ok"})
    assert [t.__name__ for t in user.add_tools] == ["sort"] and old.sort.__self__ is old
    new = type(old)()
    restore_env(new, checkpoint_env(old))
    rebound = new.sort  # what the loop's getattr(new, name) gets
    assert rebound.__self__ is new
    new.cd(folder="document")
    assert "sorted_content" in rebound(file_name="final_report.pdf")
    assert new._turn_calls[-1] == ["cd(folder='document')", "sort(file_name='final_report.pdf')"]
    assert old._turn_calls[-1] == []  # the retired instance is untouched
    with pytest.raises(AttributeError):
        _ = new.cp  # a hidden function no user turn added is not an attribute


def _first_task_calling(name: str, categories=("base", "long_context")) -> str:
    return next(
        t.id
        for c in categories
        for t in load_tasks(c)
        if any(call.startswith(name + "(") for calls in t.ground_truth for call in calls)
    )


@pytest.mark.parametrize(
    "function",
    ["list_all_airports", "get_watchlist", "ls", "cd", "sort", "post_tweet", "get_ticket", "get_stock_info"],
)
def test_tool_results_are_the_text_bfcls_executor_shows(function):
    """Every ground-truth call's tool message is what BFCL's executor feeds back for it. A list came back as it was:
    TRL passes a list on as content blocks, and the chat template rendered an empty `<tool_response>`."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    from trl_agentic.envs.bfcl.data import long_context_module_state_kept

    task = get_task(_first_task_calling(function))
    episode = play_ground_truth(task)
    ours = [m["content"] for m in episode.messages if m["role"] == "tool"]
    calls = [call for turn in task.ground_truth for call in turn]
    try:
        with long_context_module_state_kept():
            official, _ = multi_turn_utils.execute_multi_turn_func_call(
                calls, task.initial_config, task.involved_classes, "test_results", task.id,
                long_context=task.long_context, is_evaL_run=True,
            )  # fmt: skip
    finally:
        for key in [k for k in vars(multi_turn_utils) if k.startswith("test_results_")]:
            del vars(multi_turn_utils)[key]
    assert len(ours) == len(official) == len(calls)
    shown = [c for c, call in zip(ours, calls) if call.startswith(function + "(")]
    assert shown and all(isinstance(c, str) and c.strip() for c in shown)
    for content, expected, call in zip(ours, official, calls):
        if content.startswith("{'error'"):  # a failure: TRL's rendering of the same error (docs/bfcl.md)
            assert ast.literal_eval(content) == json.loads(expected), call
        else:
            assert content == expected, call


def test_a_long_context_episode_is_not_built_from_a_state_a_verdict_is_changing():
    """A verdict replays bookings against `long_context`'s module dicts (restored after it, under a lock); an episode
    built meanwhile in another thread (the asynchronous worker's rollouts) read the changed balance."""
    import threading

    from bfcl_eval.eval_checker.multi_turn_eval.func_source_code import long_context

    from trl_agentic.envs.bfcl.data import long_context_module_state_kept

    task = get_task("multi_turn_long_context_153")
    card = "4567890145678901"
    official = long_context.CREDIT_CARD_EXTENSION[card]["balance"]
    changed, release = threading.Event(), threading.Event()

    def verdict():
        with long_context_module_state_kept():
            long_context.CREDIT_CARD_EXTENSION[card]["balance"] = -1.0  # what a replayed booking does, for a while
            changed.set()
            release.wait(60)

    replay = threading.Thread(target=verdict)
    replay.start()
    assert changed.wait(60)
    built = {}
    builder = threading.Thread(target=lambda: built.update(apis=build_api_instances(task)))
    builder.start()
    builder.join(1.0)  # room for an unguarded build to read the changed state (the guarded one waits for the lock)
    release.set()
    replay.join()
    builder.join()
    assert built["apis"]["TravelAPI"].credit_card_list[card]["balance"] == official
    assert long_context.CREDIT_CARD_EXTENSION[card]["balance"] == official
