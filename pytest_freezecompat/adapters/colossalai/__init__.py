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
    words={"torch-ddp": "TorchDDPPlugin", "torch-ddp-find-unused": "TorchDDPPlugin(find_unused_parameters=True)",
           "torch-fsdp": "TorchFSDPPlugin", "low-level-zero-1": "LowLevelZeroPlugin(stage=1)",
           "low-level-zero-2": "LowLevelZeroPlugin(stage=2)", "gemini": "GeminiPlugin (static placement)",
           "gemini-auto": "GeminiPlugin(placement_policy='auto')",
           "gemini-split-chunks": "GeminiPlugin with small chunks (a frozen and a trainable chunk)",
           "hybrid-parallel": "HybridParallelPlugin(tp_size=1, zero_stage=0)",
           "hybrid-parallel-zero-1": "HybridParallelPlugin(zero_stage=1, bf16)",
           "eager": "model built as usual", "lazy": "model built under LazyInitContext, boost materializes it",
           "lazy-materialize": "LazyInitContext, then LazyInitContext.materialize(model) before boost",
           "none": "no activation checkpointing", "reentrant": "torch.utils.checkpoint(use_reentrant=True)",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False)"},
)
