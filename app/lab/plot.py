"""`oncegate lab --plot FILE.svg`: the lab's figures as a small SVG chart, written by hand (no
plotting library to install). Two panels: steps redone per run, and runs with an action
performed twice or never."""

from __future__ import annotations

from html import escape
from pathlib import Path

from .crashlab import STRATEGIES, Outcome
from .task import STEPS

WIDTH, HEIGHT = 760, 360
PANEL_TOP, PANEL_HEIGHT = 60, 220
COLOURS = {"redone": "#4e79a7", "duplicate": "#e15759", "lost": "#f28e2b"}


def svg(outcome: Outcome) -> str:
    names = list(outcome.strategies)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<text x="{WIDTH / 2}" y="24" text-anchor="middle" font-size="15">crash-recovery lab: '
        f"{outcome.runs} runs per strategy, seed {outcome.seed}</text>",
    ]
    redone = {name: outcome.strategies[name].redone_avg for name in names}
    parts += _panel(
        20, "finished steps redone (avg per run)", names, [("redone", redone)], float(STEPS), ""
    )
    duplicate = {name: outcome.strategies[name].duplicate_runs_pct for name in names}
    lost = {name: outcome.strategies[name].lost_runs_pct for name in names}
    parts += _panel(
        400, "runs with an action twice / lost (%)", names,
        [("duplicate", duplicate), ("lost", lost)], 100.0, "%",
    )  # fmt: skip
    legend_y = HEIGHT - 18
    for index, (label, colour) in enumerate(
        [("steps redone", COLOURS["redone"]), ("action performed twice", COLOURS["duplicate"]),
         ("action lost", COLOURS["lost"])]
    ):  # fmt: skip
        x = 40 + index * 220
        parts.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{colour}"/>')
        parts.append(f'<text x="{x + 18}" y="{legend_y}">{escape(label)}</text>')
    descriptions = "; ".join(f"{name}: {STRATEGIES[name].title}" for name in names)
    parts.append(
        f'<text x="{WIDTH / 2}" y="{HEIGHT - 40}" text-anchor="middle" font-size="10">'
        f"{escape(descriptions)}</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(
    left: float,
    title: str,
    names: list[str],
    series: list[tuple[str, dict[str, float]]],
    scale: float,
    unit: str,
) -> list[str]:
    width = 340
    bottom = PANEL_TOP + PANEL_HEIGHT
    parts = [
        f'<text x="{left + width / 2}" y="{PANEL_TOP - 14}" text-anchor="middle">'
        f"{escape(title)}</text>",
        f'<line x1="{left + 30}" y1="{bottom}" x2="{left + width}" y2="{bottom}" stroke="#333"/>',
    ]
    group = (width - 40) / len(names)
    bar = min(36.0, (group - 12) / len(series))
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
            label = f"{value:.2f}" if not unit else f"{value:.1f}{unit}"
            parts.append(
                f'<text x="{x + bar / 2 - 1:.1f}" y="{bottom - height - 4:.1f}" '
                f'text-anchor="middle" font-size="10">{label}</text>'
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
