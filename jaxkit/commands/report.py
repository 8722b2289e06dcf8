"""`jaxkit report`: plots and a Markdown summary of run directories (JAX need not start)."""

from __future__ import annotations

import argparse

from jaxkit.commands import common


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    report = sub.add_parser(
        "report", help="plots and a Markdown summary of one or more run directories"
    )
    report.add_argument("workdirs", nargs="+", metavar="WORKDIR")
    report.add_argument(
        "--out",
        type=common.directory,
        metavar="DIR",
        help="where to write (default: WORKDIR/report of the first run)",
    )
    return report


def run(opts: argparse.Namespace) -> int:
    from jaxkit.records.report import ReportError, write_report

    try:
        if opts.out is not None:
            common.check_can_write(opts.out, "--out")
        out = write_report(opts.workdirs, opts.out)
    except (ReportError, common.UsageError) as err:
        return common.error(err)
    print(f"report: {out / 'report.md'}")
    return 0
