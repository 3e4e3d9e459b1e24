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
    return declaration
