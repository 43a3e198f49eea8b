"""The lab's report: the figures of each strategy, the JSON document (`--json`), the table and
the progress bar on stderr."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from .model import LATE_STRATEGIES, STRATEGIES, expectation, too_few_runs
from .task import CHECKPOINT_SAVE_SECONDS
from .worker import RUNNER, Runtime


@dataclass(frozen=True, slots=True)
class Figures:
    redone_avg: float
    duplicate_runs_pct: float
    lost_runs_pct: float
    wasted_tokens_avg: float
    wasted_seconds_avg: float
    checkpoint_seconds_avg: float


@dataclass
class Outcome:
    runs: int
    seed: int
    strategies: dict[str, Figures]
    seconds: float
    failures: list[str]
    gateway: dict[str, int] | None  # with --kill-gateway
    late: dict[str, Any] | None = None  # with --late-resume
    runtime: Runtime | None = None  # what played the runs; None: the runner

    def document(self) -> dict[str, Any]:
        """Contract section 8's JSON (plus `gateway_kills` with --kill-gateway, `late_resume`
        with --late-resume)."""
        document: dict[str, Any] = {
            "runs": self.runs,
            "seed": self.seed,
            "strategies": {
                name: dataclasses.asdict(figures) for name, figures in self.strategies.items()
            },
        }
        if self.gateway is not None:
            document["gateway_kills"] = self.gateway
        if self.late is not None:
            document["late_resume"] = self.late
        return document


class ProgressBar:
    """`[#####.....] 1200/4000 runs  31 s` on stderr, redrawn at most ten times a second (on a
    terminal) or at every tenth of the way (in a log)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.started = time.monotonic()
        self._drawn = 0.0
        self._tenth = -1
        self.tty = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        tenth = 10 * done // total
        if self.tty:
            if now - self._drawn < 0.1 and done < total:
                return
        elif tenth == self._tenth:
            return
        self._drawn, self._tenth = now, tenth
        filled = self.width * done // total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{total} runs  {now - self.started:.0f} s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == total:
            self.stream.write("\n")
        self.stream.flush()


def table(outcome: Outcome) -> str:
    runtime = outcome.runtime or RUNNER
    on = "" if runtime is RUNNER else f" on {runtime.name}"
    width = max([42, *(len(f"{name}  {runtime.titles[name]}") for name in outcome.strategies)])
    rows = [
        f"crash-recovery lab{on}: {outcome.runs} runs per strategy, seed {outcome.seed}, "
        f"{outcome.seconds:.0f} s",
        "",
        f"{'strategy':<{width}} {'steps redone':>13} {'action twice':>13} {'action lost':>12} "
        f"{'wasted tokens':>14} {'wasted s':>9} {'checkpoint s':>13}",
    ]
    for name, figures in outcome.strategies.items():
        title = f"{name}  {runtime.titles[name]}"
        rows.append(
            f"{title:<{width}} {figures.redone_avg:>13.2f} {figures.duplicate_runs_pct:>12.1f}% "
            f"{figures.lost_runs_pct:>11.1f}% {figures.wasted_tokens_avg:>14,.0f} "
            f"{figures.wasted_seconds_avg:>9.2f} {figures.checkpoint_seconds_avg:>13.2f}"
        )
    rows.append("")
    rows.append(
        "steps redone: finished steps done again, per run (avg); action twice / lost: runs "
        "(%) in which demo-upstream performed an action twice / never"
    )
    expected = ", ".join(
        f"{name} {tokens:,.0f} / {seconds:.2f} s"
        for name in outcome.strategies
        for tokens, seconds in [expectation(STRATEGIES[name])]
    )
    rows.append(
        "wasted tokens / s: finished steps redone plus the part of the step the crash "
        "interrupted, per run (avg), at invented per-step costs; the model expects "
        f"{expected}; checkpoint s: saves x {CHECKPOINT_SAVE_SECONDS * 1000:.0f} ms (invented)"
    )
    note = too_few_runs(outcome.runs) if "B" in outcome.strategies else None
    if note is not None:
        rows.append(note)
    if outcome.gateway is not None:
        gateway = outcome.gateway
        rows.append(
            f"gateway SIGKILLed {gateway['kills']} times; {gateway['runs_with_unknown_key']} "
            f"C runs had a key go unknown, resolved from the upstream's records: "
            f"{gateway['resolved_completed']} completed, {gateway['resolved_released']} released"
        )
    if outcome.late is not None:
        late = outcome.late
        rows.append(
            f"E, F: resumed {late['resumed_after_seconds']:g} s after the crash, past the "
            f"{late['key_ttl_seconds']:g} s its keys live at the gateway's /late route"
        )
        for name in LATE_STRATEGIES:
            counts = late[name]
            rows.append(
                f"{name}: {counts['runs_left_pending']} runs crashed with an action pending; "
                f"{counts['runs_stopped']} stopped for reconciliation ({counts['marked_done']} "
                f"marked done from the upstream's records, {counts['resent']} resent)"
            )
    return "\n".join(rows)
