"""`freezecompat merge SHARD... -o DIR`: one report from the shards of several environments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .report import schema, write
from .report.merge import merge


def _merge(args: argparse.Namespace) -> int:
    shards = [(path, schema.load(path)) for path in args.shards]
    report = merge(shards)
    write.write(Path(args.output), report)
    print(f"merged {len(report['cells'])} cells from {len(shards)} shard(s) into {args.output}/matrix.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="freezecompat", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    merge_cmd = commands.add_parser("merge", help="merge report shards into one report directory")
    merge_cmd.add_argument("shards", nargs="+", help="matrix.json files")
    merge_cmd.add_argument("-o", "--output", required=True, help="directory for matrix.json and matrix.md")
    merge_cmd.set_defaults(func=_merge)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except schema.ReportError as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
