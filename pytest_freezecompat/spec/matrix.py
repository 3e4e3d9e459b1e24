"""Matrix files -> a validated `Spec`, with errors that name file and line.

A spec is `matrix.toml` (models, their parameter groups, freeze patterns) plus one
`frameworks/<name>.toml` beside it per framework (axes, environment, rules). A
framework file may also define models of its own; a matrix file may also carry
frameworks inline under `[frameworks.<name>]` (handy for a one-file matrix).
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from ..core.declaration import AdapterDeclaration, DeclarationError, load_declaration
from ..core.freeze import FreezePattern, PatternError, parse_rows
from ..core.names import ALL_GROUP, CLIP_VALUES, LATER_AXES, RELEASE_SEPARATOR, VALUE_RE
from .environments import Environment, merge_environment

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SCHEMA = 1
DEVICES = ("cpu", "cuda")
#: `own_round_trip`: why the cells a rule picks keep a round trip of their own where `[round_trip]` would share one.
RULE_EFFECTS = ("skip", "exclude", "emulation", "precision", "options", "known_issue", "own_round_trip")
PRECISIONS = ("fp32", "bf16", "fp16")
ROOT_KEYS = {"schema", "models", "freeze", "frameworks"}
#: How alike (difflib ratio) an unknown model or pattern name and a matrix one must be for the name to be refused
#: as a typo of it rather than taken for a user's `freeze_case` ("tiny-gtp" is refused; "tiny-qwen2-vl" is not).
NEAR_MISS = 0.8


class SpecError(ValueError):
    """A malformed matrix file; the message is one line: `file:line: what is wrong`."""


#: How a rule's `when` names releases: a PEP 440 specifier (`<0.31`) starts with one of these; else a glob.
SPECIFIER_START = ("<", ">", "=", "!", "~")


def release_matches(release: str, pattern: str) -> bool:
    """`release` (a version) against a rule's release value: a specifier such as `<0.31`, or a glob (`0.23.*`)."""
    if pattern.startswith(SPECIFIER_START):
        try:
            return SpecifierSet(pattern).contains(release, prereleases=True)
        except InvalidVersion:  # an unrecorded release ("") is inside no range
            return False
    return fnmatch.fnmatchcase(release, pattern)


def same_release(installed: str, declared: str) -> bool:
    """Whether an installed version is a declared release (`2.7.1+cu126` is `2.7.1`)."""
    try:
        return Version(installed).public == Version(declared).public
    except InvalidVersion:
        return installed == declared


@dataclass(frozen=True)
class Rule:
    when: dict[str, tuple[str, ...]]
    device: str | None
    effects: dict[str, Any]
    where: str


@dataclass(frozen=True)
class Release:
    """One release of a framework and the environment that installs it (`environment` may be ad hoc: `fw@1.2`)."""

    version: str  # "" where the framework file names none (a user's own framework file)
    environment: str


