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
           "gemini-split-chunks": "GeminiPlugin with chunks of 12288 elements: a branch that outgrows one gets "
                                  "chunks of its own (tiny-gpt's unused branch); a smaller model stays in one chunk, "
                                  "as under gemini (the row's param_chunks says which)",
           "hybrid-parallel": "HybridParallelPlugin(tp_size=1, zero_stage=0)",
           "hybrid-parallel-zero-1": "HybridParallelPlugin(zero_stage=1, bf16)",
           "eager": "model built as usual", "lazy": "model built under LazyInitContext, boost materializes it",
           "lazy-materialize": "LazyInitContext, then LazyInitContext.materialize(model) before boost",
           "none": "no activation checkpointing", "reentrant": "torch.utils.checkpoint(use_reentrant=True)",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False)"},
    # Read back after `booster.boost` (adapter._observe), the same on 0.3.4, 0.4.7 and 0.5.0: the wrapper and
    # optimizer the plugin built, the plugin's class, the dtype the model computes in, and whether the model's params
    # were LazyInitContext's LazyTensors when built and when boost got them.
    observes=("wrapper", "plugin", "optimizer", "precision", "lazy_init", "lazy_at_boost"),
    promises={
        "torch-ddp": {"wrapper": "TorchDDPModel", "plugin": "TorchDDPPlugin", "optimizer": "OptimizerWrapper",
                      "find_unused_parameters": "False"},
        "torch-ddp-find-unused": {"wrapper": "TorchDDPModel", "plugin": "TorchDDPPlugin",
                                  "optimizer": "OptimizerWrapper", "find_unused_parameters": "True"},
        "torch-fsdp": {"wrapper": "TorchFSDPModel", "plugin": "TorchFSDPPlugin", "optimizer": "FSDPOptimizerWrapper",
                       "sharding_strategy": "FULL_SHARD"},
        "low-level-zero-1": {"wrapper": "LowLevelZeroModel", "plugin": "LowLevelZeroPlugin",
                             "optimizer": "LowLevelZeroOptimizer", "zero_stage": "1"},
        "low-level-zero-2": {"wrapper": "LowLevelZeroModel", "plugin": "LowLevelZeroPlugin",
                             "optimizer": "LowLevelZeroOptimizer", "zero_stage": "2"},
        "gemini": {"wrapper": "GeminiDDP", "plugin": "GeminiPlugin", "optimizer": "GeminiOptimizer",
                   "placement_policy": "static"},
        "gemini-auto": {"wrapper": "GeminiDDP", "plugin": "GeminiPlugin", "optimizer": "GeminiOptimizer",
                        "placement_policy": "auto"},
        # Its chunks (`param_chunks`, observed, not promised) split only where the params outgrow one chunk of
        # 12288 (tiny-gpt with unused-branch): a smaller model gets the single gathered chunk `gemini` builds.
        "gemini-split-chunks": {"wrapper": "GeminiDDP", "plugin": "GeminiPlugin", "optimizer": "GeminiOptimizer",
                                "placement_policy": "static"},
        "hybrid-parallel": {"wrapper": "HybridParallelModule", "plugin": "HybridParallelPlugin",
                            "optimizer": "HybridParallelNaiveOptimizer", "zero_stage": "0"},
        "hybrid-parallel-zero-1": {"wrapper": "HybridParallelModule", "plugin": "HybridParallelPlugin",
                                   "optimizer": "HybridParallelZeroOptimizer", "zero_stage": "1"},
        "eager": {"lazy_init": "False", "lazy_at_boost": "False"},
        "lazy": {"lazy_init": "True", "lazy_at_boost": "True"},
        "lazy-materialize": {"lazy_init": "True", "lazy_at_boost": "False"},
    },
    # The framework, and what the example models come from (transformers, peft): their versions are part of a row.
    distributions=("colossalai", "transformers", "peft"),
    # Keywords of the Booster plugin the cell builds (adapter.py), passed through as they are.
    options={"overlap_communication": "bool", "pin_memory": "bool", "enable_async_reduce": "bool"},
)
