"""freezecompat: report tools for the freeze compatibility matrix.

  freezecompat merge SHARD... -o DIR [--known-issues FILE]   one report from the shards of several environments
  freezecompat diff OLD.json NEW.json                        cells whose status changed; exit 1 on a regression
  freezecompat bisect --framework FW --select AXIS=V,... --good R --bad R
                                                             the first release where those cells change status
  freezecompat advise --framework FW --plugin P --freeze PATTERN [--release R] [--model M] ...
                                                             is this setup safe, why not, and what to do instead
                                                             (leave out --plugin or --freeze: the values held)
  freezecompat finding [ID]                                  a finding's upstream-ready report (no ID: the list)
  freezecompat watch [--pre] [--apply] [--json FILE]         releases on the package index the matrix does not run
  freezecompat watch-report CANDIDATES PUBLISHED RAN -o DIR  what each new release changed; exit 1 on a regression
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .report import diff, schema, write
from .report.merge import merge
from .spec import known_issues
from .verdict import classify

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
    report = merge(shards, replace=args.replace)
    if args.known_issues:
        known_issues.annotate(report, known_issues.load(args.known_issues))
    if args.bisections:
        try:
            report["bisections"] = json.loads(Path(args.bisections).read_text())
        except (OSError, ValueError) as exc:
            raise schema.ReportError(f"{args.bisections}: cannot read the bisections ({exc})") from None
    classify(report["cells"])  # controls may sit in another shard
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


def _bisect(args: argparse.Namespace) -> int:
    import subprocess  # only this command reaches the package index and builds environments

    from . import bisect
    from .spec.matrix import SpecError, load

    try:
        spec = load(args.spec)
    except SpecError as exc:
        raise bisect.BisectError(str(exc)) from None
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file():
        raise bisect.BisectError("bisect installs this package into each release's environment from its source "
                                 "checkout; run it from a clone of pytest-freezecompat")
    if args.framework not in spec.frameworks:
        raise bisect.BisectError(f"unknown framework {args.framework!r}; valid: {', '.join(spec.frameworks)}")
    package = spec.frameworks[args.framework].package
    listing = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                             text=True, check=False)
    if listing.returncode != 0:
        raise bisect.BisectError(f"pip index versions {package}: {listing.stderr.strip().splitlines()[-1:]}")
    select = args.select
    if "/" in select:  # a cell id: every axis but the release, which the bisection varies
        try:
            key = bisect.CellKey.parse(select)
        except ValueError as exc:
            raise bisect.BisectError(str(exc)) from None
        select = ",".join(part for part in key.selection().split(",") if not part.startswith("release="))
    found = bisect.bisect(spec, args.framework, select, args.good, args.bad, root=root,
                          envs=Path(args.envs) if args.envs else root / ".nox", listing=listing.stdout,
                          report=lambda line: print(line, flush=True))
    print("\n".join(bisect.summary(found)))
    if args.record:
        bisect.record(found, Path(args.record))
        print(f"recorded in {args.record}")
    return 0 if found.first_changed else 1


#: Where `advise` looks when told nowhere: this project's own pytest run first, then a checkout's published report.
REPORT_PLACES = (".freeze-matrix/matrix.json", "reports/matrix.json")


def _report_path(given: str | None) -> str:
    """The report to read: `given` (a matrix.json or the folder holding one), else the first of `REPORT_PLACES`."""
    if given is not None:
        path = Path(given)
        return str(path / "matrix.json" if path.is_dir() else path)
    found = next((place for place in REPORT_PLACES if Path(place).is_file()), None)
    if found is None:
        raise schema.ReportError(f"no report here ({' nor '.join(REPORT_PLACES)}): run pytest with your @freeze_case "
                                 "models first, or name one with --report")
    return found


def _advise(args: argparse.Namespace) -> int:
    from . import advice
    from .advice import answer, nearest

    args.report = _report_path(args.report)
    report = schema.load(args.report)
    if "workarounds" not in report:  # written before reports carried their advice
        advice.annotate(report)
    named = {axis: value for axis in nearest.SETUP_AXES if (value := getattr(args, axis))}
    listing = not {"framework", "plugin", "freeze"} <= named.keys()  # no one setup yet: say what there is to name
    try:
        cells = nearest.select(report["cells"], named, answering=not listing)
    except nearest.NotInReport as exc:
        raise schema.ReportError(f"{args.report}: {exc}") from None
    print("\n".join(answer.listing(cells, named) if listing else answer.answer(cells)))
    return 0


def _finding(args: argparse.Namespace) -> int:
    from .report import findings

    entries = [entry for entry in known_issues.load(args.known_issues).entries if entry.reproducer]
    directory = findings.findings_dir()
    try:
        print("\n".join(findings.listing(entries, directory)) if args.id is None else
              findings.report(entries, directory, args.id), end="\n" if args.id is None else "")
    except findings.FindingError as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return USAGE_EXIT
    return 0


def _watch(args: argparse.Namespace) -> int:
    import dataclasses

    from .spec import watch
    from .spec.index import IndexUnavailable
    from .spec.matrix import SpecError, load

    try:
        spec = load(args.spec)
        packages = [package for _, package, _ in watch.watched(spec)
                    if not args.only or package in args.only]
        found, made = watch.candidates(spec, watch.ask(args.index, packages), pre=args.pre)
    except (SpecError, IndexUnavailable) as exc:
        raise schema.ReportError(str(exc)) from None
    for release in found:
        print(f"{release.framework}: {release.package} {release.held} (held); newer on the index: "
              f"{', '.join(release.newer) or 'none'}")
    for candidate in made:
        how = (f"new environment {candidate.environment}"
               + (f" on Python {candidate.python}" if candidate.python else "") if candidate.column
               else f"{candidate.package}=={candidate.held} bumped in {candidate.environment}")
        print(f"candidate: {candidate.framework}: {candidate.title} ({how})")
        if args.apply:
            file = Path(spec.frameworks[candidate.framework].where.rsplit(":", 1)[0])
            file.write_text(watch.apply(file.read_text(), candidate))
            print(f"  written into {file}")
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(c) for c in made], indent=1) + "\n")
    return 0


def _watch_report(args: argparse.Namespace) -> int:
    from .core.candidate import Candidate
    from .report import watched

    output = Path(args.output)
    _check_output(output)
    try:
        listed = json.loads(Path(args.candidates).read_text())
        candidates = [Candidate(**{**c, "install": tuple(c["install"])}) for c in listed]
    except (OSError, ValueError, TypeError) as exc:
        raise schema.ReportError(f"{args.candidates}: not the candidates `freezecompat watch --json` wrote "
                                 f"({exc})") from None
    published, ran = schema.load(args.published), schema.load(args.ran)
    output.mkdir(parents=True, exist_ok=True)
    regressions = 0
    for candidate in candidates:
        if args.environment and candidate.environment not in args.environment:
            continue
        judgement = watched.judge(candidate, published, ran)
        page = output / f"{candidate.framework}-{candidate.package}-{candidate.version}.md"
        page.write_text(watched.render(judgement))
        regressions += len(judgement.regressions)
        print(f"{candidate.title}: {len(judgement.regressions)} regression(s), "
              f"{len(judgement.changes) - len(judgement.regressions)} other change(s): {page}")
        for change in judgement.regressions:
            print(f"  {change.line()}")
    return REGRESSION_EXIT if regressions else 0


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
    merge_cmd.add_argument("--bisections", metavar="FILE",
                           help="bisections recorded by `freezecompat bisect --record` (the reports place fixes "
                                "by them)")
    merge_cmd.add_argument("--replace", action="store_true",
                           help="a later shard's environments replace an earlier one's, cells and all (a published "
                                "report first, then new runs of some of its environments)")
    merge_cmd.set_defaults(func=_merge)
    diff_cmd = commands.add_parser("diff", help="list cells whose status changed; exit 1 on a regression")
    diff_cmd.add_argument("old", help="the last published matrix.json")
    diff_cmd.add_argument("new", help="this run's matrix.json")
    diff_cmd.set_defaults(func=_diff)
    bisect_cmd = commands.add_parser("bisect", help="the first release of a framework where selected cells change "
                                                    "status (builds an environment per probed release)")
    bisect_cmd.add_argument("--framework", required=True)
    bisect_cmd.add_argument("--select", default="", metavar="AXIS=VALUE,...",
                            help="the cells, as --freeze-matrix-select takes them, or one cell's id")
    bisect_cmd.add_argument("--good", required=True, metavar="RELEASE")
    bisect_cmd.add_argument("--bad", required=True, metavar="RELEASE")
    bisect_cmd.add_argument("--spec", default=None, metavar="FILE", help="matrix file (default: the packaged one)")
    bisect_cmd.add_argument("--envs", default=None, metavar="DIR",
                            help="where environments are found and built (default: the checkout's .nox)")
    bisect_cmd.add_argument("--record", default=None, metavar="FILE",
                            help="add the result to this JSON list (reports/bisections.json: the reports show it)")
    bisect_cmd.set_defaults(func=_bisect)
    advise_cmd = commands.add_parser(
        "advise", help="one setup's verdict in a report, why, and the nearest safe setups",
        description="Is this setup safe, why not, and what to do instead: every setup the report ran of it, every "
                    "model's (the matrix's, the examples' and your @freeze_case models). Leave out --framework, "
                    "--plugin or --freeze to list the values the report holds (its frameworks, releases, models, "
                    "plugins and each model's freeze patterns) for whatever you do name.")
    advise_cmd.add_argument("--framework",
                            help="e.g. hf, torch, deepspeed, colossalai, lightning (leave out: list them)")
    advise_cmd.add_argument("--plugin", help="how the model is wrapped (leave out: list the framework's)")
    advise_cmd.add_argument("--freeze", metavar="PATTERN", help="what is frozen (leave out: list each model's)")
    advise_cmd.add_argument("--release", help="the framework's release (default: the report's newest)")
    advise_cmd.add_argument("--model", help="(default: every model the report ran the setup with)")
    advise_cmd.add_argument("--checkpoint", help="activation checkpointing (default: every mode the report ran)")
    advise_cmd.add_argument("--init", help="(default: every init the report ran)")
    advise_cmd.add_argument("--clip", help="clip or no-clip (default: both where the report ran both)")
    advise_cmd.add_argument("--report", default=None, metavar="PATH",
                            help="a matrix.json or its folder (default: .freeze-matrix/matrix.json, your pytest "
                                 "run's, else reports/matrix.json)")
    advise_cmd.set_defaults(func=_advise)
    finding_cmd = commands.add_parser("finding", help="a finding's upstream-ready report, as a maintainer reads it")
    finding_cmd.add_argument("id", nargs="?", help="the registry entry (leave out: list every entry with a reproducer)")
    finding_cmd.add_argument("--known-issues", metavar="FILE", help="the registry (default: the packaged one)")
    finding_cmd.set_defaults(func=_finding)
    watch_cmd = commands.add_parser(
        "watch", help="the releases on the package index that the matrix does not run yet",
        description="Ask the package index for each framework's releases and for the packages its [releases] watch "
                    "names; list what is newer than the matrix holds and the candidate environment of the newest "
                    "(nox -s release-watch builds and runs them).")
    watch_cmd.add_argument("--pre", action="store_true", help="pre-releases count as new releases too")
    watch_cmd.add_argument("--index", default=None, metavar="URL",
                           help="the index's JSON API (default: https://pypi.org/pypi; a file:// folder of recorded "
                                "answers works)")
    watch_cmd.add_argument("--only", nargs="+", metavar="PACKAGE", help="ask about these packages only")
    watch_cmd.add_argument("--apply", action="store_true",
                           help="write each candidate into its framework file (a new [[environment]], or the pin "
                                "bumped)")
    watch_cmd.add_argument("--json", metavar="FILE", help="write the candidates there (for watch-report)")
    watch_cmd.add_argument("--spec", default=None, metavar="FILE", help="matrix file (default: the packaged one)")
    watch_cmd.set_defaults(func=_watch)
    watched_cmd = commands.add_parser("watch-report", help="what each watched release changed against the published "
                                                           "cells; exit 1 on a regression")
    watched_cmd.add_argument("candidates", help="the file `freezecompat watch --json` wrote")
    watched_cmd.add_argument("published", help="the published matrix.json (the cells of each base environment)")
    watched_cmd.add_argument("ran", help="the report holding the candidates' cells")
    watched_cmd.add_argument("-o", "--output", required=True, help="directory for one page per release")
    watched_cmd.add_argument("--environment", nargs="+", metavar="NAME", help="these candidates' environments only")
    watched_cmd.set_defaults(func=_watch_report)
    args = parser.parse_args(argv)
    from .bisect import BisectError

    try:
        return args.func(args)
    except (schema.ReportError, known_issues.KnownIssueError, BisectError) as exc:
        print(f"freezecompat: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except BrokenPipeError:  # `freezecompat ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
