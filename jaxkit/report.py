"""`jaxkit report`: plots and a Markdown summary for one or several run directories.

Reads only what a run writes as it goes (plan.json, metrics.jsonl, and summary.json when
the run has finished), so it works on a run that is still going or was interrupted.
"""

from __future__ import annotations

import json
import os
import statistics

from etils import epath
from matplotlib.figure import Figure  # no pyplot: no global backend state, no display needed

from jaxkit.metrics import read_metrics
from jaxkit.workdir import as_path, make_dirs, missing_gcs_support

PLOTS = ("loss_vs_step.png", "loss_vs_examples.png", "throughput.png")


class ReportError(ValueError):
    """A directory that is not a jaxkit run."""


def _check_reachable(path: str | os.PathLike) -> None:
    missing = missing_gcs_support(path)
    if missing:
        raise ReportError(missing)


def load_run(workdir: str | os.PathLike) -> dict:
    """A run's records, plan, summary and config, from a local path or a URL (gs://...)."""
    path = as_path(workdir)
    _check_reachable(path)
    if not (path / "metrics.jsonl").is_file():
        raise ReportError(f"{path} has no metrics.jsonl: not a jaxkit run directory")
    run = {"name": path.name, "path": path, "records": read_metrics(path)}
    for key in ("plan", "summary", "config"):
        file = path / f"{key}.json"
        run[key] = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None
    return run


def _series(records: list[dict], key: str, x: str) -> tuple[list, list]:
    points = [(r[x], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def _save(fig: Figure, path: epath.Path) -> None:
    with path.open("wb") as f:  # a file object: savefig alone cannot write to gs://
        fig.savefig(f, format="png", dpi=110)


def _plot(runs: list[dict], out: epath.Path, x: str, xlabel: str, name: str) -> None:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for run in runs:
        line = ax.plot(*_series(run["records"], "loss", x), label=f"{run['name']} train")[0]
        ax.plot(
            *_series(run["records"], "eval_loss", x),
            "o--",
            color=line.get_color(),
            label=f"{run['name']} eval",
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, out / name)


def _plot_throughput(runs: list[dict], out: epath.Path) -> None:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for run in runs:
        ax.plot(*_series(run["records"], "examples_per_s", "step"), label=run["name"])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("examples / s (mean over each log window)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    _save(fig, out / PLOTS[2])


def _fmt(value: object, spec: str = ".4f") -> str:
    return "—" if value is None else format(value, spec) if isinstance(value, float) else str(value)


def summary_row(run: dict) -> dict:
    train = [r for r in run["records"] if "loss" in r]
    evals = [r for r in run["records"] if "eval_loss" in r]
    plan = run["plan"] or {}
    # The first window includes compilation. Each record's own rate: a run resumed with
    # another global batch has steps of both sizes.
    times = [r["step_time_s"] for r in train[1:]]
    step_time = statistics.median(times) if times else None
    rates = [r["examples_per_s"] for r in train[1:]]
    last = train[-1] if train else {}
    return {
        "run": run["name"],
        "status": "finished" if run["summary"] else "running or interrupted",
        "devices": plan.get("data_parallel_size"),
        "per_device": plan.get("per_device_batch_size"),
        # The last step's: a batch schedule changes both as the run goes.
        "accum": last.get("grad_accum_steps", plan.get("grad_accum_steps")),
        "global_batch": last.get("global_batch_size", plan.get("global_batch_size")),
        "steps": train[-1]["step"] if train else 0,
        "final_loss": train[-1]["loss"] if train else None,
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "median_step_time_s": step_time,
        "examples_per_s": statistics.median(rates) if rates else None,
    }


def write_report(
    workdirs: list[str | os.PathLike], out: str | os.PathLike | None = None
) -> epath.Path:
    """Writes the PNG plots and report.md for the runs; returns the report directory."""
    runs = [load_run(w) for w in workdirs]
    if out:
        _check_reachable(out)
    out_dir = as_path(out) if out else runs[0]["path"] / "report"
    make_dirs(out_dir)
    _plot(runs, out_dir, "step", "optimizer step", PLOTS[0])
    _plot(runs, out_dir, "examples_seen", "examples seen", PLOTS[1])
    _plot_throughput(runs, out_dir)

    rows = [summary_row(run) for run in runs]
    header = list(rows[0])
    lines = [
        "# jaxkit report",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in rows:
        cells = [_fmt(row[k], ".1f" if k == "examples_per_s" else ".4f") for k in header]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Loss against optimizer steps and against examples seen (eval dashed):", ""]
    lines += [f"![{name}]({name})" for name in PLOTS[:2]]
    lines += ["", "Throughput over the run:", "", f"![{PLOTS[2]}]({PLOTS[2]})", ""]
    (out_dir / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return out_dir
