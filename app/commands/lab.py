"""`oncegate lab`: its flags, and the command that runs the lab (`crashlab`) on its stack.

The lab's modules are imported when the command runs (or its `--help` is asked for), never when
the parser is built: every other command would pay for them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..model import errors
from ..telemetry import logs
from . import argument_types

if TYPE_CHECKING:
    from ..lab.worker import Runtime


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `lab` to the `oncegate` command's subparsers."""
    lab = commands.add_parser(
        "lab",
        help="the crash-recovery lab: kill an agent at random, resume it, count duplicates",
        description="Run a 12-step agent task N times under each strategy (A restart, "
        "B checkpoint, C checkpoint + keys through the gateway, D save first then act), kill "
        "each run with SIGKILL at a random point, resume it, and count what the demo upstream "
        "really performed. Starts its own PostgreSQL, gateway and demo upstream unless told "
        "where they are.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    lab.add_argument("-h", "--help", action=_LabHelp, help="show this help message and exit")
    lab.add_argument(
        "--runs", type=argument_types.positive, default=1000, help="runs per strategy (1000)"
    )
    lab.add_argument("--seed", type=int, default=24, help="seed of the crash points (24)")
    lab.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    lab.add_argument("--plot", metavar="FILE.svg", type=Path, help="also write an SVG chart")
    lab.add_argument(
        "--strategies", type=_strategies, help="which to run (default ABCD; ABC on LangGraph)"
    )
    lab.add_argument(
        "--runtime",
        choices=["runner", "langgraph", "langgraph-tools"],
        default="runner",
        help="what plays the task: the agent library's runner (default), a LangGraph graph "
        "checkpointed by PostgresSaver, or that graph with each action a tool call of a scripted "
        "model (strategies A, B, C; needs oncegate[langgraph])",
    )
    lab.add_argument(
        "--kill-gateway",
        metavar="SHARE",
        type=float,
        nargs="?",
        const=0.05,
        default=0.0,
        help="also SIGKILL the gateway during this share of the C runs (0.05 without a value)",
    )
    lab.add_argument(
        "--late-resume",
        action="store_true",
        help="also run E (C resumed after its keys expired at the gateway) and F (E with the "
        "client's key-age check: stops for reconciliation instead of resending)",
    )
    lab.add_argument("--jobs", type=argument_types.positive, default=4, help="runs at a time (4)")
    lab.add_argument(
        "--database-url",
        metavar="URL",
        type=argument_types.database_url,
        help="a migrated PostgreSQL, not embedded (one host or several, as ONCEGATE_DATABASE_URL)",
    )
    lab.add_argument("--upstream", metavar="URL", help="a running demo-upstream")
    lab.add_argument("--gateway", metavar="URL", help="a running gateway in front of it")
    lab.set_defaults(run=run)


class _LabHelp(argparse.Action):
    """`oncegate lab --help`, ending with the invented costs the lab prices its waste at: built
    only when asked for, as it imports the lab (every other command would pay for it)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.epilog = _lab_costs()
        parser.print_help()
        parser.exit()


def _lab_costs() -> str:
    """`--help`'s account of the invented costs the wasted columns are priced at."""
    from ..lab import model, task

    steps = task.support_task("run")
    lines = [
        "The wasted tokens and seconds are priced at invented per-step costs, as the",
        "write-up's are (the steps here take microseconds): every finished step redone, plus",
        "the part of the step the crash interrupted. Checkpoint seconds: each save at "
        f"{task.CHECKPOINT_SAVE_SECONDS * 1000:.0f} ms,",
        "invented too.",
        "",
    ]
    for number, step in enumerate(steps, start=1):
        cost = task.COSTS[number]
        lines.append(
            f"  {number:>2} {step.name:<18} {cost.tokens:>6,} tokens {cost.seconds:>5.1f} s"
        )
    lines += ["", "The model expects, per run (docs/lab.md shows the arithmetic):"]
    for name in "ABD":
        tokens, seconds = model.expectation(model.STRATEGIES[name])
        also = {"B": " (and C, E)", "D": " (and F)"}.get(name, "")
        lines.append(f"  {name} {tokens:>8,.0f} tokens {seconds:>6.2f} s wasted{also}")
    return "\n".join(lines)


def _strategies(text: str) -> str:
    letters = text.upper()
    if not letters or not set(letters) <= set("ABCD") or len(set(letters)) != len(letters):
        raise argparse.ArgumentTypeError(f"letters among A, B, C, D, each once, not {text!r}")
    return letters


def run(arguments: argparse.Namespace) -> int:
    """`oncegate lab`: run the lab as the flags say, print its table (or JSON), exit 1 when a
    run failed."""
    import json

    from ..lab import crashlab, model, plot, report, stack, worker

    if arguments.plot is not None and arguments.plot.suffix.lower() != ".svg":
        raise errors.ConfigError(f"--plot writes SVG: name the file *.svg, not {arguments.plot}")
    if arguments.kill_gateway and arguments.gateway:
        raise errors.ConfigError("--kill-gateway needs the lab's own gateway: drop --gateway")
    if not 0 <= arguments.kill_gateway <= 1:
        raise errors.ConfigError("--kill-gateway takes a share between 0 and 1")
    if arguments.late_resume and arguments.gateway:
        raise errors.ConfigError(
            "--late-resume needs the lab's own gateway (its /late route keeps keys seconds, "
            "not a day): drop --gateway"
        )
    runtime: Runtime = worker.RUNNER
    if arguments.runtime in ("langgraph", "langgraph-tools"):
        runtime = _langgraph_runtime(arguments)
    arguments.strategies = arguments.strategies or "".join(
        name for name in "ABCD" if name in runtime.titles
    )
    if arguments.gateway and not arguments.upstream and "C" in arguments.strategies:
        raise errors.ConfigError("--gateway needs --upstream: the one it forwards to")
    logs.configure("text", "warning")
    try:
        with stack.running(
            arguments.database_url, arguments.upstream, arguments.gateway
        ) as services:
            lab = crashlab.Lab(
                services,
                runs=arguments.runs,
                seed=arguments.seed,
                strategies=arguments.strategies,
                jobs=arguments.jobs,
                kill_gateway=arguments.kill_gateway,
                late_resume=arguments.late_resume,
                progress=report.ProgressBar(sys.stderr),
                runtime=runtime,
            )
            outcome = lab.run()
    except stack.NotStarted as exc:
        # Everything the lab started is stopped by now (`stack.running`).
        print(f"oncegate lab: {exc}; everything the lab started is stopped", file=sys.stderr)
        # As that command's status (2 a busy port, 3 PostgreSQL unreachable), 1 when stopped.
        return exc.status if exc.status is not None and exc.status > 0 else 1
    if arguments.json:
        print(json.dumps(outcome.document()))
        note = model.too_few_runs(outcome.runs) if "B" in outcome.strategies else None
        if note is not None:
            print(f"oncegate lab: {note}", file=sys.stderr)
    else:
        print(report.table(outcome))
    if arguments.plot is not None:
        plot.write(outcome, arguments.plot)
        print(f"oncegate lab: chart written to {arguments.plot.resolve()}", file=sys.stderr)
    for failure in outcome.failures:
        print(f"oncegate lab: {failure}", file=sys.stderr)
    return 1 if outcome.failures else 0


def _langgraph_runtime(arguments: argparse.Namespace) -> Runtime:
    """`lab --runtime langgraph` (or `langgraph-tools`)'s runtime, after refusing what it does
    not have."""
    name = arguments.runtime
    unknown = set(arguments.strategies or "") - set("ABC")
    if unknown:
        raise errors.ConfigError(
            f"--runtime {name} plays strategies A, B and C, not {', '.join(sorted(unknown))}"
        )
    if arguments.kill_gateway or arguments.late_resume:
        raise errors.ConfigError(
            f"--kill-gateway and --late-resume are the runner's: drop them or --runtime {name}"
        )
    try:
        from ..lab import langgraph_runtime
    except ImportError as exc:
        raise errors.ConfigError(
            f"--runtime {name} needs LangGraph: pip install 'oncegate[langgraph]' ({exc})"
        ) from exc
    return (
        langgraph_runtime.TOOLS_RUNTIME if name == "langgraph-tools" else langgraph_runtime.RUNTIME
    )
