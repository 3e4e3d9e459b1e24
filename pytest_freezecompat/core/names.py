"""Names and patterns shared by the matrix files, the registry, user cases and reports."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: An axis value, pattern id, case name or registry id: lowercase letters, digits and '-'.
VALUE_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
#: The axes of a cell's key, in the order of its id (`model/framework@release/plugin/init/checkpoint/freeze[/clip]`).
KEY_AXES = ("model", "framework", "release", "plugin", "init", "checkpoint", "freeze", "clip")
#: Axes added after reports were first published, with the value every older cell had: an id leaves such an axis
#: out at that value (ids, `-k` filters and registry links stay what they were), and an older row gets it.
#: `release` is the framework's version in the cell's environment ("": not recorded, as in reports before #17).
LATER_AXES = {"clip": "clip", "release": ""}
#: Joins a framework and its release in an id's second segment: `composer@0.23.5`.
RELEASE_SEPARATOR = "@"
#: `clip`: clip every step at the cell's max norm through the stack's own API, or never clip (a stack may take
#: another path without it: Gemini's l2-norm assertion fires only inside clipping).
CLIP_VALUES = ("clip", "no-clip")
#: Axes whose values a user's `@freeze_case` adds (its model's name, its patterns), known only once collected.
USER_AXES = ("model", "freeze")
ID_SEPARATOR = "/"
#: The checks a cell's verdict is made of, in the order they are reported. Buffers move in a step's forward, before
#: its grads: a norm left in train mode shows there first, and the grads it changes follow from it.
CHECKS = ("requires_grad", "optimizer", "buffers", "grads", "grad_norm", "update", "resume")
#: What a failed check found, by check: a closed list the verdict writes on each failure (`kinds`), so that severity,
#: cause and the registry read facts and a message can be reworded freely.
FAILURE_KINDS = {
    "requires_grad": ("flag-changed", "untied"),
    "optimizer": ("tracks-unintended", "misses-trained"),
    "grads": ("no-grad", "zeroed", "spurious", "partial", "nonfinite", "differs", "ranks-differ"),
    "grad_norm": ("norm-differs",),
    "update": ("held-moved", "update-differs", "steps-missing", "ranks-differ"),
    "buffers": ("held-buffer-moved", "buffer-differs"),
    "resume": ("raised", "flag-after-load", "tracks-more-after-load", "tracks-less-after-load", "not-saved",
               "state-not-saved", "loaded-differs", "resumed-incomplete", "resumed-grads", "resumed-update",
               "resumed-norm", "buffer-not-restored"),
}
#: Where the optimizer holds a subset of the trainable params, users write the loop in more than one correct way;
#: the reference runs each and a cell passes if its weights follow one. The canonical loop zeroes through the
#: optimizer (grads of params outside it accumulate) and clips over every grad; the others zero every model grad,
#: or clip over the optimizer's params only (then how grads outside it are zeroed reaches no weight).
CANONICAL_LOOP = "optimizer.zero_grad(), clip over every grad"
MODEL_ZERO_GRAD_LOOP = "model.zero_grad(), clip over every grad"
CLIP_OPTIMIZED_LOOP = "clip over the optimizer's params"
LOOP_CONVENTIONS = (CANONICAL_LOOP, MODEL_ZERO_GRAD_LOOP, CLIP_OPTIMIZED_LOOP)
#: How bad a cell is for the user who trains that way (`verdict.severity` decides), worst first: every table leads
#: with them in this order. Red is `silent` or `refused` only; safe is `ok` or `differs` only (every check ran and
#: held): `unproven` passed what ran, but a check that decides the verdict did not run on that cell.
SEVERITIES = ("silent", "refused", "costly", "unproven", "differs", "harness", "ok", "skipped")
HARMFUL = ("silent", "refused")
SAFE = ("differs", "ok")
#: What each severity means for the user, in the words every report uses (`verdict.severity`): the report's
#: glossary, its filter labels and `advise`.
SEVERITY_MEANING = {
    "silent": "no error, yet the weights are wrong (a held param moves, a trained one learns wrongly or not at all, "
              "a resume loses state)",
    "refused": "the stack raised or hung: loud, the user knows",
    "costly": "the weights are right, but the stack pays for frozen params (its optimizer holds them) or a flag "
              "changed without reaching a weight",
    "unproven": "nothing failed, but a check that decides the verdict did not run on this cell (it says which): "
                "not safe until it does",
    "differs": "passes: only what reaches no weight differs from the canonical loop, under another correct loop",
    "harness": "our own code failed: says nothing about the stack",
    "ok": "every check held", "skipped": "not run (a one-line reason says why)"}
#: What a cell that passed may not have checked (`CellRecord.unchecked`): a check that decides the verdict but did
#: not run on that cell makes it `unproven`, never `ok`. A closed list; the words are what every format shows.
UNCHECKED = {
    "training": "training: the stack never ran a step (it refused before the first one, with nothing to train)",
    "grad_norm": "clipping: the stack reports no clip norm to compare with the reference's",
    "resume": "resume: no save -> load round trip ran on this cell",
    "ranks": "every rank: another rank's grads or params were not read, so only rank 0's were judged",
    "buffers": "buffers: the stack's model was read without its buffers (BatchNorm statistics, counters), so they "
               "were not judged",
    "randomness": "randomness: the forward draws random numbers (dropout) that the reference could not replay as the "
                  "ranks drew them, so trained params' grads, clip norm and updates were not compared (held params "
                  "and frozen modules' buffers were)",
    "resumed-steps": "resume: the resumed run drew its dropout masks from another generator state than the "
                     "uninterrupted run (the stack does not restore it), so the resumed steps were not compared",
}


def not_checked(keys: Iterable[str]) -> list[str]:
    """What a cell did not check (`UNCHECKED` keys), in the words every format uses; an unknown key as it is."""
    return [UNCHECKED.get(key, key) for key in keys]
#: The freeze-pattern group that stands for every parameter of a model.
ALL_GROUP = "all"


def import_ref(ref: str) -> Any:
    """`package.module:Qual.name` -> the object; how rank processes find adapters and a user's factories."""
    module_name, _, qualname = ref.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        target = getattr(target, part)
    return target


