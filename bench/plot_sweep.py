"""Plot bench/serve_sweep.py results: one PNG grid of latency and throughput curves against offered QPS.

Each input file is one series, named by its `label` field (else the file's stem).

    uv run python bench/plot_sweep.py bench/results/a.json bench/results/b.json -o sweep.png --title "H200 Qwen3-4B"
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LATENCY_METRICS = ("itl_ms", "tpot_ms", "ttft_ms")
LATENCY_PANELS = (("ITL p50", "itl_ms", "p50"), ("ITL p99", "itl_ms", "p99"), ("TPOT p50", "tpot_ms", "p50"),
                  ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"))


class NotASweepResult(ValueError):
    """The file cannot be read as a JSON document written by bench/serve_sweep.py."""


@dataclass(frozen=True)
class Sweep:
    label: str
    max_tokens: int | None
    levels: list[dict[str, Any]]

    def qps(self) -> list[float]:
        return [float(level["qps"]) for level in self.levels]


def check_level(level: object) -> None:
    if not isinstance(level, dict) or not isinstance(level.get("qps"), (int, float)):
        raise NotASweepResult("a level has no numeric 'qps'")
    if not isinstance(level.get("output_throughput"), (int, float)):
        raise NotASweepResult("a level has no numeric 'output_throughput'")
    for metric in LATENCY_METRICS:
        stats = level.get(metric)
        if not isinstance(stats, dict) or not {"p50", "p99"} <= stats.keys():
            raise NotASweepResult(f"a level has no '{metric}' with p50 and p99")


def load_sweep(path: Path) -> Sweep:
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NotASweepResult(f"cannot read JSON ({type(exc).__name__})") from exc
    levels = document.get("levels") if isinstance(document, dict) else None
    if not isinstance(levels, list) or not levels:
        raise NotASweepResult("no non-empty 'levels' list")
    for level in levels:
        check_level(level)
    label = document.get("label") or path.stem
    max_tokens = document.get("max_tokens")
    return Sweep(str(label), max_tokens if isinstance(max_tokens, int) else None,
                 sorted(levels, key=lambda level: level["qps"]))


def format_qps_axis(ax: Any, all_qps: list[float]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_qps, [f"{q:g}" for q in all_qps])
    ax.minorticks_off()
    ax.set_xlabel("offered load (requests/s)")
    ax.grid(True, alpha=0.3)


def plot_latency(ax: Any, sweeps: list[Sweep], title: str, metric: str, stat: str) -> None:
    for sweep in sweeps:
        ax.plot(sweep.qps(), [level[metric][stat] for level in sweep.levels], marker="o", label=sweep.label)
    ax.set_title(title)
    ax.set_ylabel("ms")
    ax.set_ylim(bottom=0)


def plot_throughput(ax: Any, sweeps: list[Sweep], all_qps: list[float]) -> None:
    for max_tokens in sorted({s.max_tokens for s in sweeps if s.max_tokens is not None}):
        ax.plot(all_qps, [q * max_tokens for q in all_qps], linestyle="--", color="gray",
                label=f"ideal (qps × {max_tokens})")
    for sweep in sweeps:
        (line,) = ax.plot(sweep.qps(), [level["output_throughput"] for level in sweep.levels], marker="o",
                          label=sweep.label)
        failed = [level for level in sweep.levels if level.get("failed", 0)]
        if failed:
            ax.scatter([level["qps"] for level in failed], [level["output_throughput"] for level in failed],
                       marker="x", s=80, color=line.get_color(), zorder=3, label=f"{sweep.label}: had failures")
    ax.set_title("Output token throughput")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")


def render(sweeps: list[Sweep], out: Path, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_qps = sorted({q for sweep in sweeps for q in sweep.qps()})
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (panel_title, metric, stat) in zip(axes.flat, LATENCY_PANELS):
        plot_latency(ax, sweeps, panel_title, metric, stat)
        format_qps_axis(ax, all_qps)
    throughput_ax = axes.flat[len(LATENCY_PANELS)]
    plot_throughput(throughput_ax, sweeps, all_qps)
    format_qps_axis(throughput_ax, all_qps)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(title or "serve_sweep: " + ", ".join(sweep.label for sweep in sweeps))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="JSON files written by bench/serve_sweep.py")
    ap.add_argument("-o", "--out", type=Path, required=True, help="PNG to write")
    ap.add_argument("--title", default=None)
    return ap.parse_args(argv)


def fail(message: str) -> int:
    print(f"plot_sweep: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sweeps: list[Sweep] = []
    for path in args.results:
        try:
            sweeps.append(load_sweep(path))
        except NotASweepResult as exc:
            return fail(f"{path}: not a serve_sweep result: {exc}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return fail("matplotlib is not installed (it is in the dev group: run `uv sync`)")
    render(sweeps, args.out, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
