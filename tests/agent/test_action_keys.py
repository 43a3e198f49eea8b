"""Action keys are derived from the run and the step, the same in every process."""

from __future__ import annotations

import pytest

from oncegate.agent.keys import action_key, task_key, tool_call_key
from oncegate.kernel import keys as gateway_keys


def test_the_key_names_the_run_the_step_and_the_action() -> None:
    assert action_key("run-81", 10, "charge") == "run-81:step-10:charge"


def test_the_key_is_the_same_every_time_it_is_derived() -> None:
    assert {action_key("run-81", 4, "email") for _ in range(3)} == {"run-81:step-4:email"}


def test_every_step_and_action_gets_its_own_key() -> None:
    derived = {action_key("run-81", step, action) for step in (4, 7, 10) for action in ("a", "b")}
    assert len(derived) == 6


def test_the_gateway_accepts_the_key_bare_as_it_is_sent() -> None:
    key = action_key("lab-1a2b3c-C-run-999", 12, "close_case")
    assert gateway_keys.parse([key]) == key


@pytest.mark.parametrize("run_id", ["", "run 81", "run,81", 'run"81', "run:81", "rün"])
def test_run_ids_that_would_make_an_ambiguous_or_invalid_header_are_refused(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        action_key(run_id, 1, "email")


def test_steps_count_from_one_and_actions_are_plain_words() -> None:
    with pytest.raises(ValueError, match="steps count from 1"):
        action_key("run-1", 0, "email")
    with pytest.raises(ValueError, match="action"):
        action_key("run-1", 1, "Send Email")


def test_a_key_longer_than_the_gateway_accepts_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 255"):
        action_key("r" * 250, 1, "email")


def test_a_langgraph_tool_calls_key_has_the_call_between_the_task_and_the_action() -> None:
    key = task_key("case-81", "tools:abc", "email", tool_call_id="call_1")
    assert key == "case-81:tools:abc:call_1:email"
    assert key != task_key("case-81", "tools:abc", "email", tool_call_id="call_2")
    assert task_key("case-81", "tools:abc", "email") == "case-81:tools:abc:email"


def test_a_tool_calls_key_names_the_run_the_call_and_the_action() -> None:
    assert tool_call_key("run-81", "call_Ab12", "email") == "run-81:call_Ab12:email"
    # Ids are the model's: whatever they hold is written so the key stays a bare header value.
    assert tool_call_key("run-81", "toolu 01:x", "email") == "run-81:toolu%2001%3Ax:email"
    assert gateway_keys.parse([tool_call_key("run-81", "call_Ab12", "email")])
    assert tool_call_key("run-81", "call_1", "email") != tool_call_key("run-82", "call_1", "email")
    with pytest.raises(ValueError, match="tool call's id"):
        tool_call_key("run-81", "", "email")
    with pytest.raises(ValueError, match="run id"):
        tool_call_key("run 81", "call_1", "email")


@pytest.mark.parametrize("step", [1, 2, 10, 123])
def test_a_tool_call_whose_id_looks_like_a_step_never_gets_that_steps_key(step: int) -> None:
    """A scripted model (or one that echoes ids) may name a call `step-2`: its action is not
    step 2's, so the two keys differ, and the key is still one the gateway takes bare."""
    key = tool_call_key("run-81", f"step-{step}", "email")
    assert key != action_key("run-81", step, "email")
    assert key == f"run-81:%73tep-{step}:email"
    assert gateway_keys.parse([key]) == key
    # No other id is written the same way: `%` itself is always encoded.
    assert tool_call_key("run-81", f"%73tep-{step}", "email") != key
    # Ids a step's number could not produce keep the key they always had.
    for other in ("step-0", "step-02", "step-2a", "Step-2", "call_step-2"):
        assert tool_call_key("run-81", other, "email") == f"run-81:{other}:email"
