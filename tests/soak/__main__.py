"""`python -m tests.soak [--minutes M] [--requests N] [--clients C] [--seed S] [--out DIR]
[--scenarios single,failover,citus]`: one chaos soak, its table, and every violation with its
timeline. Exit status 1 if the checker or
the fuzzer found any, 2 if a scenario asked for cannot run here.

`python -m tests.soak --check DIR` runs the checker again on the histories a run left in DIR."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
from pathlib import Path

from tests.soak import checker, history, scenarios
from tests.soak.driver import FORWARD_ROUTES, Options, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="chaos time (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="default: drawn and printed")
    parser.add_argument("--out", type=Path, default=None, help="where the histories go")
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="end the chaos once the clients sent this many requests, if before --minutes",
    )
    parser.add_argument("--clients", type=int, default=24, help="concurrent clients (24)")
    parser.add_argument("--fuzz", type=int, default=10_000, help="fuzzed requests (10,000)")
    parser.add_argument(
        "--scenarios",
        type=lambda text: [name.strip() for name in text.split(",") if name.strip()],
        default=None,
        help=f"stores to run side by side, of {','.join(scenarios.SCENARIOS)} "
        "(default: every one that can run here)",
    )
    parser.add_argument("--check", type=Path, metavar="DIR", help="only check a run's histories")
    options = parser.parse_args()
    if options.check is not None:
        return check_again(options.check)
    try:
        chosen, skipped = scenarios.choose(options.scenarios)
    except ValueError as error:
        print(f"soak: {error}", file=sys.stderr)  # noqa: T201
        return 2
    seed = options.seed if options.seed is not None else random.SystemRandom().randrange(10**6)
    out = options.out or Path(tempfile.mkdtemp(prefix=f"oncegate-soak-{seed}-"))
    seconds = options.minutes * 60
    cap = f", at most {options.requests:,} requests" if options.requests else ""
    print(f"soak: seed {seed}, {options.minutes:g} min{cap}, histories in {out}", flush=True)  # noqa: T201
    print(f"soak: scenarios {', '.join(chosen)}", flush=True)  # noqa: T201
    for name, why in skipped.items():
        print(f"soak: scenario {name} left out: {why}", flush=True)  # noqa: T201
    summary = asyncio.run(
        run(
            Options(
                seconds=seconds,
                seed=seed,
                out=out,
                clients=options.clients,
                fuzz_requests=options.fuzz,
                # About 200 gateway signals in 10 minutes, 150 of them SIGKILL (a loaded machine
                # skips some while gateways restart), over every deployment's gateways but the
                # first of each.
                kill_interval=3.0,
                sizes=scenarios.Sizes.for_seconds(seconds),
                scenarios=options.scenarios,
                requests=options.requests,
            )
        )
    )
    print(summary.table)  # noqa: T201
    for violation in summary.result.violations[:50]:
        print(violation.report())  # noqa: T201
    for line in summary.fuzz_violations[:50]:
        print(f"[fuzz] {line}")  # noqa: T201
    print(f"histories: {out} (replay with --seed {seed})")  # noqa: T201
    return 0 if summary.ok else 1


def check_again(directory: Path) -> int:
    result = checker.check(
        history.read(directory / "attempts.jsonl", history.Attempt),
        history.read(directory / "upstream.jsonl", history.Performed),
        history.read(directory / "keys.jsonl", history.Row),
        history.read(directory / "events.jsonl", history.Event),
        forward_routes=FORWARD_ROUTES,
    )
    for violation in result.violations:
        print(violation.report())  # noqa: T201
    causes = ", ".join(f"{cause} {count:,}" for cause, count in result.unknown_causes.most_common())
    print(f"unknown keys, in flight at: {causes or '-'}")  # noqa: T201
    print(f"{len(result.violations)} violations")  # noqa: T201
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
