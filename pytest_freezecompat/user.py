"""Your own model in the matrix: `@freeze_case(...)` on a model factory in a test file.

    from pytest_freezecompat import freeze_case

    @freeze_case(batch=make_batch, loss=lm_loss, patterns={"head-only": {"trainable": ["lm_head.*"]}},
                 frameworks=["torch"], plugins=["ddp", "fsdp2"])
    def tiny_llama():
        return LlamaForCausalLM(LlamaConfig(...))

Plain `pytest` on that file then runs one item per (framework, plugin, init, checkpoint,
pattern), with the matrix's checks and report. Factories, batch and loss functions must
live at module level: rank processes import them by name.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import models
from .core.cell import UserModel
from .core.freeze import FreezePattern, PatternError, is_quantized, resolve
from .core.names import VALUE_RE, import_ref, ref_of
from .core.ties import ties_of
from .spec.plan import UserCase
from .verdict.checks import Tolerance

CASE_ATTRIBUTE = "__freeze_case__"
CONTROL = "none"
PATTERN_ROLES = ("frozen", "trainable", "optimizer", "unused", "buffers", "eval")
#: The control's group of quantized weights, which stay frozen in it (`is_quantized`).
QUANTIZED_GROUP = f"{CONTROL}.quantized"
CONTROL_QUANTIZED = "nothing frozen but the quantized weights, which cannot train (control)"

PatternSpec = Mapping[str, Sequence[str]] | Callable[[str], bool]


class NotRun(UserWarning):
    """Part of what the matrix would run on a user's model that cannot run on it, said once at collection."""


class CaseError(ValueError):
    """A declaration we cannot run; the message is one line naming the case and what is wrong."""


@dataclass(frozen=True)
class CaseDeclaration:
    factory: Callable[[], nn.Module]
    name: str
    batch: Callable[[int, int], dict[str, torch.Tensor]]
    loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    patterns: Mapping[str, PatternSpec]
    frameworks: Sequence[str] | None
    plugins: Sequence[str] | None
    init: Sequence[str] | None
    checkpoint: Sequence[str] | None
    tolerance: Mapping[str, float]
    clip: Sequence[str]
    blocks: tuple[str, ...] | None = None


def freeze_case(*, batch: Callable[[int, int], dict[str, torch.Tensor]],
                loss: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor],
                patterns: Mapping[str, PatternSpec], name: str | None = None,
                frameworks: Sequence[str] | None = None, plugins: Sequence[str] | None = None,
                init: Sequence[str] | None = None, checkpoint: Sequence[str] | None = None,
                tolerance: Mapping[str, float] | None = None,
                clip: Sequence[str] = ("clip",),
                blocks: Sequence[str] | None = None) -> Callable[[Callable[[], nn.Module]], Any]:
    """Declare a model factory as a matrix case.

    batch(global_batch_size, step) -> dict of tensors (rows are split across ranks);
    loss(model, batch) -> scalar. A pattern is {"frozen"|"trainable": [globs], "optimizer": [globs],
    "unused": [globs]} or a module-level function name -> bool (True = trainable).
    `tolerance` overrides fields of `checks.Tolerance` (grad_rtol, grad_atol, param_rtol, param_atol, norm_rtol).
    `clip`: "clip" (every step, through the stack's own API), "no-clip", or both.
    `blocks`: class names of the model's repeated blocks: FSDP makes each one a unit, activation checkpointing wraps
    each one in `torch.utils.checkpoint` where the model has no switch of its own (`set_activation_checkpointing`,
    or Hugging Face's `gradient_checkpointing_enable`). Default: the model's `_no_split_modules`, else the classes
    its largest `nn.ModuleList` holds; a model with neither runs FSDP as one unit and no activation checkpointing,
    said once when its cells are collected.
    """

    def decorate(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        setattr(factory, CASE_ATTRIBUTE, CaseDeclaration(
            factory, name or factory.__name__.replace("_", "-").lower(), batch, loss, patterns, frameworks, plugins,
            init, checkpoint, dict(tolerance or {}), tuple(clip), tuple(blocks) if blocks is not None else None))
        return factory

    return decorate


def _ref(obj: Any, what: str) -> str:
    try:
        ref = ref_of(obj)
        if import_ref(ref) is not obj:
            raise ValueError(f"{ref} names another object")
    except (ValueError, ImportError, AttributeError) as exc:
        raise CaseError(f"{what} cannot be imported by rank processes: {exc}") from None
    return ref


def _pattern(pid: str, spec: PatternSpec) -> tuple[FreezePattern, dict[str, tuple[str, ...]]]:
    if not VALUE_RE.match(pid):
        raise CaseError(f"pattern id {pid!r} must use lowercase letters, digits and '-'")
    if callable(spec):
        return FreezePattern(pid, predicate=_ref(spec, f"pattern {pid!r}")), {}
    unknown = sorted(set(spec) - set(PATTERN_ROLES))
    if unknown or ("frozen" in spec and "trainable" in spec):
        raise CaseError(f"pattern {pid!r}: use `frozen` or `trainable` (not both), plus optional `optimizer`, "
                        f"`unused`, `buffers`, `eval`; got {', '.join(sorted(spec))}")
    groups = {f"{pid}.{role}": tuple(globs) for role, globs in spec.items()}

    def role(key: str) -> tuple[str, ...] | None:
        return (f"{pid}.{key}",) if key in spec else None

    return FreezePattern(pid, frozen=role("frozen") or (), trainable=role("trainable"), optimizer=role("optimizer"),
                         unused=role("unused") or (), buffers=role("buffers") or (), eval=role("eval") or ()), groups


def _check_module_globs(pid: str, groups: Mapping[str, Sequence[str]], model: nn.Module) -> None:
    """A pattern's `buffers` globs name buffers and its `eval` globs modules: one that names nothing is a typo."""
    for role, names in (("buffers", [n for n, _ in model.named_buffers()]),
                        ("eval", [n for n, _ in model.named_modules()])):
        for glob in groups.get(f"{pid}.{role}", ()):
            if not fnmatch.filter(names, glob):
                raise CaseError(f"freeze pattern {pid!r}: {role} glob {glob!r} matches no "
                                f"{'buffer' if role == 'buffers' else 'module'} of the model")


#: Modules whose forward runs on a GPU only once a process group is up (`torch/nn/modules/batchnorm.py` raises
#: ValueError on a CPU input; DDP refuses them in a CPU module): a CPU run says so instead of calling it refused.
CUDA_ONLY_MODULES = (nn.SyncBatchNorm,)


def cuda_only(model: nn.Module) -> str | None:
    """Why the model cannot train on CPU ranks, or None."""
    found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, CUDA_ONLY_MODULES)})
    if not found:
        return None
    return (f"{', '.join(found)} needs CUDA ranks (torch raises 'SyncBatchNorm expected input tensor to be on GPU' on "
            "CPU, and DDP refuses it in a CPU module): not run on CPU; on GPUs it is judged against the whole batch")