@dataclass(frozen=True)
class Framework:
    name: str
    adapter: str  # the adapter package, whose `DECLARATION` says what it offers
    declaration: AdapterDeclaration
    import_name: str
    axes: dict[str, tuple[str, ...]]  # model, plugin, init, checkpoint, freeze, clip
    #: The releases the matrix runs, newest first: each in its own environment (each pins its torch).
    releases: tuple[Release, ...]
    rules: tuple[Rule, ...]
    where: str
    #: Whether the adapter trains any `nn.Module` a user brings (`freeze_case`), not only its own model.
    user_models: bool = False
    #: The distribution whose version is the release (`mosaicml` for composer, `megatron-core`).
    package: str = ""
    #: Pip requirements (one string a pip call) that build an environment for any release, `{release}` in them
    #: replaced: how `freezecompat bisect` builds the releases between two the matrix runs.
    any_release: tuple[str, ...] = ()
    #: Packages the newest environment pins beside the framework whose new releases the release watch tests there
    #: (`[releases] watch`: transformers for the Hugging Face row, whose Trainer is transformers'), pin bumped in place.
    watched: tuple[str, ...] = ()
    #: Axis -> classes of its values whose cells take one save -> load path (`[round_trip]`): cells that differ only
    #: within a class share one round trip. Measured, not assumed: `benchmarks/round_trip_axes.py` shows the
    #: `resume` result of every group the same across each class in a report.
    round_trip: dict[str, tuple[tuple[str, ...], ...]] = field(default_factory=dict)

    def round_trip_value(self, axis: str, value: str) -> str:
        """The value that stands for `value`'s round-trip class (itself where it shares with none)."""
        return next((shared[0] for shared in self.round_trip.get(axis, ()) if value in shared), value)

    @property
    def environment(self) -> str:
        """The environment of the newest release: where this framework's cells run unless one is named."""
        return self.releases[0].environment

    def release_in(self, environment: str) -> Release | None:
        """The release an environment runs: a declared one, or an ad hoc `<framework>@<version>` (bisect, a user's
        own version)."""
        for release in self.releases:
            if release.environment == environment:
                return release
        name, sep, version = environment.partition(RELEASE_SEPARATOR)
        return Release(version, environment) if sep and name == self.name and version else None


@dataclass(frozen=True)
class Spec:
    path: Path
    models: dict[str, dict[str, tuple[str, ...]]]
    patterns: dict[str, FreezePattern]
    frameworks: dict[str, Framework]
    environments: dict[str, Environment] = field(default_factory=dict)

    def words(self, frameworks: list[str]) -> dict[str, dict[str, str]]:
        """Plain words per axis value for these frameworks: their adapters' plugins, inits and checkpoint modes, and
        every freeze pattern's description; reports show them beside the ids (an environment records its own)."""
        found: dict[str, dict[str, str]] = {"freeze": {pid: p.description for pid, p in self.patterns.items()
                                                       if p.description}}
        for name in frameworks:
            framework = self.frameworks[name]
            for axis in ("plugin", "init", "checkpoint"):
                found.setdefault(axis, {}).update({value: framework.declaration.words[value] for value in
                                                   framework.axes[axis] if value in framework.declaration.words})
        return found

    def values(self, axis: str) -> list[str]:
        """Every value an axis takes in some framework, in first-seen order."""
        if axis == "framework":
            return list(self.frameworks)
        if axis == "release":
            return list(dict.fromkeys(r.version for fw in self.frameworks.values() for r in fw.releases if r.version))
        seen: dict[str, None] = {}
        for fw in self.frameworks.values():
            seen.update(dict.fromkeys(fw.axes[axis]))
        return list(seen)


def default_spec_path() -> Path:
    """The packaged matrix (wheel installs) or, in a source checkout, the repo's `matrix/`."""
    packaged = resources.files("pytest_freezecompat") / "_matrix" / "matrix.toml"
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "matrix" / "matrix.toml"


