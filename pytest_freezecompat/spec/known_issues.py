"""The known-issue registry (`matrix/known_issues.toml`): upstream bugs the matrix reproduces, by cell.

An entry selects cells (axes with globs, as in the `when` of matrix rules; a list of such tables
selects their union), names the versions it applies to, and says which failures it explains: raw
statuses, optionally the failed check, the failure's facts or the stack's own words (`selectors`), and what
the failure must look like (`predicts`), so an entry explains the cells it selects rather than absorbing every
red one. Our verdict messages are never read: they can be reworded without unexplaining a cell.
A cell whose failure an entry explains keeps its raw status and is shown as `known` (an xfail in
pytest); a cell an entry expects to break that passes is `fixed?` (a strict xpass), so an entry
that has gone stale is noticed the morning the fix ships. Everything here is
pure: the runner calls `match` per cell, `freezecompat merge --known-issues` calls `annotate`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..core.names import CHECKS, KEY_AXES, KIND_WORDS, USER_AXES, VALUE_RE
from ..core.records import FAILING
from . import selectors
from .matrix import DEVICES, Framework, Spec, default_spec_path, listing, tomllib, unselectable

#: What a selector may name: the cell's key axes, and the device of its environment. Not the release: an entry's
#: `versions` says which releases it applies to, and the runs check that range.
SELECTOR_AXES = tuple(axis for axis in KEY_AXES if axis != "release")
SELECTOR_KEYS = (*SELECTOR_AXES, "device")
REQUIRED = ("id", "summary", "links", "when", "versions", "status")
#: At least one of `selectors.FIELDS` (kinds, params, pattern) says which failure an entry explains.
#: Where a mechanism may exist only on this project's CPU runs: the gloo backend, or CPU tensors/devices.
ONLY_ON = ("gloo", "cpu")
OPTIONAL = (*selectors.FIELDS, "check", "predicts", "fixed_in", "kind", "reproducer", "workarounds", "no_workaround",
            "only_on", "about_freezing")
#: What a workaround may change of a cell it explains: the user keeps their model and framework; `freeze` names a
#: pattern that applies a recipe (e.g. the idle branch frozen), which the matrix runs like any other.
WORKAROUND_AXES = ("checkpoint", "clip", "freeze", "init", "plugin")
#: What an entry is, as a maintainer would triage it: an upstream report (its thread is the first link); a **finding**
#: of this matrix, a defect of a current release that no upstream thread describes yet (its summary states the
#: mechanism from the framework's source, file and function, and it ships a standalone reproducer,
#: `findings/<id>.py`, the framework alone, that a test runs); behaviour the maintainers chose (`by-design`: its
#: links say where, its summary the harm it still does and what we would ask); or an unsupported use that fails
#: loudly (`misuse`: its summary names the supported way and the clearer error we would ask for).
KINDS = ("upstream", *KIND_WORDS)
REPRODUCER_RE = re.compile(r"^findings/[a-z0-9][a-z0-9-]*\.py$")
#: What an entry may predict of the failures it explains, and the values each prediction takes:
#:   raised_in      error/crash/timeout: "wrapping" (before the first step) or "training"
#:   params         fail: what the failed check's params are: "held" by the pattern (frozen, or left out
#:                  of the optimizer), "no-grad" (trainable, but the reference gives them no grad), "trained"
#:   scale          fail (grads): every differing grad is this multiple of the reference's ("world_size")
#:   ranks_combine  fail (grad_norm): the ranks' own norms combine to the reference's ("l2": shard norms)
PREDICTIONS = {"raised_in": ("wrapping", "training"), "params": ("held", "no-grad", "trained"),
               "scale": ("world_size",), "ranks_combine": ("l2",)}
FILE_NAME = "known_issues.toml"


@dataclass(frozen=True)
class Workaround:
    """Another value of one or more axes (`WORKAROUND_AXES`) and what that means in the user's code (`says`)."""

    change: dict[str, str]
    says: str

    def describe(self) -> dict[str, Any]:
        return {"change": dict(self.change), "says": self.says}