def model_classes(model: nn.Module) -> tuple[str, ...]:
    """The model's class and its bases, by name (a peft wrapper's too: `PeftModel`), for the plugins that take only
    some models."""
    return tuple(dict.fromkeys(cls.__name__ for cls in type(model).__mro__))


def build_case(decl: CaseDeclaration) -> UserCase:
    """Check a declaration the way ranks will use it (build on meta, resolve every pattern)."""
    if not VALUE_RE.match(decl.name):
        raise CaseError(f"case name {decl.name!r} must use lowercase letters, digits and '-'")
    try:
        with torch.device("meta"):
            model = decl.factory()
    except Exception as exc:  # the user's code: report, don't crash collection
        raise CaseError(f"the model factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise CaseError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
    blocks = decl.blocks if decl.blocks is not None else models.blocks_of(model)
    present = {type(m).__name__ for m in model.modules()}
    if decl.blocks is not None and (missing := sorted(set(decl.blocks) - present)):
        raise CaseError(f"blocks: {missing[0]!r} is no module class of {type(model).__name__}")
    refs = UserModel(_ref(decl.factory, "the model factory"), _ref(decl.batch, "batch"), _ref(decl.loss, "loss"),
                     tuple(blocks))
    names = [n for n, _ in model.named_parameters()]
    ties = ties_of(model.named_parameters(remove_duplicate=False))  # the constructor's ties hold on meta too
    if not decl.patterns:
        raise CaseError("no freeze pattern declared")
    # The control of every column: nothing frozen. A red cell whose control fails the same way is the
    # stack's failure, not freezing's (the verdict's `cause`). Quantized weights (a 4-bit base) cannot train: the
    # control leaves them frozen, as every pattern of such a model does.
    quantized = tuple(n for n, p in model.named_parameters() if is_quantized(p))
    patterns = {CONTROL: FreezePattern(CONTROL, frozen=(QUANTIZED_GROUP,) if quantized else (),
                                       description=CONTROL_QUANTIZED if quantized else "nothing frozen (control)")}
    groups: dict[str, tuple[str, ...]] = {QUANTIZED_GROUP: quantized} if quantized else {}
    for pid, spec in decl.patterns.items():
        pattern, pattern_groups = _pattern(pid, spec)
        try:
            resolve(pattern, pattern_groups, names, ties)
        except PatternError as exc:
            raise CaseError(str(exc)) from None
        _check_module_globs(pid, pattern_groups, model)
        patterns[pid] = pattern
        groups.update(pattern_groups)
    fields = {f.name for f in dataclasses.fields(Tolerance)}
    if set(decl.tolerance) - fields:
        raise CaseError(f"unknown tolerance {sorted(set(decl.tolerance) - fields)[0]!r}; valid: {', '.join(fields)}")
    has_switch = (hasattr(model, "set_activation_checkpointing") or hasattr(model, "gradient_checkpointing_enable")
                  or bool(blocks))
    checkpoint = tuple(decl.checkpoint) if decl.checkpoint else (None if has_switch else ("none",))
    if checkpoint and not has_switch and set(checkpoint) != {"none"}:
        raise CaseError(f"{type(model).__name__} has no activation-checkpointing switch and no blocks to wrap; "
                        "name them with blocks=[...] or use checkpoint=['none']")
    if not has_switch:
        warnings.warn(NotRun(f"freeze_case {decl.name}: activation checkpointing is not run and FSDP wraps the model "
                             f"as one unit: {type(model).__name__} has no checkpointing switch, no _no_split_modules "
                             "and no nn.ModuleList of layers (name its blocks with freeze_case(blocks=[...]))"),
                      stacklevel=1)
    return UserCase(name=decl.name, model=refs, patterns=patterns, groups=groups,
                    frameworks=tuple(decl.frameworks) if decl.frameworks else None,
                    plugins=tuple(decl.plugins) if decl.plugins else None,
                    init=tuple(decl.init) if decl.init else None, checkpoint=checkpoint, clip=tuple(decl.clip),
                    tolerance={k: float(v) for k, v in decl.tolerance.items()}, cuda_only=cuda_only(model),
                    classes=model_classes(model))
