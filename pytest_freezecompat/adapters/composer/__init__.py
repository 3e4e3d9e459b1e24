"""MosaicML Composer's Trainer (DDP, FSDP1, FSDP2), with the user's optimizer or the Trainer's default."""

from ...core.declaration import AdapterDeclaration

#: A plugin id with this suffix runs the base plugin with `optimizers=None` (the Trainer's default optimizer).
DEFAULT_OPTIMIZER_SUFFIX = "-default-optimizer"
BASE_PLUGINS = ("ddp", "fsdp1", "fsdp1-orig-params", "fsdp1-shard-grad-op", "fsdp2")
#: FSDP2 without the shim's gloo AVG emulation: the upstream artefact itself (grads world_size x on torch < 2.8).
UNSHIMMED_GLOO_AVG = "fsdp2-no-avg-shim"

#: What each base plugin's Trainer builds, read back from its State (`adapter._observe`).
BUILDS = {
    "ddp": {"wrapper": "DistributedDataParallel", "find_unused_parameters": "False"},
    "fsdp1": {"wrapper": "FullyShardedDataParallel", "use_orig_params": "False", "sharding_strategy": "FULL_SHARD",
              "state_dict_type": "full"},
    "fsdp1-orig-params": {"wrapper": "FullyShardedDataParallel", "use_orig_params": "True",
                          "sharding_strategy": "FULL_SHARD", "state_dict_type": "full"},
    "fsdp1-shard-grad-op": {"wrapper": "FullyShardedDataParallel", "use_orig_params": "True",
                            "sharding_strategy": "SHARD_GRAD_OP", "state_dict_type": "sharded"},
    "fsdp2": {"wrapper": "FSDPModule", "state_dict_type": "sharded"},
}

DECLARATION = AdapterDeclaration(
    plugins=(*BASE_PLUGINS, *(p + DEFAULT_OPTIMIZER_SUFFIX for p in BASE_PLUGINS), UNSHIMMED_GLOO_AVG),
    init=("eager", "meta"),
    # framework: Composer's own activation checkpointing (an option of its FSDP configs).
    checkpoint=("none", "reentrant", "non-reentrant", "framework"),
    implementation="pytest_freezecompat.adapters.composer.adapter:ComposerAdapter",
    emulation="pytest_freezecompat.adapters.composer.emulation:SHIM",
    words={**{plugin + suffix: words + said for plugin, words in (
               ("ddp", "Trainer with DDP"), ("fsdp1", "Trainer, FSDP1 with use_orig_params=False"),
               ("fsdp1-orig-params", "Trainer, FSDP1 with use_orig_params=True"),
               ("fsdp1-shard-grad-op", "Trainer, FSDP1 SHARD_GRAD_OP, use_orig_params=True"),
               ("fsdp2", "Trainer, FSDP2 (parallelism_config fsdp2)"))
              for suffix, said in (("", ""), (DEFAULT_OPTIMIZER_SUFFIX, ", the Trainer's default optimizer"))},
           UNSHIMMED_GLOO_AVG: "Trainer, FSDP2, gloo's own averaging (no shim)",
           "eager": "model built as usual", "meta": "model built on the meta device (init_device='meta')",
           "none": "no activation checkpointing", "reentrant": "torch.utils.checkpoint(use_reentrant=True)",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False)",
           "framework": "Composer's FSDP activation_checkpointing option"},
    observes=("wrapper", "precision", "optimizer", "framework_activation_checkpointing"),
    promises={
        **{plugin: {**built, "optimizer": "AdamW"} for plugin, built in BUILDS.items()},
        # optimizers=None: the Trainer builds its own.
        **{plugin + DEFAULT_OPTIMIZER_SUFFIX: {**built, "optimizer": "DecoupledSGDW"}
           for plugin, built in BUILDS.items()},
        UNSHIMMED_GLOO_AVG: {**BUILDS["fsdp2"], "optimizer": "AdamW"},
        # Composer's checkpoint_wrapper on the blocks for `framework` only; the others checkpoint inside the model.
        **{mode: {"framework_activation_checkpointing": "False"} for mode in ("none", "reentrant", "non-reentrant")},
        "framework": {"framework_activation_checkpointing": "True"},
    },
    # Composer imports torchvision (each environment pins the two together).
    distributions=("mosaicml", "torchvision"),
)
