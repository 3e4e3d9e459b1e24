"""PyTorch's own wrappers (DDP, FSDP1, FSDP2): the adapter to copy when adding a framework."""

from ...core.declaration import AdapterDeclaration

DECLARATION = AdapterDeclaration(
    plugins=("ddp", "ddp-find-unused", "fsdp1", "fsdp1-orig-params", "fsdp2", "fsdp2-reduce-unused"),
    init=("eager", "meta"),
    checkpoint=("none", "reentrant", "non-reentrant"),
    implementation="pytest_freezecompat.adapters.torch_native.adapter:TorchAdapter",
    words={"ddp": "DistributedDataParallel", "ddp-find-unused": "DDP(find_unused_parameters=True)",
           "fsdp1": "FSDP(use_orig_params=False)", "fsdp1-orig-params": "FSDP(use_orig_params=True)",
           "fsdp2": "fully_shard (FSDP2)",
           "fsdp2-reduce-unused": "fully_shard, then set_reduce_scatter_unused_params(True)",
           "eager": "model built on CPU/GPU as usual",
           "meta": "model built on the meta device, materialized by the wrapper", "none": "no activation checkpointing",
           "reentrant": "torch.utils.checkpoint(use_reentrant=True) around each block",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False) around each block"},
    observes=("wrapper", "precision"),
    promises={"ddp": {"wrapper": "DistributedDataParallel", "find_unused_parameters": "False"},
              "ddp-find-unused": {"wrapper": "DistributedDataParallel", "find_unused_parameters": "True"},
              "fsdp1": {"wrapper": "FullyShardedDataParallel", "use_orig_params": "False",
                        "sharding_strategy": "FULL_SHARD"},
              "fsdp1-orig-params": {"wrapper": "FullyShardedDataParallel", "use_orig_params": "True",
                                    "sharding_strategy": "FULL_SHARD"},
              "fsdp2": {"wrapper": "FSDPModule"}, "fsdp2-reduce-unused": {"wrapper": "FSDPModule"}},
    # The example models come from transformers and peft: their versions are part of what a row ran.
    distributions=("transformers", "peft"),
)
