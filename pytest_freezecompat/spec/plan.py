"""Spec + selection + where we run -> the cells of this run, each with its skip reason decided here.

Planning is pure: it never imports a framework (only asks whether one is importable),
so `--collect-only` is fast and every skip is known before any rank starts.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.metadata
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.cell import Cell, CellKey, Hyper, UserModel
from ..core.freeze import FreezePattern
from ..core.names import KEY_AXES, LATER_AXES, USER_AXES
from .matrix import Framework, Release, Rule, Spec, release_matches, same_release


class SelectionError(ValueError):
    """A bad `--freeze-matrix-select`; one line that lists what is valid."""


@dataclass(frozen=True)
class Selection:
    """Exact axis values to keep; several values of one axis are alternatives."""

    values: dict[str, frozenset[str]]

    @classmethod
    def parse(cls, text: str, spec: Spec) -> Selection:
        """Axes and values checked against the spec, except values of `USER_AXES` the spec lacks: a user case
        may name them (`unknown_to` checks those once every case is collected)."""
        values: dict[str, set[str]] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            axis, sep, value = item.partition("=")
            axis, value = axis.strip(), value.strip()
            if not sep or not value:
                raise SelectionError(f"--freeze-matrix-select: {item!r} is not axis=value (e.g. framework=torch)")
            if axis not in KEY_AXES:
                raise SelectionError(f"--freeze-matrix-select: unknown axis {axis!r}; valid: {', '.join(KEY_AXES)}")
            valid = spec.values(axis)
            if value not in valid and axis not in (*USER_AXES, "release"):  # any release may be run (bisect)
                raise SelectionError(f"--freeze-matrix-select: unknown {axis} {value!r}; valid: {', '.join(valid)}")
            values.setdefault(axis, set()).add(value)
        return cls({axis: frozenset(v) for axis, v in values.items()})

    def unknown_to(self, spec: Spec, user_values: dict[str, set[str]]) -> str | None:
        """The usage error for a selected model or pattern that neither the spec nor any collected case has."""
        for axis in USER_AXES:
            valid = [*spec.values(axis), *sorted(user_values.get(axis, set()) - set(spec.values(axis)))]
            for value in sorted(self.values.get(axis, frozenset()) - set(valid)):
                return f"--freeze-matrix-select: unknown {axis} {value!r}; valid: {', '.join(valid)}"
        return None

    def keeps(self, axis: str, value: str) -> bool:
        return axis not in self.values or value in self.values[axis]

    def keeps_key(self, key: CellKey) -> bool:
        return all(self.keeps(axis, value) for axis, value in key.as_dict().items())


def rule_matches(rule: Rule, key: CellKey, device: str) -> bool:
    """Whether `rule` picks the cell `key` on `device` (the planner's test; the round-trip benchmark's too)."""
    if rule.device is not None and rule.device != device:
        return False
    fields = key.as_dict()
    return all(any(release_matches(fields[axis], pat) if axis == "release" else fnmatch.fnmatchcase(fields[axis], pat)
                   for pat in pats) for axis, pats in rule.when.items())


def why_not_importable(module: str) -> str | None:
    """None if `module` can be imported here, else a short reason (no import is executed)."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    if found is None:
        return f"No module named {module!r}"
    if found.origin is None and found.submodule_search_locations is not None and found.loader is None:
        return f"{module!r} is only a namespace folder here ({', '.join(found.submodule_search_locations)})"
    return None


def missing_needs(fw: Framework, plugin: str, importable: Callable[[str], str | None]) -> dict[str, str]:
    """What `plugin` imports beyond its framework that is not importable here: import module -> pip requirement."""
    return {module: pip for module, pip in fw.declaration.needs.get(plugin, {}).items() if importable(module)}


def needs_reason(plugin: str, missing: Mapping[str, str]) -> str:
    """A cell's skip reason where its plugin needs packages not installed here: what is missing and what installs it."""
    return f"plugin {plugin} needs {' and '.join(f'`{m}`' for m in missing)}: pip install {' '.join(missing.values())}"


def needs_summary(module: str, pip: str, plugins: Sequence[str]) -> str:
    """One line for the run's cells skipped for want of `module` (`plugins`: each one's framework/plugin)."""
    count = f"{len(plugins)} cell{'s' if len(plugins) > 1 else ''}"
    return f"{count} of {', '.join(sorted(set(plugins)))} need `{module}`: pip install {pip}"


