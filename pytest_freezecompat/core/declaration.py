"""What an adapter offers, declared without importing its framework (or torch).

Each adapter package's `__init__.py` holds one `AdapterDeclaration` named `DECLARATION`; a framework
file names that package (`adapter = "pytest_freezecompat.adapters.torch_native"`). The spec loader
reads it to refuse, at load time, a plugin, init or checkpoint value the adapter would not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .names import import_ref


@dataclass(frozen=True)
class AdapterDeclaration:
    plugins: tuple[str, ...]
    init: tuple[str, ...]
    checkpoint: tuple[str, ...]
    #: `module:Class` of the implementation, imported in rank processes only.
    implementation: str
    #: `module:name` of its CUDA-on-CPU shim (an `adapters.emulation.Shim`), if it has one.
    emulation: str | None = None
    #: Plain words for a plugin, init or checkpoint value: what a user writes in their own code to get it
    #: (`fsdp1` -> "FSDP(use_orig_params=False)"), shown beside the value in every report and in `advise`.
    words: Mapping[str, str] = field(default_factory=dict)
    #: Facts of the stack as it really runs that the adapter reports (`Probe.observed`) on every cell once it has
    #: wrapped (`wrapper`, `precision`, ...); "precision" is promised by the cell's precision.
    observes: tuple[str, ...] = ()
    #: What a plugin, init or checkpoint value promises of the stack (`zero2` -> {"zero_stage": "2"}); the adapter
    #: reports each promised fact too. A run that shows another value ran another stack than its name says: a
    #: harness state with what was seen, never a verdict. A fact not reported after wrapping is one as well.
    promises: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: The distributions (PyPI names) whose installed versions every row records: the framework and its companions.
    distributions: tuple[str, ...] = ()
    #: The `options` a framework file's rule may set for this adapter, and the kind of value each takes (`bool`: true
    #: or false; `globs`: a list of name globs): the adapter reads them from `cell.options`. A rule sets no other:
    #: an option no adapter reads would plan its cells (and split their round trips) without a word.
    options: Mapping[str, str] = field(default_factory=dict)
    #: What a plugin imports beyond the framework (plugin -> {import module: pip requirement}): where one is not
    #: importable, planning skips the plugin's cells and says what to install, before any rank starts.
    needs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    #: What model a plugin can train (plugin -> (class names, one of which the model's type must have in its MRO; what
    #: the stack reads of it)): a user's model that is none of them is a skip with the reason, never a red verdict.
    takes: Mapping[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)

    def promised(self, values: tuple[str, ...], precision: str) -> dict[str, str]:
        """What a cell with these axis values promises of the observed stack."""
        facts = {"precision": precision} if "precision" in self.observes else {}
        for value in values:
            facts.update(self.promises.get(value, {}))
        return facts

    def offers(self, axis: str) -> tuple[str, ...]:
        return {"plugin": self.plugins, "init": self.init, "checkpoint": self.checkpoint}[axis]

    @property
    def implementation_module(self) -> str:
        return self.implementation.partition(":")[0]


class DeclarationError(ValueError):
    """An adapter package without a usable declaration; one line."""


def load_declaration(package: str) -> AdapterDeclaration:
    """`package` names the adapter package (its `DECLARATION`), or `module:NAME` for another name."""
    try:
        declaration = import_ref(package if ":" in package else f"{package}:DECLARATION")
    except ImportError as exc:
        raise DeclarationError(f"adapter {package!r} cannot be imported ({exc})") from None
    except AttributeError:
        raise DeclarationError(f"adapter {package!r} has no DECLARATION (an AdapterDeclaration)") from None
    if not isinstance(declaration, AdapterDeclaration):
        raise DeclarationError(f"adapter {package!r}: DECLARATION is a {type(declaration).__name__}, "
                               "not an AdapterDeclaration")
    for field_name, plugins in (("needs", declaration.needs), ("takes", declaration.takes)):
        for plugin in plugins:
            if plugin not in declaration.plugins:
                raise DeclarationError(f"adapter {package!r}: {field_name} names plugin {plugin!r}, which it does "
                                       f"not offer; valid: {', '.join(declaration.plugins)}")
    return declaration
