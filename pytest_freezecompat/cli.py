"""freezecompat: report tools for the freeze compatibility matrix.

  freezecompat merge SHARD... -o DIR [--known-issues FILE]   one report from the shards of several environments
  freezecompat diff OLD.json NEW.json                        cells whose status changed; exit 1 on a regression
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .report import diff, schema, write
from .report.merge import merge
from .spec import known_issues
from .verdict import cause

#: Exit codes: 0 fine, 1 `diff` found a regression, 2 a file or argument we cannot use.
REGRESSION_EXIT = 1
USAGE_EXIT = 2


def _check_output(directory: Path) -> None:
    """Refuse an output directory we could not create or write before reading a shard, not after the work."""
    try:
        existing = next(p for p in (directory, *directory.parents) if p.exists())  # `.` or `/` at the latest
        if not existing.is_dir():
            raise schema.ReportError(f"{directory}: not a directory (-o names the report directory)"
                                     if existing == directory else
                                     f"{directory}: cannot create it ({existing} is not a directory)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise schema.ReportError(f"{directory}: cannot write there ({existing} is not writable)")
    except OSError as exc:
        raise schema.ReportError(f"{directory}: cannot use it as the report directory ({exc.strerror})") from None


def _merge(args: argparse.Namespace) -> int:
    output = Path(args.output)
    _check_output(output)
    shards = [(path, schema.load(path)) for path in args.shards]
    report = merge(shards)
    if args.known_issues:
        known_issues.annotate(report, known_issues.load(args.known_issues))
    cause.assign(report["cells"])  # controls may sit in another shard
    try:
        write.write(output, report)
    except OSError as exc:
        raise schema.ReportError(f"{output}: cannot write the report ({exc.strerror or exc})") from None
    print(f"merged {len(report['cells'])} cells from {len(shards)} shard(s) into {args.output}/matrix.json")
    return 0


def _diff(args: argparse.Namespace) -> int:
    old, new = schema.load(args.old), schema.load(args.new)
    changes = diff.diff(old, new)
    sys.stdout.write(diff.render(changes, args.old, args.new, len(new["cells"])))
    return REGRESSION_EXIT if any(c.regression for c in changes) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="freezecompat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"freezecompat (pytest-freezecompat) {schema.plugin_version() or 'unknown'}")
    commands = parser.add_subparsers(dest="command", required=True)
    merge_cmd = commands.add_parser("merge", help="merge report shards into one report directory")
    merge_cmd.add_argument("shards", nargs="+", help="matrix.json files")
    merge_cmd.add_argument("-o", "--output", required=True, help="directory for matrix.json, matrix.md, matrix.html")
    merge_cmd.add_argument("--known-issues", metavar="FILE",
                           help="re-match every cell against this known-issue registry (e.g. matrix/known_issues.toml)")
    merge_cmd.set_defaults(func=_merge)
    diff_cmd = commands.add_parser("diff", help="list cells whose status changed; exit 1 on a regression")
    diff_cmd.add_argument("old", help="the last published matrix.json")
    diff_cmd.add_argument("new", help="this run's matrix.json")
    diff_cmd.set_defaults(func=_diff)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (schema.ReportError, known_issues.KnownIssueError) as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
