"""`oncegate lab --plot FILE.svg`: the lab's figures as a small SVG chart, written by hand (no
plotting library to install). Four panels: steps redone per run; runs with an action performed
twice or never; tokens wasted per run; seconds wasted and spent saving checkpoints per run."""

from __future__ import annotations

import math
from collections.abc import Callable
from html import escape
from pathlib import Path

from .report import Outcome
from .task import STEPS
from .worker import RUNNER

WIDTH, HEIGHT = 760, 660
PANEL_WIDTH, PANEL_HEIGHT = 340, 200
ROWS = (60, 340)  # the top of each row of panels
COLUMNS = (20, 400)
COLOURS = {
    "redone": "#4e79a7",
    "duplicate": "#e15759",
    "lost": "#f28e2b",
    "tokens": "#76b7b2",
    "wasted": "#59a14f",
    "checkpoint": "#b07aa1",
}
LEGEND = [
    ("steps redone", "redone"),
    ("action performed twice", "duplicate"),
    ("action lost", "lost"),
    ("tokens wasted", "tokens"),
    ("seconds wasted", "wasted"),
    ("seconds saving checkpoints", "checkpoint"),
]

Series = list[tuple[str, dict[str, float]]]


def svg(outcome: Outcome) -> str:
    names = list(outcome.strategies)
    figures = outcome.strategies

    def column(field: str) -> dict[str, float]:
        return {name: float(getattr(figures[name], field)) for name in names}

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">crash-recovery lab: '
        f"{outcome.runs} runs per strategy, seed {outcome.seed}</text>",
    ]
    parts += _panel(
        (COLUMNS[0], ROWS[0]), "finished steps redone (avg per run)", names,
        [("redone", column("redone_avg"))], float(STEPS), "{:.2f}".format,
    )  # fmt: skip
    parts += _panel(
        (COLUMNS[1], ROWS[0]), "runs with an action twice / lost (%)", names,
        [("duplicate", column("duplicate_runs_pct")), ("lost", column("lost_runs_pct"))],
        100.0, "{:.1f}%".format,
    )  # fmt: skip
    tokens = column("wasted_tokens_avg")
    parts += _panel(
        (COLUMNS[0], ROWS[1]), "tokens wasted (avg per run, invented costs)", names,
        [("tokens", tokens)], _ceiling(max(tokens.values())), "{:,.0f}".format,
    )  # fmt: skip
    seconds: Series = [
        ("wasted", column("wasted_seconds_avg")),
        ("checkpoint", column("checkpoint_seconds_avg")),
    ]
    top = max(value for _, values in seconds for value in values.values())
    parts += _panel(
        (COLUMNS[1], ROWS[1]), "seconds wasted / saving checkpoints (avg per run)", names,
        seconds, _ceiling(top), "{:.2f}".format,
    )  # fmt: skip
    # Three strategies to a line: six on one would run off the chart.
    titles = (outcome.runtime or RUNNER).titles
    for line, first in enumerate(range(0, len(names), 3)):
        descriptions = "; ".join(f"{name}: {titles[name]}" for name in names[first:][:3])
        parts.append(
            f'<text x="{WIDTH / 2}" y="{HEIGHT - 68 + line * 14}" text-anchor="middle" '
            f'font-size="10">{escape(descriptions)}</text>'
        )
    legend_y = HEIGHT - 22
    for index, (label, kind) in enumerate(LEGEND):
        x = 40 + (index % 3) * 240
        y = legend_y + (index // 3) * 16
        parts.append(f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{COLOURS[kind]}"/>')
        parts.append(f'<text x="{x + 18}" y="{y}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _ceiling(value: float) -> float:
    """The scale of a panel: the next 1, 2 or 5 times a power of ten above `value` (1 for 0)."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 2, 5, 10) if step * power >= value)


def _panel(
    corner: tuple[float, float],
    title: str,
    names: list[str],
    series: Series,
    scale: float,
    label: Callable[[float], str],
) -> list[str]:
    left, top = corner
    bottom = top + PANEL_HEIGHT
    parts = [
        f'<text x="{left + PANEL_WIDTH / 2}" y="{top - 14}" text-anchor="middle">'
        f"{escape(title)}</text>",
        f'<line x1="{left + 30}" y1="{bottom}" x2="{left + PANEL_WIDTH}" y2="{bottom}" '
        f'stroke="#333"/>',
    ]
    group = (PANEL_WIDTH - 40) / len(names)
    bar = min(36.0, (group - 12) / len(series))
    font = 10 if bar >= 24 else 8  # narrow bars: their labels must not run into each other
    for index, name in enumerate(names):
        x0 = left + 40 + index * group
        for offset, (kind, values) in enumerate(series):
            value = values[name]
            height = PANEL_HEIGHT * min(value, scale) / scale
            x = x0 + offset * bar
            parts.append(
                f'<rect x="{x:.1f}" y="{bottom - height:.1f}" width="{bar - 2:.1f}" '
                f'height="{height:.1f}" fill="{COLOURS[kind]}"/>'
            )
            parts.append(
                f'<text x="{x + bar / 2 - 1:.1f}" y="{bottom - height - 4:.1f}" '
                f'text-anchor="middle" font-size="{font}">{escape(label(value))}</text>'
            )
        parts.append(
            f'<text x="{x0 + len(series) * bar / 2:.1f}" y="{bottom + 16}" '
            f'text-anchor="middle" font-weight="bold">{escape(name)}</text>'
        )
    return parts


def write(outcome: Outcome, path: Path) -> None:
    if path.suffix.lower() != ".svg":
        raise ValueError(f"--plot writes SVG: name the file *.svg, not {path.name}")
    path.write_text(svg(outcome))
