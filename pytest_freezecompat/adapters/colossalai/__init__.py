"""ColossalAI's Booster with each of its data-parallel plugins."""

from ...core.declaration import AdapterDeclaration

DECLARATION = AdapterDeclaration(
    plugins=("torch-ddp", "torch-ddp-find-unused", "torch-fsdp", "low-level-zero-1", "low-level-zero-2", "gemini",
             "gemini-auto", "gemini-split-chunks",
             "hybrid-parallel", "hybrid-parallel-zero-1"),
    init=("eager", "lazy", "lazy-materialize"),
    checkpoint=("none", "reentrant", "non-reentrant"),
    implementation="pytest_freezecompat.adapters.colossalai.adapter:ColossalAIAdapter",
    emulation="pytest_freezecompat.adapters.colossalai.emulation:SHIM",
)