class KnownIssueError(ValueError):
    """A malformed registry or a reference to an entry it lacks; one line naming file, entry and field."""


@dataclass(frozen=True)
class Entry:
    id: str
    summary: str
    links: tuple[str, ...]
    when: tuple[dict[str, tuple[str, ...]], ...]  # alternatives: a cell is selected by any one
    versions: dict[str, SpecifierSet]
    statuses: tuple[str, ...]
    #: The failure it explains: its kinds and params, or the stack's own words (`selectors`).
    failure: selectors.FailureSelector
    check: str | None
    predicts: dict[str, str]
    #: The release that fixed it, per package (`{"composer": "0.24.0"}`): outside `versions`, and the matrix runs a
    #: release on each side, so the fix is shown by runs, not only stated.
    fixed_in: dict[str, str] = dataclasses.field(default_factory=dict)
    kind: str = "upstream"
    #: A finding's standalone script, relative to the repository root (`findings/<id>.py`).
    reproducer: str | None = None
    #: What to do instead, each proved (or not) by the cell it leads to: `advice.workarounds` checks them.
    workarounds: tuple[Workaround, ...] = ()
    #: Why no workaround is known (an entry with neither this, workarounds nor fixed_in is incomplete).
    no_workaround: str | None = None
    #: Where the mechanism exists only on our CPU runs: {backend = "gloo" | "cpu", elsewhere = "what a GPU/NCCL run
    #: sees, and whether it ran"}. Every format says so beside the entry and its "instead".
    only_on: dict[str, str] = dataclasses.field(default_factory=dict)
    #: False where the failure does not need anything frozen (the nothing-frozen control fails alike): every format
    #: says so, and `report.grid.framing_problem` flags the entry where its cells' controls disagree.
    about_freezing: bool = True

    def selects(self, cell: dict[str, Any], environment: dict[str, Any]) -> bool:
        """A user's cell is selected by the stack alone (framework, plugin, init, checkpoint, device): its model
        and pattern names are its own, so what the entry explains (status, check, message, predictions) decides."""
        return self.closeness(cell, environment) is not None

    def closeness(self, cell: dict[str, Any], environment: dict[str, Any]) -> tuple[bool, int] | None:
        """None if the entry does not select the cell, else how closely: whether a selector names the cell's model
        and pattern too, then how many stack axes it names (a user cell's entries are tried closest first)."""
        fields = {**{axis: str(cell.get(axis, "")) for axis in SELECTOR_AXES},
                  "device": str(environment.get("device", ""))}

        def holds(keys: Iterable[str], when: dict[str, tuple[str, ...]]) -> bool:
            return all(any(fnmatch.fnmatchcase(fields[key], pat) for pat in when[key]) for key in keys)

        found = []
        for when in self.when:
            stack = [key for key in when if key not in USER_AXES]
            whole = holds(when, when)
            if whole or (cell.get("user_model") and holds(stack, when)):
                found.append((whole, len(stack)))
        return max(found) if found else None

    def applies_to(self, environment: dict[str, Any]) -> bool:
        """True when every named package's version in this environment is inside the entry's specifiers."""
        for name, specifiers in self.versions.items():
            found = _version(name, environment)
            if found is None or not specifiers.contains(found, prereleases=True):
                return False
        return True

    def outside_range(self, environment: dict[str, Any]) -> bool:
        """True when every named package's version here is known and one is outside the entry's specifiers."""
        known = all(_version(name, environment) is not None for name in self.versions)
        return known and not self.applies_to(environment)

    def explains(self, cell: dict[str, Any]) -> bool:
        if cell["status"] not in self.statuses or (self.check and cell.get("check") != self.check):
            return False
        return self.failure.holds(cell, selectors.judged_failure(cell, self.check)) and self.predicted(cell)

    def predicted(self, cell: dict[str, Any]) -> bool:
        """Whether the cell's failure looks as this entry says it must (each prediction that applies to it)."""
        if cell["status"] != "fail":
            return "raised_in" not in self.predicts or cell.get("raised_in") == self.predicts["raised_in"]
        failure = selectors.judged_failure(cell, self.check)
        if "params" in self.predicts and failure.get("params_kind") != self.predicts["params"]:
            return False
        if "scale" in self.predicts and failure.get("scale") != float(cell.get("world_size", 0)):
            return False
        return "ranks_combine" not in self.predicts or failure.get("ranks_combine") == self.predicts["ranks_combine"]

    def describe(self) -> dict[str, Any]:
        described = {"id": self.id, "links": list(self.links), "summary": self.summary,
                     "versions": {name: str(spec) for name, spec in self.versions.items()}}
        optional = {"link": self.links[0] if self.links else None, "fixed_in": dict(self.fixed_in),
                    "kind": self.kind if self.kind != "upstream" else None, "reproducer": self.reproducer,
                    "workarounds": [workaround.describe() for workaround in self.workarounds],
                    "no_workaround": self.no_workaround, "only_on": dict(self.only_on)}
        described.update({key: value for key, value in optional.items() if value})
        return described if self.about_freezing else {**described, "about_freezing": False}


