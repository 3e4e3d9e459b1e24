"""Declarations of adapters that exist only for planning and spec tests (they never run)."""

from pytest_freezecompat.core.declaration import AdapterDeclaration

ALPHA = AdapterDeclaration(plugins=("p1", "p2", "gem"), init=("eager", "lazy"), checkpoint=("none",),
                           implementation="toy_adapters:Never", emulation="toy_adapters:NO_SHIM")
BETA = AdapterDeclaration(plugins=("q",), init=("eager",), checkpoint=("none",), implementation="toy_adapters:Never")
MEGA = AdapterDeclaration(plugins=("p",), init=("eager",), checkpoint=("none",), implementation="toy_adapters:Never")
#: `zero` needs two packages beyond its framework, `ddp` one, `plain` none.
NEEDY = AdapterDeclaration(plugins=("plain", "ddp", "zero"), init=("eager",), checkpoint=("none",),
                           implementation="toy_adapters:Never",
                           needs={"ddp": {"extra_mod": "extra-pkg"},
                                  "zero": {"extra_mod": "extra-pkg", "engine_mod": "engine"}})
UNKNOWN_NEED = AdapterDeclaration(plugins=("p",), init=("eager",), checkpoint=("none",),
                                  implementation="toy_adapters:Never", needs={"q": {"json": "json"}})
