"""Send an action through the gateway with its key, and retry only what is safe to retry.

Rules:
- Every keyed request says `Prefer: wait=N` (`RetryPolicy.wait`, 10 s; 0 turns it off): a retry
  that finds the first attempt still in flight waits at the gateway for its answer, instead of
  a 409 and a poll.
- 2xx: done. A replay (`Idempotent-Replayed: true`) is as good as the first answer.
- 409 `request-in-progress`: the first attempt is still running; wait `Retry-After`, ask again.
- Connection errors: with a key, retry with backoff. Nothing was sent (connect refused or timed
  out), or the gateway already holds the key and will replay, hold or refuse the retry. Without a
  key, only a failed connect is retried: anything later may have been performed.
- 429, 502 and 503 (`upstream-unavailable`, `store-unavailable`, an upstream's 429 or 503 that
  released the key): retry after its `Retry-After` (at most `RetryPolicy.max_retry_after`), or
  with backoff. The gateway released the key or never claimed it. But not one that says a retry
  cannot change it: a replayed answer (an upstream's 502 the gateway stored) or
  `x-should-retry: false` (503 `answer-sealed`): `ActionRejected`.
- 409 `response-not-stored`: performed, its answer too large to keep (`ActionPerformedNotStored`,
  an `ActionRejected`): record it as done, never start it again.
- Never retried: 422 `key-reused` (`ActionKeyReused`), `outcome-unknown` in any status (the
  504/502 to the first caller, the 409 to a retry: `ActionOutcomeUnknown`), any other answer
  (`ActionRejected`).
  Retrying those cannot help, and `outcome-unknown` needs someone to find out what happened.

Backoff is exponential with full jitter, bounded by `RetryPolicy.deadline` overall.

A key lives at the gateway only so long (its route's `ttl`, 24 h by default), and a resend after
that is performed as new. The client carries that lifetime (`KeyLifetime`) so the runner can
refuse to resend an action saved too long ago (`runner.StaleAction`).
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx

from ..kernel import keys, urls
from ..model import errors
from .checkpoints import JSON


class ActionError(Exception):
    """An action that did not succeed and will not be retried."""

    def __init__(
        self, message: str, *, key: str | None = None, response: httpx.Response | None = None
    ) -> None:
        super().__init__(message)
        self.key = key
        self.response = response


class ActionKeyReused(ActionError):
    """422: this key was used for a different request. A bug: the parameters changed between
    attempts, or two actions share a key."""


class ActionOutcomeUnknown(ActionError):
    """The action may or may not have been performed, and nobody can tell yet. Do not resend:
    an operator finds out (the upstream's records) and resolves the key on the admin API."""


class ActionRejected(ActionError):
    """Any other final answer: a 4xx of the upstream, a 500, a 409 the client does not know."""


class ActionPerformedNotStored(ActionRejected):
    """409 `response-not-stored`: the action WAS performed, but its answer was too large for the
    gateway to keep, so no retry can get it. Do not start the work again: record the action as
    done (`runner.mark_done`), from the upstream's records if its answer matters."""


class GaveUp(ActionError):
    """Retryable failures until the deadline ran out."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    # Base and cap of the exponential backoff: the first retry after ~0.1 s, never more than 2 s
    # apart, so a gateway restart (about a second) costs a couple of attempts.
    backoff_base: float = 0.1
    backoff_cap: float = 2.0
    # The longest a `Retry-After` is honoured; a larger one is treated as this.
    max_retry_after: float = 10.0
    # Seconds a keyed request asks the gateway to wait for a first attempt in flight
    # (`Prefer: wait`); the gateway caps it by the route's max_wait. 0: do not ask.
    wait: int = 10
    # Overall bound on one action, retries and waits included.
    deadline: float = 60.0


def is_final(response: httpx.Response) -> bool:
    """Whether an answer says no retry can change it: a stored answer replayed (`Idempotent-
    Replayed: true`), or `x-should-retry: false` (on every gateway problem that a retry cannot
    help, such as 503 `answer-sealed`)."""
    replayed: bool = response.headers.get("idempotent-replayed", "").lower() == "true"
    hopeless: bool = response.headers.get("x-should-retry", "").lower() == "false"
    return replayed or hopeless


def problem_name(response: httpx.Response) -> str | None:
    """The gateway's problem name (`key-reused`), or None if the answer is not a problem."""
    if not response.headers.get("content-type", "").startswith(errors.PROBLEM_MEDIA_TYPE):
        return None
    try:
        document = response.json()
    except ValueError:
        return None
    kind = document.get("type") if isinstance(document, dict) else None
    if isinstance(kind, str) and kind.startswith(errors.PROBLEM_TYPE_PREFIX):
        return kind.removeprefix(errors.PROBLEM_TYPE_PREFIX)
    return None


def retry_after(response: httpx.Response) -> float | None:
    """`Retry-After` in seconds (delta-seconds or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclass(frozen=True, slots=True)
class KeyLifetime:
    """How long the gateway keeps a key, as this client's gateway route is configured.

    An action saved more than `ttl - margin` ago is not resent (`runner.StaleAction`). The margin
    covers what the age measured here cannot see: the resend's own retries (up to
    `RetryPolicy.deadline`) and the clocks of other hosts that may have saved the action."""

    # The gateway's default `ttl`; set it to the route's when that differs.
    ttl: timedelta = timedelta(hours=24)
    # An hour of a day: far more than a minute of retries and any sane clock skew, and a resume
    # 23 hours late is rare enough that asking an operator then costs little.
    margin: timedelta = timedelta(hours=1)

    def __post_init__(self) -> None:
        if self.ttl <= timedelta(0):
            raise ValueError(f"a key lifetime must be positive, not {self.ttl}")
        if not timedelta(0) <= self.margin < self.ttl:
            raise ValueError(
                f"the margin ({self.margin}) must be at least 0 and less than the ttl ({self.ttl})"
            )

    @property
    def resend_until(self) -> timedelta:
        """The largest age at which an action is still resent with its key."""
        return self.ttl - self.margin


class Attempts:
    """The decisions of one action's attempts, kept apart from the I/O so the async and the sync
    client share them: after each attempt (`after`), the final answer, a wait before the next
    attempt, or the error that ends the action (raised)."""

    def __init__(
        self,
        policy: RetryPolicy,
        rng: random.Random,
        url: str,
        path: str,
        key: str | None,
        method: str = "POST",
    ) -> None:
        self._policy = policy
        self._random = rng
        self._url = url
        self._path = path
        self._method = method
        self._key = key
        self._deadline = time.monotonic() + policy.deadline
        self._attempt = 0

    def after(self, outcome: httpx.Response | httpx.TransportError) -> httpx.Response | float:
        """What follows an attempt that answered `outcome` (or broke with it): the answer, or
        the seconds to wait before the next attempt. Raises `ActionError` when it is final."""
        self._attempt += 1
        key, url, path = self._key, self._url, self._path
        if isinstance(outcome, httpx.ConnectError | httpx.ConnectTimeout):
            # Nothing was sent: always safe to try again.
            reason = f"cannot connect to {urls.shown(url)}: {outcome!r}"
            wait = self._backoff()
        elif isinstance(outcome, httpx.TransportError):
            if key is None:
                raise ActionOutcomeUnknown(
                    f"the connection broke after the request was sent and it has no "
                    f"Idempotency-Key: it may or may not have been performed ({outcome!r})"
                ) from outcome
            reason = f"connection to {urls.shown(url)} broke: {outcome!r}"
            wait = self._backoff()
        else:
            response = outcome
            if response.is_success:
                return response
            name = problem_name(response)
            status = response.status_code
            if name == errors.OutcomeUnknown.name:
                raise ActionOutcomeUnknown(
                    f"{key}: the gateway cannot tell whether the upstream performed this "
                    f"action ({status}); find out and resolve the key, do not resend",
                    key=key,
                    response=response,
                )
            if status == errors.KeyReused.status and name == errors.KeyReused.name:
                raise ActionKeyReused(
                    f"{key} was already used for a different request: the parameters "
                    "changed between attempts, or two actions share a key",
                    key=key,
                    response=response,
                )
            if status == errors.RequestInProgress.status and name == errors.RequestInProgress.name:
                reason = f"{key} is still in progress"
                hinted = retry_after(response)
                wait = (
                    self._backoff() if hinted is None else min(hinted, self._policy.max_retry_after)
                )
            elif status in (429, 502, 503) and not is_final(response):
                # The key was released or never claimed (an upstream's 429 or 503 under the
                # route's `release_statuses`, 502 `upstream-unavailable`, 503
                # `store-unavailable`): its `Retry-After`, if any, says when to come back.
                reason = f"{status} {name or 'from the upstream'}"
                hinted = retry_after(response)
                wait = (
                    self._backoff() if hinted is None else min(hinted, self._policy.max_retry_after)
                )
            elif name == errors.ResponseNotStored.name:
                raise ActionPerformedNotStored(
                    f"{key}: the upstream performed this action, but its answer was too large "
                    f"for the gateway to keep ({status} {name}): record it as done, do not "
                    "start it again",
                    key=key,
                    response=response,
                )
            else:
                raise ActionRejected(
                    f"{self._method} {path} answered {status} {name or ''}".rstrip(),
                    key=key,
                    response=response,
                )
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise GaveUp(
                f"gave up on {self._method} {path} after {self._attempt} attempts "
                f"({self._policy.deadline:g} s): {reason}",
                key=key,
            )
        # A wait past the deadline is cut short: one last attempt at the deadline, not an
        # early surrender.
        return min(wait, remaining)

    def _backoff(self) -> float:
        ceiling = min(
            self._policy.backoff_cap, self._policy.backoff_base * 2 ** (self._attempt - 1)
        )
        return self._random.uniform(0, ceiling)


def request_content(json: JSON | None, form: Mapping[str, str] | None) -> dict[str, Any]:
    """httpx's arguments for a body: JSON (`json`), or an HTML form's fields (`form`, sent as
    `application/x-www-form-urlencoded`), or none."""
    if json is not None and form is not None:
        raise ValueError("an action's body is JSON or a form, not both")
    if form is not None:
        return {"data": dict(form)}
    if json is not None:
        return {"json": json}
    return {}


def request_headers(
    policy: RetryPolicy, key: str | None, headers: dict[str, str] | None
) -> dict[str, str]:
    """The headers of a keyed action: the caller's, the key, and `Prefer: wait=N` (see the rules
    above)."""
    merged = dict(headers or {})
    if key is not None:
        # Header names in any case are one header: a caller's `idempotency-key` would go out
        # beside the key (two key lines: 400), a caller's `prefer` beside the client's.
        for name in [name for name in merged if name.lower() == keys.HEADER.lower()]:
            del merged[name]
        merged[keys.HEADER] = key
        if policy.wait and not any(name.lower() == "prefer" for name in merged):
            merged["Prefer"] = f"wait={policy.wait}"
    return merged


class ActionClient:
    """POSTs actions to `base_url` (the gateway) on a caller's `httpx.AsyncClient`.

    `key_lifetime` is the gateway's `ttl` for the route (24 h unless told); `None` turns the
    runner's age check off, which a late resume pays for with a duplicate."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        *,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
        key_lifetime: KeyLifetime | None = KeyLifetime(),
    ) -> None:
        self._http = http
        self.key_lifetime = key_lifetime
        self._base_url = base_url.rstrip("/")
        self._policy = policy or RetryPolicy()
        self._random = rng or random.Random()  # noqa: S311 - jitter, not a secret

    async def send(
        self,
        path: str,
        body: JSON,
        key: str | None,
        *,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with `key`; the final 2xx answer, or raise."""
        return await self.request("POST", path, key, json=body, headers=headers)

    async def request(
        self,
        method: str,
        path: str,
        key: str | None,
        *,
        json: JSON | None = None,
        form: Mapping[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send `method` to `path` with `key`, the body JSON (`json`) or a form's fields
        (`form`); the final 2xx answer, or raise."""
        url = self._base_url + path
        content = request_content(json, form)
        sent_headers = request_headers(self._policy, key, headers)
        attempts = Attempts(self._policy, self._random, url, path, key, method)
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = await self._http.request(method, url, headers=sent_headers, **content)
            except httpx.TransportError as exc:
                outcome = exc
            decision = attempts.after(outcome)
            if isinstance(decision, httpx.Response):
                return decision
            await asyncio.sleep(decision)


class SyncActionClient:
    """`ActionClient` on a caller's `httpx.Client`, for code that does not run an event loop
    (a LangGraph graph run with `invoke`): the same headers, retries and errors."""

    def __init__(
        self,
        http: httpx.Client,
        base_url: str,
        *,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._http = http
        self._base_url = base_url.rstrip("/")
        self._policy = policy or RetryPolicy()
        self._random = rng or random.Random()  # noqa: S311 - jitter, not a secret

    def send(
        self,
        path: str,
        body: JSON,
        key: str | None,
        *,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with `key`; the final 2xx answer, or raise."""
        return self.request("POST", path, key, json=body, headers=headers)

    def request(
        self,
        method: str,
        path: str,
        key: str | None,
        *,
        json: JSON | None = None,
        form: Mapping[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send `method` to `path` with `key`, the body JSON (`json`) or a form's fields
        (`form`); the final 2xx answer, or raise."""
        url = self._base_url + path
        content = request_content(json, form)
        sent_headers = request_headers(self._policy, key, headers)
        attempts = Attempts(self._policy, self._random, url, path, key, method)
        while True:
            outcome: httpx.Response | httpx.TransportError
            try:
                outcome = self._http.request(method, url, headers=sent_headers, **content)
            except httpx.TransportError as exc:
                outcome = exc
            decision = attempts.after(outcome)
            if isinstance(decision, httpx.Response):
                return decision
            time.sleep(decision)
