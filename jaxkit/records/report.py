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

from jaxkit.records.metrics import read_metrics
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


def _stages(train: list[dict]) -> list[list[dict]]:
    """A run's train records cut where the global batch or K changes (a batch schedule's
    stages, or a resume under another plan): each part's steps take their own time."""
    parts: list[list[dict]] = []
    for record in train:
        batch = (record.get("global_batch_size"), record.get("grad_accum_steps"))
        if not parts or batch != (
            parts[-1][-1].get("global_batch_size"),
            parts[-1][-1].get("grad_accum_steps"),
        ):
            parts.append([])
        parts[-1].append(record)
    return parts


def _row(
    name: str, status: str, plan: dict, part: list[dict], timed: list[dict], evals: list[dict]
) -> dict:
    """The table's row for train records `part` (a stage, or the run), timed by `timed`."""
    # Each record's own rate: a window's time and rate belong to its own stage.
    times = [r["step_time_s"] for r in timed]
    rates = [r["examples_per_s"] for r in timed]
    last = part[-1] if part else {}
    return {
        "run": name,
        "status": status,
        "devices": plan.get("data_parallel_size"),
        "per_device": plan.get("per_device_batch_size"),
        "accum": last.get("grad_accum_steps", plan.get("grad_accum_steps")),
        "global_batch": last.get("global_batch_size", plan.get("global_batch_size")),
        "steps": last.get("step", 0),
        "final_loss": last.get("loss"),
        "final_eval_loss": evals[-1]["eval_loss"] if evals else None,
        "median_step_time_s": statistics.median(times) if times else None,
        "examples_per_s": statistics.median(rates) if rates else None,
    }


def summary_rows(run: dict) -> list[dict]:
    """The run's row, whose timings are its last stage's (as summary.json's), and for a
    run whose batch changed one row per stage after it."""
    train = [r for r in run["records"] if "loss" in r]
    evals = [r for r in run["records"] if "eval_loss" in r]
    plan = run["plan"] or {}
    status = "finished" if run["summary"] else "running or interrupted"
    stages = _stages(train)
    # The run's first window includes compilation: its time is no stage's step time.
    timed = [[r for r in part if r is not train[0]] for part in stages]
    rows = [_row(run["name"], status, plan, train, timed[-1] if timed else [], evals)]
    if len(stages) < 2:
        return rows
    changes = [r for r in run["records"] if r.get("event") == "plan_change"]
    after = 0
    for i, (part, times) in enumerate(zip(stages, timed, strict=True)):
        mine = [e for e in evals if after < e["step"] <= part[-1]["step"]]  # its params'
        name = f"{run['name']} stage {i + 1}"
        row = _row(name, f"of {len(stages)}", plan, part, times, mine)
        ended = _plan_change_ending(changes, part, stages[i + 1] if i + 1 < len(stages) else [])
        if ended:  # a resume under another plan ended it: it ran on the plan it left
            left = ended["from_plan"]
            row["devices"] = left.get("data_parallel_size")
            row["per_device"] = left.get("per_device_batch_size")
            row["steps"] = ended["step"]  # where it stopped, not its last logged step
        rows.append(row)
        after = part[-1]["step"]
    return rows


def _plan_change_ending(changes: list[dict], part: list[dict], following: list[dict]) -> dict:
    """The plan change between a stage's last record and the next stage's first, if any:
    rows otherwise read the run's plan.json, which is the last stage's."""
    if not following:
        return {}
    last, first_next = part[-1]["step"], following[0]["step"]
    return next((c for c in changes if last <= c["step"] < first_next), {})


def summary_row(run: dict) -> dict:
    """The run's own row of the report's table."""
    return summary_rows(run)[0]


def by_source_rows(run: dict) -> list[dict]:
    """A mixture's row per source, in NAME order, from summary.json: the examples and
    epochs it gave (examples_by_source, epochs_by_source) and its own held-out loss
    (eval_loss_by_source). None for a run of one source or one not finished."""
    summary = run["summary"] or {}
    fields = {
        "examples": summary.get("examples_by_source") or {},
        "epochs": summary.get("epochs_by_source") or {},
        "eval_loss": summary.get("eval_loss_by_source") or {},
    }
    names = sorted(set().union(*fields.values()))
    return [
        {"run": run["name"], "source": name}
        | {key: values.get(name) for key, values in fields.items()}
        for name in names
    ]


def _by_source_table(runs: list[dict]) -> list[str]:
    rows = [row for run in runs for row in by_source_rows(run)]
    if not rows:
        return []
    lines = [
        "",
        "Rows read from each source of a mixture, and each source's held-out loss:",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
    ]
    spec = {"epochs": ".3f", "eval_loss": ".4f"}
    for row in rows:
        lines.append("| " + " | ".join(_fmt(v, spec.get(k, "")) for k, v in row.items()) + " |")
    return lines


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

    rows = [row for run in runs for row in summary_rows(run)]
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
    lines += _by_source_table(runs)
    lines += ["", "Loss against optimizer steps and against examples seen (eval dashed):", ""]
    lines += [f"![{name}]({name})" for name in PLOTS[:2]]
    lines += ["", "Throughput over the run:", "", f"![{PLOTS[2]}]({PLOTS[2]})", ""]
    (out_dir / "report.md").write_text("\n".join(lines), encoding="utf-8")
    return out_dir
