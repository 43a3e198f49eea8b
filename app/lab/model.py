"""The lab's model: the strategies, the crashes drawn for a run, what a run did and what it
wasted, and the figures expected of them (contract section 8).

A run's crash point is drawn from the seed: a step, uniformly among the 12, and for the three
action steps, whether the crash falls in the gap between the action and the checkpoint
(`GAP_SHARE`) or before the action was sent. Wasted tokens and seconds are priced from the task's
invented costs (`task.COSTS`): every finished step redone in full, plus the part of the step the
crash interrupted (`Crash.progress` of it; none for a crash in the gap, whose step had finished).
"""

from __future__ import annotations

import collections
import math
import random
from dataclasses import dataclass, field

from ..agent.checkpoints import JSON
from ..agent.runner import Order
from .task import ACTION_STEPS, COSTS, STEPS

# Contract section 8: 15% of the crashes that fall on a side-effect step fall between the action
# and the checkpoint.
GAP_SHARE = 0.15


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    title: str
    checkpoints: bool
    through_gateway: bool  # with a stable key per action
    order: Order = "act-then-save"
    late: bool = False  # resumed after the gateway forgot its keys (the `/late` route)
    age_check: bool = True  # the client knows the key lifetime, and stops a too-late resend


STRATEGIES = {
    "A": Strategy("A", "restart from step 1", checkpoints=False, through_gateway=False),
    "B": Strategy("B", "checkpoint after each step", checkpoints=True, through_gateway=False),
    "C": Strategy("C", "checkpoint + stable keys via oncegate", True, through_gateway=True),
    "D": Strategy("D", "save first, then act", True, False, order="save-then-act"),
    "E": Strategy("E", "C resumed after its keys expired", True, True, late=True, age_check=False),
    "F": Strategy("F", "E with the key-age check", True, True, late=True),
}
LATE_STRATEGIES = "EF"


@dataclass(frozen=True, slots=True)
class Crash:
    step: int
    gap: bool  # between the action and its checkpoint (D: between the checkpoint and the action)
    # How far into its step's work the crash came (0 to 1): the share of the step's cost lost.
    # The real steps take microseconds, so this is drawn, not measured.
    progress: float = 0.0

    def point(self, strategy: Strategy) -> tuple[str, int]:
        """Where the worker is killed, as a runner event (`oncegate.agent.runner.EventHook`)."""
        if self.gap:
            return ("done" if strategy.order == "act-then-save" else "saved", self.step)
        if self.step in ACTION_STEPS:
            return ("prepared", self.step)  # parameters computed, nothing sent
        return ("started", self.step)


def draw_crashes(runs: int, seed: int) -> list[Crash]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible experiment, not a secret
    # A stream of its own, so a seed draws the same steps and gaps as before progress existed.
    progress = random.Random(f"progress-{seed}")  # noqa: S311 - reproducible, not a secret
    crashes = []
    for _ in range(runs):
        step = rng.randint(1, STEPS)
        gap = step in ACTION_STEPS and rng.random() < GAP_SHARE
        crashes.append(Crash(step, gap, progress.random()))
    return crashes


def expectation(strategy: Strategy) -> tuple[float, float]:
    """The model's expected wasted tokens and seconds per run, from `task.COSTS`.

    A crash falls on each of the 12 steps alike and interrupts it half-way on average; on an
    action step, GAP_SHARE of the crashes fall after the action instead, its step finished.
    Restarting (A) redoes every step before the crashed one; a checkpoint redoes none. A
    finished step caught in the gap is redone in full when the action comes before its
    checkpoint (A, B, C, E), and not at all when the checkpoint comes first (D) or when the
    run stops for reconciliation and the step is marked done from the upstream's records (F)."""
    redoes_gap = strategy.order == "act-then-save" and not (strategy.late and strategy.age_check)
    tokens = seconds = 0.0
    for step in range(1, STEPS + 1):
        gap = GAP_SHARE if step in ACTION_STEPS else 0.0
        share = (1 - gap) / 2 + (gap if redoes_gap else 0.0)
        before = [] if strategy.checkpoints else [COSTS[earlier] for earlier in range(1, step)]
        tokens += share * COSTS[step].tokens + sum(cost.tokens for cost in before)
        seconds += share * COSTS[step].seconds + sum(cost.seconds for cost in before)
    return tokens / STEPS, seconds / STEPS


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What the lab, as an operator, decided for a run stopped by `StaleAction`."""

    step: int
    receipt: JSON  # the upstream's record of the action: the step is marked done with it
    performed: bool  # False: nothing was performed, the resend is allowed (receipt unused)


@dataclass(frozen=True, slots=True)
class GatewayKill:
    step: int  # killed when the agent is about to send this step's action
    delay: float


@dataclass
class Run:
    strategy: Strategy
    number: int
    run_id: str
    crash: Crash
    gateway_kill: GatewayKill | None = None
    processes: int = 0
    done: collections.Counter[int] = field(default_factory=collections.Counter)
    gateway_killed: bool = False
    unknown_keys: list[str] = field(default_factory=list)
    resolutions: list[str] = field(default_factory=list)
    stale_keys: list[str] = field(default_factory=list)  # each stop for reconciliation
    reconciliations: list[Reconciliation] = field(default_factory=list)
    saves: int = 0  # checkpoint saves, in every process of the run
    failure: str | None = None
    finished: bool = False

    @property
    def redone(self) -> int:
        return sum(count - 1 for count in self.done.values() if count > 1)

    def wasted(self) -> tuple[float, float]:
        """Tokens and seconds spent again: each finished step redone, in full, and the part of
        the step the crash interrupted (none after a crash in the gap: its step had finished)."""
        tokens = seconds = 0.0
        for step, count in self.done.items():
            tokens += (count - 1) * COSTS[step].tokens
            seconds += (count - 1) * COSTS[step].seconds
        if not self.crash.gap:
            tokens += self.crash.progress * COSTS[self.crash.step].tokens
            seconds += self.crash.progress * COSTS[self.crash.step].seconds
        return tokens, seconds


# B performs an action twice when the crash falls on an action step (3 of 12) and in its gap.
B_DUPLICATE_SHARE = GAP_SHARE * len(ACTION_STEPS) / STEPS


def runs_to_show_the_gap(miss: float = 0.01) -> int:
    """Runs after which B shows at least one duplicate but for `miss` of the seeds."""
    return math.ceil(math.log(miss) / math.log(1 - B_DUPLICATE_SHARE))


def runs_for_a_figure(within: float = 1 / 3) -> int:
    """Runs after which B's duplicate share is within `within` of itself (relative), 19 seeds
    out of 20 (a binomial share's normal interval)."""
    share = B_DUPLICATE_SHARE
    return math.ceil((1.96 / within) ** 2 * (1 - share) / share)


def too_few_runs(runs: int) -> str | None:
    """What a table of `runs` runs cannot show, or None when they are enough for a figure."""
    if runs >= runs_for_a_figure():
        return None
    share = B_DUPLICATE_SHARE
    return (
        f"too few runs to measure B's gap: B performs an action twice in about {share:.2%} of "
        f"runs, so {runs} runs expect {share * runs:.1f} such runs and show none "
        f"{(1 - share) ** runs:.0%} of the time (B then reads like C); --runs "
        f"{runs_to_show_the_gap()} shows the gap for 99 seeds in 100, --runs "
        f"{runs_for_a_figure()} puts B's figure within a third of itself (docs/lab.md)"
    )