class _Source:
    """One TOML file and how to point at a line in it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.text = path.read_text()
        except OSError as exc:
            raise SpecError(f"{path}: cannot read matrix file ({exc.strerror})") from None
        try:
            self.data = tomllib.loads(self.text)
        except tomllib.TOMLDecodeError as exc:
            found = re.search(r"\(at line (\d+), column \d+\)", str(exc))
            where = f"{path}:{found.group(1)}" if found else str(path)
            raise SpecError(f"{where}: invalid TOML: {exc}") from None

    def where(self, *needles: str, start: int = 0) -> str:
        """`file:line` of the first line from index `start` on that mentions all needles, else of `start` itself
        (0: the file alone); best effort, for messages."""
        lines = self.text.splitlines()
        for number in range(start, len(lines)):
            if all(n in lines[number] for n in needles):
                return f"{self.path}:{number + 1}"
        return f"{self.path}:{start + 1}" if start else str(self.path)

    def error(self, message: str, *needles: str, start: int = 0) -> SpecError:
        return SpecError(f"{self.where(*needles, start=start)}: {message}")

    def key_line(self, key: str, start: int = 0) -> int:
        """Index of the first line from `start` on that sets `key` (`key =`, bare or quoted, inline tables too), so
        an unknown key is pointed at rather than the first longer key it is part of (`schem` in `schema`); else
        `start` (best effort)."""
        sets = re.compile(rf"(?:^|[\s{{,.]){re.escape(key)}\s*=|[\"']{re.escape(key)}[\"']\s*=")
        lines = self.text.splitlines()
        return next((n for n in range(start, len(lines)) if sets.search(lines[n])), start)

    def header_line(self, *headers: str) -> int:
        """Index of the first line that opens one of these tables (`[freeze.none]`) here (best effort: 0)."""
        return next((n for n, line in enumerate(self.text.splitlines()) if line.strip().startswith(headers)), 0)

    def rule_line(self, framework: str, index: int, table: str = "rule") -> int:
        """Index of the line that opens `framework`'s rule `index` (or another `[[table]]` entry) here (best
        effort: 0), so an error in a rule's `when` points into that rule rather than at the value's first mention
        in the file."""
        headers = [n for n, line in enumerate(self.text.splitlines())
                   if line.strip() in (f"[[{table}]]", f"[[frameworks.{framework}.{table}]]")]
        return headers[index] if index < len(headers) else 0


def unselectable(when: Mapping[str, Sequence[str]], valid: Mapping[str, Sequence[str]],
                 user_models: bool) -> tuple[str, str] | None:
    """(value, `axis 'value' ...`) for the first value or glob in `when` that can select no cell, else None.

    Each value must match one of `valid[axis]`, or its rule (or known issue) silently never applies. Where
    `user_models`, a cell may also be a user's `freeze_case`, whose model and pattern names are unknown when the
    matrix loads: there a `model` or `freeze` value is taken for such a name unless it is a near miss of a valid one.
    """
    for axis, values in when.items():
        for value in values:
            if any(fnmatch.fnmatchcase(v, value) for v in valid[axis]):
                continue
            problem = f"{axis} {value!r} matches none of {listing(valid[axis])}"
            if not user_models or axis not in ("model", "freeze"):
                return value, problem
            near = difflib.get_close_matches(value, valid[axis], n=1, cutoff=NEAR_MISS)
            if near:
                return value, f"{problem}; did you mean {near[0]!r}? (too close to it to be a freeze_case's own name)"
    return None


def listing(values: Sequence[str], limit: int = 12) -> str:
    """`values` for a one-line message, cut after `limit` so a long axis does not swamp the line."""
    shown = ", ".join(values[:limit])
    return shown if len(values) <= limit else f"{shown}, ... ({len(values) - limit} more)"


def did_you_mean(value: str, valid: Sequence[str]) -> str:
    """`; did you mean 'x'?` for the valid name nearest `value` (difflib), else "" (nothing alike)."""
    near = difflib.get_close_matches(value, list(valid), n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


def _reject_unknown_keys(src: _Source, body: dict[str, Any], valid: Sequence[str] | set[str], what: str,
                         start: int = 0, noun: str = "key") -> None:
    """Every key a table may hold is declared: one that is not (a typo, most often) is a one-line error naming
    the table, the key, the keys allowed and the nearest of them, never a key the loader would read past."""
    unknown = sorted(set(body) - set(valid))
    if unknown:
        allowed = sorted(valid)
        raise src.error(f"{what}: unknown {noun} {unknown[0]!r}; valid: {', '.join(allowed) or '(none)'}"
                        f"{did_you_mean(unknown[0], allowed)}", start=src.key_line(unknown[0], start))


def _str_list(src: _Source, value: Any, what: str, *needles: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise src.error(f"{what} must be a string or a list of strings", *needles)
    return tuple(value)


def _axis_values(src: _Source, value: Any, what: str) -> tuple[str, ...]:
    values = _str_list(src, value, what, what.split(".")[-1])
    if not values:
        raise src.error(f"{what} lists no values", what.split(".")[-1])
    for v in values:
        if not VALUE_RE.match(v):
            raise src.error(f"{what}: {v!r} is not a valid axis value (lowercase letters, digits and '-')", v)
    return values


#: `[models.<id>]`: `description` (words for people; nothing reads it) and the `groups` table (group = name globs).
MODEL_KEYS = {"description", "groups"}


def _load_models(src: _Source, table: Any, models: dict[str, dict[str, tuple[str, ...]]]) -> None:
    if not isinstance(table, dict):
        raise src.error("[models] must be a table", "models")
    for name, body in table.items():
        if name in models:
            raise src.error(f"model {name!r} is defined twice", name)
        if isinstance(body, dict):
            _reject_unknown_keys(src, body, MODEL_KEYS, f"models.{name}", start=src.header_line(f"[models.{name}]"))
        groups = body.get("groups") if isinstance(body, dict) else None
        if not isinstance(groups, dict) or not groups:
            raise src.error(f"model {name!r} needs a [models.{name}.groups] table of name globs", name)
        models[name] = {g: _str_list(src, globs, f"models.{name}.groups.{g}", g) for g, globs in groups.items()}


PATTERN_KEYS = {"description", "frozen", "trainable", "optimizer", "unused", "features", "may_refuse", "rows",
                "buffers", "eval"}


def _flag(src: _Source, body: dict[str, Any], key: str, what: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise src.error(f"{what}.{key} must be true or false", key)
    return value


def _rows(src: _Source, body: dict[str, Any], what: str) -> dict[str, str]:
    """`rows = { group = "start:stop" }`: checked here so a malformed range points at its line."""
    table = body.get("rows", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise src.error(f'{what}.rows must be a table of group = "start:stop"', "rows")
    for group, text in table.items():
        try:
            parse_rows(text)
        except PatternError as exc:
            raise src.error(f"{what}.rows.{group}: {exc}", group) from None
    return dict(table)


def _load_patterns(src: _Source, table: Any) -> dict[str, FreezePattern]:
    if not isinstance(table, dict):
        raise src.error("[freeze] must be a table of [freeze.<id>] patterns", "freeze")
    patterns = {}
    for pid, body in table.items():
        if not VALUE_RE.match(pid):
            raise src.error(f"freeze pattern id {pid!r} is not a valid axis value", pid)
        if not isinstance(body, dict):
            raise src.error(f"freeze.{pid} must be a table", pid)
        _reject_unknown_keys(src, body, PATTERN_KEYS, f"freeze.{pid}", start=src.header_line(f"[freeze.{pid}]"))
        if "frozen" in body and "trainable" in body:
            raise src.error(f"freeze.{pid}: give either `frozen` or `trainable`, not both", pid)

        def groups(key: str, pattern_id: str = pid, entry: dict = body) -> tuple[str, ...]:
            return _str_list(src, entry.get(key, []), f"freeze.{pattern_id}.{key}", key)

        patterns[pid] = FreezePattern(
            id=pid, frozen=groups("frozen"),
            trainable=groups("trainable") if "trainable" in body else None,
            optimizer=groups("optimizer") if "optimizer" in body else None,
            unused=groups("unused"), features=groups("features"), description=str(body.get("description", "")),
            may_refuse=_flag(src, body, "may_refuse", f"freeze.{pid}"), rows=_rows(src, body, f"freeze.{pid}"),
            buffers=groups("buffers"), eval=groups("eval"),
        )
    return patterns


FRAMEWORK_KEYS = {"framework", "adapter", "import", "package", "models", "plugins", "init", "checkpoint", "freeze",
                  "clip", "environment", "rule", "user_models", "releases", "round_trip"}
#: The axes whose values may share a round trip: they change how a cell trains, not which stack saves and loads.
ROUND_TRIP_AXES = ("init", "checkpoint", "clip")
ENVIRONMENT_KEYS = {"name", "release", "install", "python", "first_run"}
#: `[releases]`: how `freezecompat bisect` and the release watch install a release the matrix does not run, and the
#: packages beside the framework whose releases the watch tests.
RELEASES_KEYS = {"install", "watch"}
RULE_KEYS = {*RULE_EFFECTS, "when", "device"}
#: An environment's name is a folder's too (`.nox/<name>`, the report's shards): `composer-0.23`.
ENVIRONMENT_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


def _rule_options(src: _Source, fw: str, index: int, adapter: str, declaration: AdapterDeclaration, raw: Any,
                  start: int) -> None:
    """A rule's `options`: only those its framework's adapter reads (`AdapterDeclaration.options`), each of its kind."""
    what = f"{fw} rule {index + 1}: options"
    if not isinstance(raw, dict):
        raise src.error(f"{what} must be a table of option = value", "options", start=start)
    declared = declaration.options
    _reject_unknown_keys(src, raw, declared, f"{what} (adapter {adapter})", start=start)
    for key, value in raw.items():
        kind = declared[key]
        if kind == "bool" and not isinstance(value, bool):
            raise src.error(f"{what}.{key} must be true or false", key, start=start)
        if kind == "globs" and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise src.error(f"{what}.{key} must be a non-empty list of name globs", key, start=start)


def _load_rule(src: _Source, fw: str, index: int, body: Any, axes: dict[str, tuple[str, ...]],
               declaration: AdapterDeclaration, user_models: bool, adapter: str) -> Rule:
    where = f"{src.path}, rule {index + 1}"
    if not isinstance(body, dict):
        raise SpecError(f"{where}: must be a table")
    start = src.rule_line(fw, index)
    _reject_unknown_keys(src, body, RULE_KEYS, f"{fw} rule {index + 1}", start=start)
    when_raw = body.get("when", {})
    if not isinstance(when_raw, dict):
        raise src.error(f"{fw} rule {index + 1}: `when` must be a table of axis = value(s)", "when", start=start)
    valid = {"framework": (fw,), **axes}  # a rule only ever sees this framework's cells
    _reject_unknown_keys(src, when_raw, [*valid, "release"], f"{fw} rule {index + 1}: `when`", start=start,
                         noun="axis")
    when = {}
    for axis, pats in when_raw.items():
        when[axis] = _str_list(src, pats, f"rule.when.{axis}", axis)
        if not when[axis]:
            raise src.error(f"{fw} rule {index + 1}: `when` {axis} lists no values", axis, start=start)
    for pattern in when.get("release", ()):  # releases are not a fixed list (bisect runs any): only the syntax
        if pattern.startswith(SPECIFIER_START):
            try:
                SpecifierSet(pattern)
            except InvalidSpecifier:
                raise src.error(f"{fw} rule {index + 1}: `when` release {pattern!r} is not a version specifier "
                                "(e.g. \"<0.31\") or glob", pattern, start=start) from None
    found = unselectable({k: v for k, v in when.items() if k != "release"}, valid, user_models)
    if found is not None:
        raise src.error(f"{fw} rule {index + 1}: `when` {found[1]}", f'"{found[0]}"', start=start)
    device = body.get("device")
    if device is not None and device not in DEVICES:
        raise src.error(f"{fw} rule {index + 1}: device must be one of {', '.join(DEVICES)}", "device", start=start)
    effects = {k: v for k, v in body.items() if k in RULE_EFFECTS}
    if "options" in effects:
        _rule_options(src, fw, index, adapter, declaration, effects["options"], start)
    if not effects:
        raise src.error(f"{fw} rule {index + 1} has no effect ({', '.join(RULE_EFFECTS)})", "when", start=start)
    if effects.get("emulation") and declaration.emulation is None:
        raise src.error(f"{fw} rule {index + 1}: `emulation = true`, but the adapter declares no shim", "emulation")
    if "precision" in effects and effects["precision"] not in PRECISIONS:
        raise src.error(f"{fw} rule {index + 1}: precision must be one of {', '.join(PRECISIONS)}", "precision")
    if "own_round_trip" in effects and not (isinstance(effects["own_round_trip"], str)
                                            and effects["own_round_trip"].strip()):
        raise src.error(f"{fw} rule {index + 1}: own_round_trip is the reason, a non-empty string", "own_round_trip")
    return Rule(when, device, effects, where)


def _load_environments(src: _Source, fw: str, raw: Any) -> tuple[list[Environment], tuple[Release, ...]]:
    """`[environment]` (one release) or `[[environment]]` (several, newest first): each a name, the framework
    `release` it installs, and its pins."""
    tables = raw if isinstance(raw, list) else [raw]
    for index, table in enumerate(tables):  # before `name` is required, so a misspelt `name` is named as such
        if isinstance(table, dict):
            label = table["name"] if isinstance(table.get("name"), str) else f"#{index + 1}"
            _reject_unknown_keys(src, table, ENVIRONMENT_KEYS, f"framework {fw} environment {label}",
                                 start=src.rule_line(fw, index, "environment") if isinstance(raw, list) else
                                 src.header_line("[environment]", f"[frameworks.{fw}.environment]"))
    if not tables or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tables):
        raise src.error(f"framework {fw}: each [environment] needs `name`", "environment")
    environments, releases = [], []
    for table in tables:
        if not ENVIRONMENT_NAME_RE.match(table["name"]):
            raise src.error(f"framework {fw}: environment name {table['name']!r} is not lowercase letters, digits, "
                            "'.', '-'", table["name"])
        version = table.get("release", "")
        if len(tables) > 1 and not version:
            raise src.error(f"framework {fw}: environment {table['name']!r} needs `release` (several are named)",
                            table["name"])
        try:
            Version(str(version)) if version else None
        except InvalidVersion:
            raise src.error(f"framework {fw}: environment {table['name']!r}: release {version!r} is not a version",
                            str(version)) from None
        if table["name"] in (e.name for e in environments) or version in (r.version for r in releases if version):
            raise src.error(f"framework {fw}: environment {table['name']!r} or its release is named twice",
                            table["name"])
        first = table.get("first_run", True)
        if not isinstance(first, bool):
            raise src.error(f"framework {fw}: environment {table['name']!r}: first_run is true or false", "first_run")
        python = table.get("python", "")
        if not isinstance(python, str) or (python and not re.match(r"^3\.\d+$", python)):
            raise src.error(f"framework {fw}: environment {table['name']!r}: python {python!r} is not 3.<minor>",
                            "python")
        environments.append(Environment(table["name"], _str_list(src, table.get("install", []),
                                                                 "environment.install", "install"), (fw,), python,
                                        first))
        releases.append(Release(str(version), table["name"]))
    return environments, tuple(releases)


def _load_framework(src: _Source, body: dict[str, Any], name_hint: str | None
                    ) -> tuple[Framework, list[Environment]]:
    name = body.get("framework", name_hint)
    if not isinstance(name, str) or not VALUE_RE.match(name):
        raise src.error("`framework = \"<name>\"` is missing or not a valid axis value", "framework")
    _reject_unknown_keys(src, body, FRAMEWORK_KEYS, f"framework {name}")
    for key in ("adapter", "plugins", "init", "checkpoint", "freeze", "models"):
        if key not in body:
            raise src.error(f"framework {name}: `{key}` is missing", "framework")
    axes = {"model": _axis_values(src, body["models"], f"{name}.models"),
            "plugin": _axis_values(src, body["plugins"], f"{name}.plugins"),
            "init": _axis_values(src, body["init"], f"{name}.init"),
            "checkpoint": _axis_values(src, body["checkpoint"], f"{name}.checkpoint"),
            "freeze": _axis_values(src, body["freeze"], f"{name}.freeze"),
            # Optional: a framework file that does not say clips every cell, as every cell did before the axis.
            "clip": _axis_values(src, body.get("clip", [LATER_AXES["clip"]]), f"{name}.clip")}
    unknown_clip = [v for v in axes["clip"] if v not in CLIP_VALUES]
    if unknown_clip:
        raise src.error(f"framework {name}: clip {unknown_clip[0]!r} is not one of {', '.join(CLIP_VALUES)}",
                        unknown_clip[0])
    adapter = str(body["adapter"])
    try:
        declaration = load_declaration(adapter)
    except DeclarationError as exc:
        raise src.error(f"framework {name}: {exc}", "adapter") from None
    for axis in ("plugin", "init", "checkpoint"):
        unknown = [v for v in axes[axis] if v not in declaration.offers(axis)]
        if unknown:
            raise src.error(f"framework {name}: {axis} {unknown[0]!r} is not offered by adapter {adapter}; "
                            f"valid: {', '.join(declaration.offers(axis))}", unknown[0])
    environments, releases = _load_environments(src, name, body.get("environment", {"name": name}))
    any_release = body.get("releases", {})
    if not isinstance(any_release, dict):
        raise src.error(f"framework {name}: [releases] is a table: install = [...]", "releases")
    _reject_unknown_keys(src, any_release, RELEASES_KEYS, f"framework {name}: [releases]",
                         start=src.header_line("[releases]", f"[frameworks.{name}.releases]"))
    any_install = _str_list(src, any_release.get("install", []), "releases.install", "install")
    if any_install and not any("{release}" in line for line in any_install):
        raise src.error(f"framework {name}: [releases] install names no {{release}}", "install")
    watched = _str_list(src, any_release.get("watch", []), "releases.watch", "watch")
    newest_pins = " ".join(environments[0].install) if environments else ""
    for package in watched:
        if not re.search(rf"(?<![\w.-]){re.escape(package)}==", newest_pins):
            raise src.error(f"framework {name}: [releases] watch names {package!r}, which its newest environment does "
                            f"not pin as {package}==<version>", "watch")
    round_trip = _load_round_trip(src, name, body.get("round_trip", {}), axes)
    rules = body.get("rule", [])
    if not isinstance(rules, list):
        raise src.error(f"framework {name}: rules are written [[rule]]", "rule")
    user_models = body.get("user_models", False)
    if not isinstance(user_models, bool):
        raise src.error(f"framework {name}: user_models must be true or false", "user_models")
    framework = Framework(
        name=name, adapter=adapter, declaration=declaration, import_name=str(body.get("import", name)), axes=axes,
        releases=releases,
        rules=tuple(_load_rule(src, name, i, r, axes, declaration, user_models, adapter)
                    for i, r in enumerate(rules)),
        where=src.where("framework"), user_models=user_models, package=str(body.get("package", name)),
        any_release=any_install, watched=tuple(watched), round_trip=round_trip,
    )
    return framework, environments


def _load_round_trip(src: _Source, fw: str, table: Any, axes: dict[str, tuple[str, ...]]
                     ) -> dict[str, tuple[tuple[str, ...], ...]]:
    """`[round_trip]`: axis = [[value, value, ...], ...], disjoint classes of the framework's own values."""
    if not isinstance(table, dict):
        raise src.error(f"framework {fw}: [round_trip] is a table of axis = [[value, ...], ...]", "round_trip")
    classes: dict[str, tuple[tuple[str, ...], ...]] = {}
    for axis in table:
        if axis in axes and axis not in ROUND_TRIP_AXES:
            raise src.error(f"framework {fw}: round_trip.{axis}: only {', '.join(ROUND_TRIP_AXES)} may share a "
                            "round trip", "round_trip")
    _reject_unknown_keys(src, table, ROUND_TRIP_AXES, f"framework {fw}: [round_trip]",
                         start=src.header_line("[round_trip]", f"[frameworks.{fw}.round_trip]"), noun="axis")
    for axis, raw in table.items():
        if not isinstance(raw, list) or not all(isinstance(c, list) and len(c) > 1 for c in raw):
            raise src.error(f"framework {fw}: round_trip.{axis} is a list of lists of two or more values",
                            "round_trip")
        seen: set[str] = set()
        for value in (v for shared in raw for v in shared):
            if value not in axes[axis]:
                raise src.error(f"framework {fw}: round_trip.{axis}: {value!r} is not one of its {axis} values "
                                f"({', '.join(axes[axis])})", "round_trip")
            if value in seen:
                raise src.error(f"framework {fw}: round_trip.{axis}: {value!r} is in two classes", "round_trip")
            seen.add(value)
        classes[axis] = tuple(tuple(str(v) for v in shared) for shared in raw)
    return classes


