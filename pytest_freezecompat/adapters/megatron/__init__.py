"""Megatron-core's GPTModel under torch DDP, Megatron DDP and its distributed optimizer, with TP or PP."""

from ...core.declaration import AdapterDeclaration

WRAPPERS = ("torch-ddp", "megatron-ddp", "megatron-ddp-distopt")
#: `<wrapper>-tp<N>` or `<wrapper>-pp<N>`: the parallel layout is part of the plugin id.
LAYOUTS = tuple(f"{axis}{size}" for axis in ("tp", "pp") for size in (1, 2, 4, 8))
PLUGINS = tuple(f"{wrapper}-{layout}" for wrapper in WRAPPERS for layout in LAYOUTS)

#: What each wrapper promises of the objects Megatron builds: the wrapper's class (by import path: torch's and
#: Megatron's are both named DistributedDataParallel) and the optimizer's (get_megatron_optimizer's, unwrapped from
#: its ChainedOptimizer; torch DDP trains with torch's own optimizer, none on a stage with nothing to optimize).
_WRAPPER_PROMISES = {
    "torch-ddp": {"wrapper": "torch.nn.parallel.DistributedDataParallel", "use_distributed_optimizer": "False"},
    "megatron-ddp": {"wrapper": "megatron.core.distributed.DistributedDataParallel",
                     "use_distributed_optimizer": "False", "optimizer": "FP32Optimizer"},
    "megatron-ddp-distopt": {"wrapper": "megatron.core.distributed.DistributedDataParallel",
                             "use_distributed_optimizer": "True", "optimizer": "DistributedOptimizer"},
}


def _layout_promises(layout: str) -> dict[str, str]:
    """The parallel sizes `parallel_state` reports once the layout is made (the rest of the ranks data parallel)."""
    size = layout[2:]
    return {"tensor_model_parallel_size": size if layout.startswith("tp") else "1",
            "pipeline_model_parallel_size": size if layout.startswith("pp") else "1"}

DECLARATION = AdapterDeclaration(
    plugins=PLUGINS,
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
    observes=("wrapper", "precision", "optimizer", "use_distributed_optimizer", "tensor_model_parallel_size",
              "pipeline_model_parallel_size", "data_parallel_size", "recompute_granularity", "recompute_method",
              "checkpoint_core_attention"),
    # The recompute the model's modules hold: TransformerBlock reads config.recompute_granularity ("none" where
    # unset) and recompute_method in forward, each attention its checkpoint_core_attention (selective).
    promises={**{f"{wrapper}-{layout}": {**facts, **_layout_promises(layout)}
                 for wrapper, facts in _WRAPPER_PROMISES.items() for layout in LAYOUTS},
              "none": {"recompute_granularity": "none", "checkpoint_core_attention": "False"},
              "full": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "checkpoint_core_attention": "False"},
              "selective": {"recompute_granularity": "selective", "checkpoint_core_attention": "True"}},
    # megatron-core's torch_dist checkpoint writer needs psutil (not a declared dependency); Transformer Engine,
    # where installed, changes the distributed optimizer's Adam (Apex's or TE's fused kernel before 0.10).
    distributions=("megatron-core", "psutil", "transformer-engine"),
    # adapter.py FREEZE_AFTER_WRAP: the pattern is applied after the model is wrapped.
    options={"freeze_after_wrap": "bool"},
    # The resume check saves through megatron-core's torch_dist writer, which needs psutil
    # (compat.torch_dist_writer_problem).
    needs={plugin: {"psutil": "psutil"} for plugin in PLUGINS},
)