def model_not_taken(fw: Framework, plugin: str, user: UserCase) -> str | None:
    """Why `plugin` cannot train the user's model (it is none of the classes the plugin takes), or None."""
    if plugin not in fw.declaration.takes:
        return None
    classes, why = fw.declaration.takes[plugin]
    if set(classes) & set(user.classes):
        return None
    model = user.classes[0] if user.classes else "the model"
    return f"plugin {plugin} takes a {' or a '.join(classes)} ({why}); {model} is not one: not run"


def installed_version(package: str) -> str | None:
    """A distribution's version here, from its metadata (nothing is imported), without a local tag (`+cu126`)."""
    try:
        found = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    return found.partition("+")[0]


def releases_here(fw: Framework, environment: str | None, missing: str | None, installed: str | None
                  ) -> list[Release]:
    """The release whose cells this run plans: the named environment's, else the one installed here.

    An installed version the framework file does not declare runs as itself (`composer@0.28.0`: "does freezing
    work on my version?"); a named environment whose release is not the one installed is refused, or its cells
    would carry a version they did not run.
    """
    if environment is None:
        declared = [r for r in fw.releases if installed and r.version and same_release(installed, r.version)]
        if missing or not installed or not fw.releases[0].version:
            return [fw.releases[0]]
        return declared[:1] or [Release(installed, f"{fw.name}@{installed}")]
    release = fw.release_in(environment)
    if release is None:
        return []
    if not missing and installed and release.version and not same_release(installed, release.version):
        raise SelectionError(f"--freeze-matrix-environment={environment} runs {fw.package} {release.version}, but "
                             f"{installed} is installed here: run that environment's python, or "
                             f"--freeze-matrix-environment={fw.name}@{installed}")
    return [release]


def _framework_cells(spec: Spec, fw: Framework, release: Release, axes: dict[str, tuple[str, ...]], world_size: int,
                     device: str, missing: str | None, importable: Callable[[str], str | None],
                     user: UserCase | None = None) -> Iterable[Cell]:
    patterns = user.patterns if user else spec.patterns
    for model, plugin, init, checkpoint, freeze, clip in itertools.product(
            *(axes[a] for a in ("model", "plugin", "init", "checkpoint", "freeze", "clip"))):
        key = CellKey(model, fw.name, plugin, init, checkpoint, freeze, clip, release.version)
        effects: dict[str, object] = {}
        options: dict[str, object] = {}
        for rule in fw.rules:
            if rule_matches(rule, key, device):
                effects.update(rule.effects)
                options.update(rule.effects.get("options", {}))
        if "exclude" in effects:
            continue
        skip = effects.get("skip")
        if user is not None and user.cuda_only and device == "cpu":
            skip = user.cuda_only
        if user is not None and (refusal := model_not_taken(fw, plugin, user)):
            skip = refusal
        if missing:
            skip = (f"{fw.name} is not importable in this environment ({missing}); "
                    f"its environment is {release.environment!r}")
        elif needs := missing_needs(fw, plugin, importable):
            skip = needs_reason(plugin, needs)
        emulation = bool(effects.get("emulation", False))
        precision = str(effects.get("precision", "fp32"))
        yield Cell(key=key, environment=release.environment, adapter=fw.declaration.implementation,
                   world_size=world_size, device=device,
                   pattern=patterns[freeze], groups=user.groups if user else spec.models[model],
                   precision=precision, emulation=emulation,
                   shim=fw.declaration.emulation if emulation else None,
                   options=options, skip=str(skip) if skip else None,
                   known_issue=str(effects["known_issue"]) if "known_issue" in effects else None,
                   user_model=user.model if user else None, tolerance=dict(user.tolerance) if user else {},
                   hyper=Hyper() if clip == LATER_AXES["clip"] else Hyper(max_norm=0.0),
                   round_trip="" if user else round_trip_group(fw, key, effects, options),
                   promised_stack=fw.declaration.promised((plugin, init, checkpoint), precision),
                   observes=fw.declaration.observes, distributions=fw.declaration.distributions)


