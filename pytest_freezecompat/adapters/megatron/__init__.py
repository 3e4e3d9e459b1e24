"""Megatron-core's GPTModel under torch DDP, Megatron DDP and its distributed optimizer, with TP or PP."""

from ...core.declaration import AdapterDeclaration

WRAPPERS = ("torch-ddp", "megatron-ddp", "megatron-ddp-distopt")
#: `<wrapper>-tp<N>` or `<wrapper>-pp<N>`: the parallel layout is part of the plugin id.
LAYOUTS = tuple(f"{axis}{size}" for axis in ("tp", "pp") for size in (1, 2, 4, 8))

DECLARATION = AdapterDeclaration(
    plugins=tuple(f"{wrapper}-{layout}" for wrapper in WRAPPERS for layout in LAYOUTS),
    init=("eager", "meta"),
    # Megatron's own recompute: full (uniform, one layer at a time) or selective (core attention).
    checkpoint=("none", "full", "selective"),
    implementation="pytest_freezecompat.adapters.megatron.adapter:MegatronAdapter",
    emulation="pytest_freezecompat.adapters.megatron.emulation:SHIM",
    words={**{f"{wrapper}-{layout}": said + f", {layout[:2].upper()}={layout[2:]}" for wrapper, said in (
               ("torch-ddp", "torch DDP"), ("megatron-ddp", "Megatron's DistributedDataParallel"),
               ("megatron-ddp-distopt", "Megatron DDP + distributed optimizer")) for layout in LAYOUTS},
           "eager": "model built as usual", "meta": "model built on the meta device",
           "none": "no activation recompute", "full": "recompute_granularity='full'",
           "selective": "recompute_granularity='selective'"},
)