def load(path: str | Path | None = None) -> Spec:
    """Load and cross-check a matrix; every problem is a one-line `SpecError`."""
    root = _Source(Path(path) if path else default_spec_path())
    if root.data.get("schema", SCHEMA) != SCHEMA:
        raise root.error(f"schema {root.data.get('schema')!r} is not supported (this plugin reads {SCHEMA})", "schema")
    if "rule" in root.data:  # would apply to no framework, silently
        raise root.error("a top-level [[rule]] belongs to no framework; write [[frameworks.<name>.rule]] here, "
                         "or [[rule]] in frameworks/<name>.toml", "[[rule]]")
    _reject_unknown_keys(root, root.data, ROOT_KEYS, "matrix")
    models: dict[str, dict[str, tuple[str, ...]]] = {}
    _load_models(root, root.data.get("models", {}), models)
    patterns = _load_patterns(root, root.data.get("freeze", {}))
    frameworks: dict[str, Framework] = {}
    environments: dict[str, Environment] = {}
    sources: dict[str, _Source] = {}

    def add(src: _Source, body: dict[str, Any], hint: str | None) -> None:
        framework, envs = _load_framework(src, body, hint)
        if framework.name in frameworks:
            first = frameworks[framework.name].where
            raise src.error(f"framework {framework.name!r} is defined twice (also at {first})", "framework")
        frameworks[framework.name] = framework
        sources[framework.name] = src
        for env in envs:
            merge_environment(environments, env)

    inline = root.data.get("frameworks", {})
    if not isinstance(inline, dict) or not all(isinstance(body, dict) for body in inline.values()):
        raise root.error("[frameworks] is a table of [frameworks.<name>] tables", "frameworks")
    for name, body in inline.items():
        add(root, body, name)
    for file in sorted((root.path.parent / "frameworks").glob("*.toml")):
        src = _Source(file)
        own = src.data.get("models")
        if isinstance(own, dict):
            # `[models.<id>.groups]` in a framework file defines a model of its own and makes it
            # an axis value; an empty `[models.<id>]` names a shared model.
            _load_models(src, {k: v for k, v in own.items() if v}, models)
            src.data["models"] = list(own)
        add(src, src.data, file.stem)
    if not frameworks:
        raise root.error("the matrix defines no framework (frameworks/*.toml beside it, or [frameworks.<name>])")
    for fw in frameworks.values():
        src = sources[fw.name]
        for pid in fw.axes["freeze"]:
            if pid not in patterns:
                raise src.error(f"framework {fw.name}: freeze pattern {pid!r} is not defined; known: "
                                f"{', '.join(patterns)}", pid)
        for model in fw.axes["model"]:
            if model not in models:
                raise src.error(f"framework {fw.name}: model {model!r} is not defined; known: {', '.join(models)}",
                                model)
            for pid in fw.axes["freeze"]:
                pattern = patterns[pid]
                for group in (*pattern.frozen, *(pattern.trainable or ()), *(pattern.optimizer or ()), *pattern.unused,
                              *pattern.rows):
                    if group != ALL_GROUP and group not in models[model]:
                        raise src.error(f"freeze pattern {pid!r} names group {group!r}, which model {model!r} "
                                        f"does not define", pid)
    return Spec(root.path, models, patterns, frameworks, environments)