@dataclass(frozen=True)
class Registry:
    path: Path
    entries: tuple[Entry, ...]

    def get(self, issue_id: str) -> Entry:
        for entry in self.entries:
            if entry.id == issue_id:
                return entry
        raise KnownIssueError(f"{self.path}: entry {issue_id}: field id: no such entry (named by a matrix rule)")

    def require(self, ids: Iterable[str]) -> None:
        """Fail early (at plan time) if a matrix rule names an id the registry lacks."""
        for issue_id in sorted(set(ids)):
            self.get(issue_id)

    def check_against(self, spec: Spec) -> None:
        """Refuse a selector value or version package that names nothing in `spec`: its entry would never apply."""
        for entry in self.entries:
            _check_entry(self.path, entry, spec)


def default_path() -> Path:
    """The registry beside the default matrix (packaged with it, or the repo's `matrix/`)."""
    return default_spec_path().parent / FILE_NAME


def _version(name: str, environment: dict[str, Any]) -> Version | None:
    raw = environment.get(name) if name in ("python", "torch") else environment.get("frameworks", {}).get(name)
    try:
        return Version(str(raw)) if raw else None
    except InvalidVersion:
        return None


def _check_entry(path: Path, entry: Entry, spec: Spec) -> None:
    """Each selector value must be one of the selected frameworks' (all, if it names none): else it selects nothing."""

    def error(field: str, what: str) -> KnownIssueError:
        return KnownIssueError(f"{path}: entry {entry.id}: field {field}: {what}")

    packages = ["python", *dict.fromkeys(["torch", *spec.frameworks])]  # what `_version` can find
    unknown = sorted(set(entry.versions) - set(packages))
    if unknown:
        raise error("versions", f"{unknown[0]!r} is not a version a report records; valid: {listing(packages)}")
    def chosen(when: dict[str, tuple[str, ...]]) -> list[Framework]:
        names = when.get("framework", ("*",))
        return [fw for fw in spec.frameworks.values() if any(fnmatch.fnmatchcase(fw.name, p) for p in names)]

    selected = list({fw.name: fw for when in entry.when for fw in chosen(when)}.values())
    for workaround in entry.workarounds:  # a value no selected framework has would never lead to a cell
        for axis, value in workaround.change.items():
            held = list(dict.fromkeys(v for fw in selected for v in fw.axes[axis]))
            if value not in held:
                raise error("workarounds", f"{axis} {value!r} is no value of the entry's frameworks; valid: "
                                           f"{listing(held)}")
    for when in entry.when:
        frameworks = chosen(when)
        valid = {"framework": list(spec.frameworks),
                 **{axis: list(dict.fromkeys(v for fw in frameworks for v in fw.axes[axis])) for axis in SELECTOR_AXES
                    if axis != "framework"}}
        axes = sorted((k for k in when if k != "device"), key=lambda k: k != "framework")  # framework says the rest
        found = unselectable({k: when[k] for k in axes}, valid, any(fw.user_models for fw in frameworks))
        if found is not None:
            raise error("when", found[1])