def ref_of(obj: Any) -> str:
    """The importable reference of a module-level function or class (the inverse of `import_ref`)."""
    qualname = getattr(obj, "__qualname__", "")
    if not callable(obj) or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{obj!r} must be a module-level function or class, so rank processes can import it")
    return f"{obj.__module__}:{qualname}"


#: Where installed packages live (any environment) and where this package lives: published text names
#: files relative to these, so a report carries no path of the machine that ran it.
_SITE_PACKAGES = re.compile(r"(?:/[^\s\"'(),:]+)?/(?:site|dist)-packages/")
_ROOTS = sorted({str(Path(__file__).resolve().parents[2]) + "/", sys.base_prefix.rstrip("/") + "/lib/",
                 sys.prefix.rstrip("/") + "/lib/"}, key=len, reverse=True)


def short_paths(text: str) -> str:
    """`/x/.nox/env/lib/python3.11/site-packages/torch/a.py` -> `torch/a.py`; the checkout's own files likewise."""
    text = _SITE_PACKAGES.sub("", text)
    for root in _ROOTS:
        text = text.replace(root, "")
    return text


#: A message's first paragraph is what a terminal line shows; the whole text stays in the JSON and the HTML.
HEADLINE_CHARS = 500
#: Where a cut message may end, best first: a sentence, a step (`step 0: … | step 1: …`), a clause, a list item,
#: a word.
_BOUNDARIES = (". ", " | ", "; ", ", ", " ")


def clip(text: str, limit: int) -> str:
    """`text` on one line and at most `limit` characters, cut where a sentence, step, clause or word ends, so a
    message never stops mid-name (only a single token filling the room is cut inside); marked ` …`."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    window = text[:limit - 2]
    for boundary in _BOUNDARIES:
        at = window.rfind(boundary)
        if at >= limit // 3:  # not so early that most of the room is lost
            return window[:at + (boundary == ". ")].rstrip(" ,;|") + " …"
    return window + "…"  # one token longer than two thirds of the limit: nothing better to cut at


#: A message that carries its ranks' tracebacks (torch DCP's CheckpointException): its cause is their last line.
_EMBEDDED_TRACEBACK = "Traceback (most recent call last)"


def headline(text: str, limit: int = HEADLINE_CHARS) -> str:
    """An exception's message as one line: its first paragraph (torch wraps long hints over several lines), clipped;
    where it embeds tracebacks, their last line (the error they end in)."""
    if _EMBEDDED_TRACEBACK in text:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        return clip(f"{lines[0].split(_EMBEDDED_TRACEBACK)[0].strip()}: {lines[-1]}", limit)
    return clip((text.strip().split("\n\n") or [""])[0], limit)


#: How reports name where a mechanism exists only on this project's CPU runs (an entry's `only_on`).
ONLY_ON_WORDS = {"gloo": "gloo (CPU process groups)", "cpu": "CPU runs"}


def cpu_only(known: dict[str, Any]) -> str | None:
    """`Only on gloo (CPU process groups); on GPU: ...`: what every format says beside such an entry and its
    "instead", so that a CPU artefact never reads as the framework's failure on GPUs; None for other entries."""
    scope = known.get("only_on") or {}
    if not scope:
        return None
    return f"Only on {ONLY_ON_WORDS.get(scope['backend'], scope['backend'])}; on GPU: {scope['elsewhere']}"


#: How every format names a registry entry's kind beside its id (`spec.known_issues.KINDS`; upstream: nothing).
KIND_WORDS = {"finding": "a finding of this matrix", "by-design": "upstream behaviour by design",
              "misuse": "an unsupported use"}
NOT_ABOUT_FREEZING = "not about freezing: the nothing-frozen control fails alike"


def kind_words(known: dict[str, Any], upstream: str = "") -> str:
    """`a finding of this matrix; not about freezing: ...`: what every format says beside an entry's id (`upstream`
    names an upstream report: the reports leave it unsaid, advise says it)."""
    words = [KIND_WORDS.get(known.get("kind") or "upstream", upstream)]
    if known.get("about_freezing") is False:
        words.append(NOT_ABOUT_FREEZING)
    return "; ".join(filter(None, words))


def fixed_in_words(known: dict[str, Any]) -> str:
    """`torch 2.9.0`: the releases that fixed an entry, by package, as every format and every framework sharing the
    entry says it ("" where none has)."""
    return ", ".join(f"{package} {release}" for package, release in (known.get("fixed_in") or {}).items())