def round_trip_group(fw: Framework, key: CellKey, effects: dict[str, object], options: dict[str, object]) -> str:
    """The cell's round-trip group: its id with each shared value replaced by its class's first, and whatever a
    rule changed about how it runs (two cells a rule treats apart never share). Built-in models only: the evidence
    that a class shares one result (benchmarks/round_trip_axes.py) is theirs, and the rules keeping cells apart name
    their patterns; a user's cell runs its own (sharing gave a non-reentrant cell with a frozen embedding the
    refused round trip of its reentrant twin, whose blocks had no grads to save)."""
    shared = CellKey(**{**key.as_dict(), **{axis: fw.round_trip_value(axis, getattr(key, axis))
                                            for axis in fw.round_trip}})
    ruled = {k: v for k, v in effects.items() if k not in ("known_issue", "skip")}
    return f"{shared.id} {json.dumps({**ruled, 'options': options}, sort_keys=True, default=str)}"


def plan(spec: Spec, selection: Selection, *, world_size: int, device: str, environment: str | None = None,
         importable: Callable[[str], str | None] = why_not_importable,
         installed: Callable[[str], str | None] = installed_version) -> list[Cell]:
    """Cells in a stable order. With `environment`, only the frameworks that environment owns run."""
    cells: list[Cell] = []
    asked = functools.cache(importable)  # once per module, not once per cell
    for fw in spec.frameworks.values():
        if not selection.keeps("framework", fw.name):
            continue
        missing = asked(fw.import_name)
        axes = {a: tuple(v for v in fw.axes[a] if selection.keeps(a, v)) for a in fw.axes}
        for release in releases_here(fw, environment, missing, installed(fw.package)):
            if selection.keeps("release", release.version):
                cells.extend(_framework_cells(spec, fw, release, axes, world_size, device, missing, asked))
    return cells


@dataclass(frozen=True)
class UserCase:
    """A user's model and freeze patterns (see `pytest_freezecompat.freeze_case`), as planning needs them."""

    name: str
    model: UserModel
    patterns: dict[str, FreezePattern]
    groups: dict[str, tuple[str, ...]]
    frameworks: tuple[str, ...] | None = None
    plugins: tuple[str, ...] | None = None
    init: tuple[str, ...] | None = None
    checkpoint: tuple[str, ...] | None = None
    clip: tuple[str, ...] | None = (LATER_AXES["clip"],)  # a case clips unless it asks for `no-clip` too
    tolerance: dict[str, float] = field(default_factory=dict)
    #: Why the model trains on CUDA ranks only (`user.cuda_only`): its cells on a CPU run are skipped with it.
    cuda_only: str | None = None
    #: The class names in the model's MRO, its own first: what a plugin that takes only some models reads (`takes`).
    classes: tuple[str, ...] = ()


def user_cells(spec: Spec, case: UserCase, *, world_size: int, device: str, environment: str | None = None,
               importable: Callable[[str], str | None] = why_not_importable,
               installed: Callable[[str], str | None] = installed_version) -> list[Cell]:
    """Cells for a user's case: every framework that takes user models, narrowed as the case asks."""
    takers = [fw for fw in spec.frameworks.values() if fw.user_models]
    for axis, wanted, offered in (("framework", case.frameworks, [fw.name for fw in takers]),
                                  ("plugin", case.plugins, [p for fw in takers for p in fw.axes["plugin"]]),
                                  ("init", case.init, [i for fw in takers for i in fw.axes["init"]]),
                                  ("checkpoint", case.checkpoint, [c for fw in takers for c in fw.axes["checkpoint"]]),
                                  ("clip", case.clip, [c for fw in takers for c in fw.axes["clip"]])):
        unknown = sorted(set(wanted or ()) - set(offered))
        if unknown:
            raise SelectionError(f"unknown {axis} {unknown[0]!r} for user models; valid: "
                                 f"{', '.join(dict.fromkeys(offered))}")
    cells: list[Cell] = []
    asked = functools.cache(importable)
    for fw in takers:
        if case.frameworks and fw.name not in case.frameworks:
            continue
        axes = {"model": (case.name,), "freeze": tuple(case.patterns)}
        for axis, wanted in (("plugin", case.plugins), ("init", case.init), ("checkpoint", case.checkpoint),
                             ("clip", case.clip)):
            axes[axis] = tuple(v for v in fw.axes[axis] if wanted is None or v in wanted)
        missing = asked(fw.import_name)
        for release in releases_here(fw, environment, missing, installed(fw.package)):
            cells.extend(_framework_cells(spec, fw, release, axes, world_size, device, missing, asked, case))
    return cells
