"""A run's pictures: PNG plots and a Markdown summary from RUN_DIR/metrics/metrics.jsonl.

    megatron-rl report RUN_DIR [--out DIR]          # report_cli.py; default DIR = RUN_DIR/report

    report = write_report("runs/tiny_cpu")          # {"summary": path, "plots": [...], "missing": [...]}

One PNG per chart of megatron_rl/panels.py that is marked for the report: reward and
correctness, KL to the reference, entropy, response length, clip fraction, grad norm, generated
vs effective tokens/s, step time by phase, Δv and D_lag P50/P95/P99, queue depth and drops.
`summary.md` shows each chart with a table (points, first, last, min, max per series).  A series
the run never logged is named under its chart and in the list of missing series at the end, never
skipped silently; a chart with nothing to draw gets no PNG and says so.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from megatron_rl.panels import CHARTS, Chart
from megatron_rl.run_files import read_json, read_jsonl

logger = logging.getLogger(__name__)

Series = dict[str, list[tuple[int, float]]]


def load_series(path: str | Path) -> Series:
    """{metric key: [(step, value), ...] sorted by step} from a metrics.jsonl (last record of a step wins)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path} (is this a run directory?)")
    by_key: dict[str, dict[int, float]] = {}
    for record in read_jsonl(path, key="step"):  # a torn or damaged line is skipped, with one warning
        for key, value in record.items():
            if key in ("step", "time") or not isinstance(value, (int, float)):
                continue
            by_key.setdefault(key, {})[record["step"]] = float(value)
    return {k: sorted(v.items()) for k, v in by_key.items()}


def _stats(points: list[tuple[int, float]]) -> dict[str, float | int | None]:
    finite = [v for _, v in points if math.isfinite(v)]
    return {"points": len(points), "first": points[0][1] if points else None, "last": points[-1][1] if points else None,
            "min": min(finite) if finite else None, "max": max(finite) if finite else None,
            "nonfinite": len(points) - len(finite)}


def plot_chart(chart: Chart, series: Series, keys: list[str], out: Path) -> None:
    """Draw `keys` of `series` (x: step) into the PNG `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for key in keys:
            pts = [(s, v) for s, v in series[key] if math.isfinite(v)]
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o" if len(pts) < 30 else None, ms=3, label=key)
        ax.set_title(chart.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _training(run_dir: Path) -> str:
    """What trained in the run (its run_manifest.json's `training`: "full" or a LoRA run's settings)."""
    path = run_dir / "run_manifest.json"
    if not path.is_file():
        return "not recorded (no run_manifest.json)"
    try:
        return str(read_json(path).get("training") or "not recorded")
    except ValueError as err:  # ConfigError: damaged; the report goes on without it
        logger.warning("%s", err)
        return "not recorded (run_manifest.json cannot be read)"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write the PNGs and summary.md of a run; returns {"summary", "plots", "missing", "steps"}."""
    run_dir = Path(run_dir)
    series = load_series(run_dir / "metrics" / "metrics.jsonl")
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    steps = sorted({s for pts in series.values() for s, _ in pts})
    lines = [f"# Run report: {run_dir.resolve().name}", "",
             f"From `{run_dir / 'metrics' / 'metrics.jsonl'}`: {len(series)} metrics, "
             f"{len(steps)} logged steps ({steps[0] if steps else '-'} to {steps[-1] if steps else '-'}).", "",
             f"Training: {_training(run_dir)}.", ""]
    plots, missing = [], []
    for chart in (c for c in CHARTS if c.wanted(series)):
        found, absent = chart.matches(series)
        keys = [k for ks in found.values() for k in ks]
        missing += [(chart.title, p) for p in absent]
        lines += [f"## {chart.title}", ""]
        if keys:
            png = out / f"{chart.slug}.png"
            plot_chart(chart, series, keys, png)
            plots.append(png)
            lines += [f"![{chart.title}]({png.name})", "", "| series | points | first | last | min | max |",
                      "|---|---|---|---|---|---|"]
            for key in keys:
                st = _stats(series[key])
                note = f" ({st['nonfinite']} non-finite)" if st["nonfinite"] else ""
                lines.append(f"| `{key}` | {st['points']}{note} | {_fmt(st['first'])} | {_fmt(st['last'])} | "
                             f"{_fmt(st['min'])} | {_fmt(st['max'])} |")
            lines.append("")
        else:
            lines += ["No data: nothing to draw.", ""]
        for pattern in absent:
            lines.append(f"- missing: `{pattern}` (not in metrics.jsonl)")
        if absent:
            lines.append("")
    lines += ["## Missing series", ""]
    lines += [f"- {title}: `{pattern}`" for title, pattern in missing] or ["None: every chart's series was logged."]
    summary = out / "summary.md"
    summary.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"summary": str(summary), "plots": [str(p) for p in plots],
            "missing": [f"{t}: {p}" for t, p in missing], "steps": len(steps)}
