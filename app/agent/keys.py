"""Stable action keys: `run-81:step-10:charge` for the agent runner (a step's number as the
key's source), `run-81:call_Ab12:email` for a tool call of a plain Python agent (the tool call's
id as the source, `tool_call_key`), and a LangGraph task's (`task_key`). Pure.

A key is derived from the run's persisted identity and the step, never from a random value made
when the action is (re)tried: the process that resumes a run after a crash must send the same key
the dead one sent, or the gateway cannot know the two requests are one.
"""

from __future__ import annotations

import hashlib
import re

# What the gateway accepts (contract section 4) is 1 to 255 printable ASCII characters; a key
# here also stays clear of the characters that need quoting in the header (`"`, `\`, `,`) and of
# white space, so it can be sent bare, copied from a log and pasted into the admin API.
MAX_KEY_LENGTH = 255
_PART = re.compile(r"[A-Za-z0-9._~!$&'()*+;=@/-]+")
_ACTION = re.compile(r"[a-z][a-z0-9_-]*")
# The source part `action_key` writes (`step-` and a step's number as `str(int)` writes it):
# a tool call's id of this form is written otherwise (`tool_call_key`).
_STEP_SOURCE = re.compile(r"step-[1-9][0-9]*")


def action_key(run_id: str, step: int, action: str) -> str:
    """The key of `action` at `step` of run `run_id`: `f"{run_id}:step-{step}:{action}"`."""
    if step < 1:
        raise ValueError(f"steps count from 1, not {step}")
    return _run_key(run_id, f"step-{step}", action)


def _run_key(run_id: str, source: str, action: str) -> str:
    """`f"{run_id}:{source}:{action}"`, each part checked."""
    if not _PART.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r}: use letters, digits and -._~!$&'()*+;=@/ only (no ':', "
            "space, comma or quote)"
        )
    if not _ACTION.fullmatch(action):
        raise ValueError(f"action {action!r}: lower-case letters, digits, '-' and '_' only")
    key = f"{run_id}:{source}:{action}"
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"the key {key[:40]}... is {len(key)} characters; at most 255 fit")
    return key


def tool_call_key(run_id: str, tool_call_id: str, action: str) -> str:
    """The key of `action` taken for the tool call `tool_call_id` of run `run_id`:
    `f"{run_id}:{tool_call_id}:{action}"`, the id percent-encoded as a task key's parts are.

    A model's tool call ids are the model's (`call_Ab12...`, `toolu_01...`): the run id keeps
    two runs' calls apart should a model (or a scripted one) use an id twice. The id must come
    from the model's message as the run saved it, so that a resumed run reads the same one.

    An id a step's number could have made (`step-2`) would give the key of that step's action
    (`action_key(run_id, 2, ...)`), another action: its `s` is written `%73` (`%73tep-2`),
    which no other id is written as (`%` itself is always encoded). Every other id is written
    as it always was, so only such ids changed key when this rule came."""
    if not tool_call_id:
        raise ValueError("a tool call key needs the tool call's id, not ''")
    source = _escape(tool_call_id)
    if _STEP_SOURCE.fullmatch(source):
        source = "%73" + source[1:]
    return _run_key(run_id, source, action)


# A LangGraph task's key (`oncegate.agent.langgraph`): `case-81:send-email:1f0c...-...:email`.
# The thread id and the node names are the user's and may hold any character: each is written
# with anything outside `_TASK_SAFE` percent-encoded (`%` itself included), so the key stays a
# bare header value and the thread never holds a `:` (which ends it) nor a `|` (which separates
# a subgraph's levels in the namespace). A key longer than the gateway takes is written as a
# digest of the same parts instead: as stable, and as distinct.
_TASK_SAFE = frozenset(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+;=@/"
)


def _escape(text: str) -> str:
    return "".join(
        character
        if character in _TASK_SAFE
        else "".join(f"%{byte:02X}" for byte in character.encode())
        for character in text
    )


def task_key(
    thread_id: str, checkpoint_ns: str, action: str, *, tool_call_id: str | None = None
) -> str:
    """The key of `action` taken by the LangGraph task whose namespace is `checkpoint_ns`
    (`node:<task id>`, or `outer:<task id>|inner:<task id>` inside a subgraph) in thread
    `thread_id`: `f"{thread_id}:{checkpoint_ns}:{action}"`, escaped as above, or
    `f"sha256-{digest}:{action}"` when that would be longer than 255 characters.

    With `tool_call_id` (one of the tool calls the task runs), the call's id is written before
    the action: `f"{thread_id}:{checkpoint_ns}:{tool_call_id}:{action}"`. Escaped, no part holds
    a `:`, and a namespace always holds an odd number of them: a key with a tool call has one
    `:` more than any key without, so the two kinds never meet."""
    if not thread_id:
        raise ValueError("a task key needs the thread id of a checkpointed run, not ''")
    if not checkpoint_ns:
        raise ValueError("a task key needs the task's checkpoint namespace, not ''")
    if not _ACTION.fullmatch(action):
        raise ValueError(f"action {action!r}: lower-case letters, digits, '-' and '_' only")
    levels = []
    for level in checkpoint_ns.split("|"):
        node, separator, task_id = level.rpartition(":")
        if not separator or not node or not task_id:
            raise ValueError(
                f"{checkpoint_ns!r} is not a task's namespace (node:<task id>, levels joined "
                "by '|'): call it from inside a node"
            )
        levels.append(f"{_escape(node)}:{_escape(task_id)}")
    if tool_call_id is not None and not tool_call_id:
        raise ValueError("a tool call's key needs the tool call's id, not ''")
    call = "" if tool_call_id is None else f"{_escape(tool_call_id)}:"
    key = f"{_escape(thread_id)}:{'|'.join(levels)}:{call}{action}"
    if len(key) <= MAX_KEY_LENGTH:
        return key
    source = f"{thread_id}\0{checkpoint_ns}"
    if tool_call_id is not None:
        source += f"\0{tool_call_id}"
    digest = hashlib.sha256(source.encode()).hexdigest()
    return f"sha256-{digest}:{action}"
