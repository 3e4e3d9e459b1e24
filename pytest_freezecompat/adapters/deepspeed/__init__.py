"""DeepSpeed: `deepspeed.initialize` and its engine, ZeRO stages 0-3, optimizer offload, zero.Init."""

from ...core.declaration import AdapterDeclaration

STAGES = ("zero0", "zero1", "zero2", "zero3", "zero2-offload")
#: `-config-optim`: the optimizer from the config (DeepSpeed builds it: FusedAdam, or DeepSpeedCPUAdam when
#: offloading) over `model.parameters()`; without it, the user's AdamW over the params they mean to train.
CONFIG_OPTIMIZER = "-config-optim"

#: `-bf16`: the config's `bf16: {enabled: true}` (a matrix rule sets the cell's precision to bf16: judged against the
#: mixed-precision reference).
BF16 = "-bf16"

DECLARATION = AdapterDeclaration(
    plugins=(*STAGES, *(f"{stage}{CONFIG_OPTIMIZER}" for stage in STAGES), *(f"{stage}{BF16}" for stage in STAGES)),
    # zero-init: the model built inside `deepspeed.zero.Init` (stage 3 only: it partitions at construction).
    init=("eager", "zero-init"),
    # framework: DeepSpeed's own activation checkpointing (`deepspeed.checkpointing.checkpoint`) around each block.
    checkpoint=("none", "reentrant", "non-reentrant", "framework"),
    implementation="pytest_freezecompat.adapters.deepspeed.adapter:DeepSpeedAdapter",
    words={**{f"{stage}{suffix}": f"ZeRO stage {stage[4]}" + (" with optimizer offload" if "offload" in stage else "")
              + said for stage in STAGES for suffix, said in (
                  ("", ", your AdamW"), (CONFIG_OPTIMIZER, ", the config's optimizer"), (BF16, ", bf16"))},
           "eager": "model built as usual", "zero-init": "model built inside deepspeed.zero.Init",
           "none": "no activation checkpointing", "reentrant": "torch.utils.checkpoint(use_reentrant=True)",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False)",
           "framework": "deepspeed.checkpointing.checkpoint"},
    # Read back from the engine after `deepspeed.initialize` (`deepspeed_views.observe_engine`); zero_init from the
    # params as the constructor left them (`ds_id`, partitioned), before initialize partitions an eager model too.
    observes=("wrapper", "zero_stage", "offload", "optimizer", "precision", "zero_init"),
    promises={**{f"{stage}{suffix}": {
        "wrapper": "DeepSpeedEngine", "zero_stage": stage[4], "offload": "cpu" if "offload" in stage else "none",
        # engine.basic_optimizer: the user's AdamW, or what DeepSpeed builds for the config's {"type": "AdamW"}
        "optimizer": ("DeepSpeedCPUAdam" if "offload" in stage else "FusedAdam") if suffix == CONFIG_OPTIMIZER
        else "AdamW"} for stage in STAGES for suffix in ("", CONFIG_OPTIMIZER, BF16)},
        "eager": {"zero_init": "False"}, "zero-init": {"zero_init": "True"}},
    # The example models come from transformers and peft (under DeepSpeed too): their versions are part of a row.
    distributions=("deepspeed", "transformers", "peft"),
    # adapter.py EXCLUDE_FROZEN: save_checkpoint(exclude_frozen_parameters=...).
    options={"exclude_frozen_parameters": "bool"},
)