def _strings(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    return None


def _entry(path: Path, index: int, body: Any, seen: dict[str, int]) -> Entry:
    name = body.get("id") if isinstance(body, dict) and isinstance(body.get("id"), str) else f"#{index + 1}"

    def error(field: str, what: str) -> KnownIssueError:
        return KnownIssueError(f"{path}: entry {name}: field {field}: {what}")

    if not isinstance(body, dict):
        raise error("-", "an entry is a table ([[issue]])")
    for field in REQUIRED:
        if field not in body:
            raise error(field, "missing")
    for field in body:
        if field not in REQUIRED and field not in OPTIONAL:
            raise error(field, f"unknown field; valid: {', '.join(REQUIRED + OPTIONAL)}")
    if not isinstance(body["id"], str) or not VALUE_RE.match(body["id"]):
        raise error("id", "must be lowercase letters, digits and '-'")
    if body["id"] in seen:
        raise error("id", f"duplicate of entry #{seen[body['id']] + 1}")
    if not isinstance(body["summary"], str) or not body["summary"].strip():
        raise error("summary", "must be a non-empty string")
    kind = body.get("kind", "upstream")
    if kind not in KINDS:
        raise error("kind", f"must be one of {', '.join(KINDS)}, not {kind!r}")
    reproducer = body.get("reproducer")
    if kind == "finding" and reproducer is None:
        raise error("reproducer", "a finding ships a standalone reproducer: findings/<id>.py")
    if reproducer is not None and (not isinstance(reproducer, str) or not REPRODUCER_RE.match(reproducer)):
        raise error("reproducer", "must be a path findings/<name>.py (lowercase, digits, '-')")
    # A finding or a misuse may have no thread (related ones may be linked); an upstream entry names its thread
    # first, a by-design one where the maintainers chose it.
    unthreaded = kind in ("finding", "misuse")
    links = () if unthreaded and body["links"] == [] else _strings(body["links"])
    if links is None or not all(link.startswith("https://") for link in links):
        raise error("links", "must be a non-empty list of https:// URLs" + (f" (or [] for a {kind})"
                                                                            if unthreaded else ""))
    tables = body["when"] if isinstance(body["when"], list) else [body["when"]]
    if not tables or not all(isinstance(sel, dict) and sel for sel in tables):
        raise error("when", "must be a non-empty table of axis = value(s), or a list of such tables")
    when = []
    for selector in tables:
        for key, pats in selector.items():
            if key not in SELECTOR_KEYS:
                raise error("when", f"unknown axis {key!r}; valid: {', '.join(SELECTOR_KEYS)}")
            if _strings(pats) is None:
                raise error("when", f"{key} must be a string or a non-empty list of strings")
            found = unselectable({key: _strings(pats)}, {key: DEVICES}, False) if key == "device" else None
            if found is not None:  # the other axes need the spec: `Registry.check_against`
                raise error("when", found[1])
        when.append({key: _strings(pats) for key, pats in selector.items()})
    if not isinstance(body["versions"], dict) or not body["versions"]:
        raise error("versions", "must be a non-empty table of package = \"specifier\"")
    versions = {}
    for package, text in body["versions"].items():
        try:
            versions[package] = SpecifierSet(text)
        except (InvalidSpecifier, TypeError):
            raise error("versions", f"{package}: {text!r} is not a version specifier (e.g. \">=2.4\")") from None
    statuses = _strings(body["status"])
    if statuses is None or not set(statuses) <= set(FAILING):
        raise error("status", f"must be one or more of {', '.join(FAILING)}")
    check = body.get("check")
    if check is not None and check not in CHECKS:
        raise error("check", f"must be one of {', '.join(CHECKS)}")
    failure = selectors.parse(body, check, statuses, error)
    if body.get("params") in PREDICTIONS["params"]:  # what the params are, written where their names go
        raise error("params", f"{body['params']!r} is a prediction, not a regex over the failure's param names: "
                              f"write predicts = {{ params = \"{body['params']}\" }}")
    predicts = body.get("predicts", {})
    if not isinstance(predicts, dict):
        raise error("predicts", f"must be a table of {', '.join(PREDICTIONS)}")
    for key, value in predicts.items():
        if key not in PREDICTIONS:
            raise error("predicts", f"unknown prediction {key!r}; valid: {', '.join(PREDICTIONS)}")
        if value not in PREDICTIONS[key]:
            raise error("predicts", f"{key} must be one of {', '.join(PREDICTIONS[key])}, not {value!r}")
    fixed_in = body.get("fixed_in", {})
    if not isinstance(fixed_in, dict) or not all(isinstance(v, str) for v in fixed_in.values()):
        raise error("fixed_in", "must be a table of package = \"release\"")
    for package, release in fixed_in.items():
        if package not in versions:
            raise error("fixed_in", f"{package}: not among the entry's versions ({', '.join(versions)})")
        try:
            inside = versions[package].contains(Version(release), prereleases=True)
        except InvalidVersion:
            raise error("fixed_in", f"{package}: {release!r} is not a version") from None
        if inside:
            raise error("fixed_in", f"{package} {release} is inside the entry's own range {versions[package]}")
    workarounds = _workarounds(body.get("workarounds", []), error)
    no_workaround = body.get("no_workaround")
    if no_workaround is not None and (not isinstance(no_workaround, str) or not no_workaround.strip()):
        raise error("no_workaround", "must say why no workaround is known (a non-empty string)")
    if no_workaround is not None and workarounds:
        raise error("no_workaround", "the entry lists workarounds: drop one of the two")
    only_on = body.get("only_on", {})
    if only_on and (not isinstance(only_on, dict) or set(only_on) != {"backend", "elsewhere"}
                    or only_on["backend"] not in ONLY_ON or not str(only_on["elsewhere"]).strip()):
        raise error("only_on", f"must be {{ backend = {' | '.join(repr(b) for b in ONLY_ON)}, elsewhere = \"what a "
                               "GPU/NCCL run sees\" }")
    about_freezing = body.get("about_freezing", True)
    if not isinstance(about_freezing, bool):
        raise error("about_freezing", "must be true or false (false: the nothing-frozen control fails alike)")
    seen[body["id"]] = index
    return Entry(body["id"], body["summary"].strip(), links, tuple(when), versions, statuses, failure, check,
                 dict(predicts), dict(fixed_in), kind, reproducer, workarounds,
                 no_workaround.strip() if no_workaround else None, dict(only_on), about_freezing)


def _workarounds(raw: Any, error: Any) -> tuple[Workaround, ...]:
    """`[{ change = { plugin = "fsdp2" }, says = "..." }, ...]`, checked field by field."""
    shape = 'a list of { change = { axis = "value" }, says = "what the user does" }'
    if not isinstance(raw, list):
        raise error("workarounds", f"must be {shape}")
    found = []
    for item in raw:
        if not isinstance(item, dict) or set(item) != {"change", "says"}:
            raise error("workarounds", f"must be {shape}")
        change, says = item["change"], item["says"]
        if not isinstance(change, dict) or not change or not all(isinstance(v, str) for v in change.values()):
            raise error("workarounds", f"change must be a non-empty table of axis = \"value\" ({shape})")
        unknown = sorted(set(change) - set(WORKAROUND_AXES))
        if unknown:
            raise error("workarounds", f"cannot change {unknown[0]!r}; valid: {', '.join(WORKAROUND_AXES)} "
                                       "(a release is fixed_in)")
        if not isinstance(says, str) or not says.strip():
            raise error("workarounds", "says must tell the user what to do (a non-empty string)")
        found.append(Workaround(dict(change), says.strip()))
    return tuple(found)


def load(path: str | Path | None = None) -> Registry:
    """Read and validate a registry; every problem is a one-line `KnownIssueError`."""
    path = Path(path) if path else default_path()
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise KnownIssueError(f"{path}: cannot read known-issue registry ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise KnownIssueError(f"{path}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - {"issue"})
    if unknown:
        raise KnownIssueError(f"{path}: unknown top-level key {unknown[0]!r}; entries are written [[issue]]")
    issues = data.get("issue", [])
    if not isinstance(issues, list):
        raise KnownIssueError(f"{path}: entries are written [[issue]]")
    seen: dict[str, int] = {}
    return Registry(path, tuple(_entry(path, i, body, seen) for i, body in enumerate(issues)))


def match(cell: dict[str, Any], environment: dict[str, Any], registry: Registry) -> dict[str, Any] | None:
    """The `known_issue` field for a cell record, or None.

    - a `skip` cell whose matrix rule named an entry (`rule_known_issue`): that entry's id, link, summary;
    - a failing cell (fail/error/crash/timeout) an applicable entry explains: `expected: True` (shown `known`);
    - a passing cell an applicable entry selects: `fixed: True` (shown `fixed?`);
    - a failing cell an entry would explain but for its `versions`: `range_too_narrow: True` (still red: the
      entry's range is wrong, or the cell fails for another reason that looks alike);
    - anything else: None (a failure nobody explains stays red).
    An entry named by a rule is tried first on a failure, whatever its own selector says; a pass is `fixed?`
    only for an entry whose own selector names the cell (a rule may name an entry for a wider set of cells).
    Only a rule names an entry: a previous annotation (`known_issue`) never does, so re-matching a report
    against a changed registry gives what a fresh run would.
    """
    named = cell.get("rule_known_issue")
    if named is None and cell["status"] == "skip":  # reports written before the field: a skip's entry is a rule's
        named = (cell.get("known_issue") or {}).get("id")
    if cell["status"] == "skip":
        return registry.get(named).describe() if named else None
    selecting = [e for e in registry.entries if e.selects(cell, environment) and e.applies_to(environment)]
    if cell.get("user_model"):  # stable: among equally close entries the registry's order holds
        selecting.sort(key=lambda entry: entry.closeness(cell, environment), reverse=True)
    if cell["status"] == "pass":  # a user's pattern may well be one the issue leaves alone: never `fixed?`
        return {**selecting[0].describe(), "fixed": True} if selecting and not cell.get("user_model") else None
    first = registry.get(named) if named else None
    if first is not None and first.applies_to(environment) and first.explains(cell):
        return {**first.describe(), "expected": True}
    for entry in selecting:
        if entry.explains(cell):
            return {**entry.describe(), "expected": True}
    for entry in registry.entries:  # the failure an entry describes, on a release its range leaves out
        if entry.selects(cell, environment) and entry.outside_range(environment) and entry.explains(cell):
            return {**entry.describe(), "range_too_narrow": True}
    return None


def annotate_cell(cell: dict[str, Any], environment: dict[str, Any], registry: Registry) -> None:
    """Tie one report row to the entry that explains it, in place (its raw status never changes)."""
    found = match(cell, environment, registry)
    if found is None:
        cell.pop("known_issue", None)
    else:
        cell["known_issue"] = found


def annotate(report: dict[str, Any], registry: Registry) -> dict[str, Any]:
    """Re-match every cell of a report against `registry` (in place; returns the report)."""
    for cell in report["cells"]:
        annotate_cell(cell, report["environments"].get(cell["environment"], {}), registry)
    return report
