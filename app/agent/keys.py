"""Stable action keys: `run-81:step-10:charge`. Pure.

A key is derived from the run's persisted identity and the step, never from a random value made
when the action is (re)tried: the process that resumes a run after a crash must send the same key
the dead one sent, or the gateway cannot know the two requests are one.
"""

from __future__ import annotations

import re

# What the gateway accepts (contract section 4) is 1 to 255 printable ASCII characters; a key
# here also stays clear of the characters that need quoting in the header (`"`, `\`, `,`) and of
# white space, so it can be sent bare, copied from a log and pasted into the admin API.
MAX_KEY_LENGTH = 255
_PART = re.compile(r"[A-Za-z0-9._~!$&'()*+;=@/-]+")
_ACTION = re.compile(r"[a-z][a-z0-9_-]*")


def action_key(run_id: str, step: int, action: str) -> str:
    """The key of `action` at `step` of run `run_id`: `f"{run_id}:step-{step}:{action}"`."""
    if not _PART.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r}: use letters, digits and -._~!$&'()*+;=@/ only (no ':', "
            "space, comma or quote)"
        )
    if step < 1:
        raise ValueError(f"steps count from 1, not {step}")
    if not _ACTION.fullmatch(action):
        raise ValueError(f"action {action!r}: lower-case letters, digits, '-' and '_' only")
    key = f"{run_id}:step-{step}:{action}"
    if len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"the key {key[:40]}... is {len(key)} characters; at most 255 fit")
    return key
