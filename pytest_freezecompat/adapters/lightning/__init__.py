"""PyTorch Lightning: its Trainer (the LightningModule's own loop, callbacks, checkpointing) and Fabric (the user's
own loop), each with its DDP, FSDP and DeepSpeed strategies; and Lightning's own way of freezing, the BaseFinetuning
callback."""

from ...core.declaration import AdapterDeclaration

#: What each plugin's strategy builds, read back from the running strategy (`adapter._observe`).
BUILDS = {f"{driver.lower()}-ddp{suffix}": {"driver": driver, "strategy": "DDPStrategy",
                                             "wrapper": "DistributedDataParallel", "find_unused_parameters": unused}
          for driver in ("Trainer", "Fabric") for suffix, unused in (("", "False"), ("-find-unused", "True"))}
BUILDS.update({f"{driver.lower()}-fsdp": {"driver": driver, "strategy": "FSDPStrategy",
                                          "wrapper": "FullyShardedDataParallel", "use_orig_params": "True"}
               for driver in ("Trainer", "Fabric")})
BUILDS.update({f"{driver.lower()}-deepspeed{suffix}": {"driver": driver, "strategy": "DeepSpeedStrategy",
                                                        "wrapper": "DeepSpeedEngine", "zero_stage": stage,
                                                        "exclude_frozen_parameters": excluded}
               for driver in ("Trainer", "Fabric")
               for suffix, stage, excluded in (("", "2", "False"), ("-stage-3", "3", "False"),
                                               ("-exclude-frozen", "2", "True"))})

DECLARATION = AdapterDeclaration(
    plugins=tuple(BUILDS),
    init=("eager",),
    checkpoint=("none", "reentrant", "non-reentrant"),
    implementation="pytest_freezecompat.adapters.lightning.adapter:LightningAdapter",
    emulation="pytest_freezecompat.adapters.lightning.emulation:SHIM",
    words={"trainer-ddp": "Trainer(strategy='ddp'): training_step, configure_optimizers, gradient_clip_val, "
                          "ModelCheckpoint, fit(ckpt_path=...)",
           "trainer-ddp-find-unused": "Trainer(strategy='ddp_find_unused_parameters_true'), the rest as trainer-ddp",
           "fabric-ddp": "Fabric(strategy='ddp'): fabric.setup, fabric.backward, fabric.clip_gradients, "
                         "fabric.save / fabric.load",
           "fabric-ddp-find-unused": "Fabric(strategy=DDPStrategy(find_unused_parameters=True)), the rest as "
                                     "fabric-ddp",
           "trainer-fsdp": "Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block})): use_orig_params=True, a full "
                           "checkpoint from rank 0 (the Trainer's defaults), the rest as trainer-ddp",
           "fabric-fsdp": "Fabric(strategy=FSDPStrategy(auto_wrap_policy={Block})): use_orig_params=True, sharded "
                          "checkpoints (Fabric's defaults), the rest as fabric-ddp",
           "trainer-deepspeed": "Trainer(strategy=DeepSpeedStrategy(stage=2)) (strategy='deepspeed'): the Trainer "
                                "builds the config, gradient_clip_val becomes its gradient_clipping; checkpoints are "
                                "DeepSpeed's folders; the rest as trainer-ddp",
           "trainer-deepspeed-stage-3": "Trainer(strategy=DeepSpeedStrategy(config={'zero_optimization': {'stage': 3, "
                                        "'stage3_param_persistence_threshold': 0}, "
                                        "'zero_allow_untested_optimizer': True})), the rest as trainer-deepspeed",
           "fabric-deepspeed": "Fabric(strategy=DeepSpeedStrategy(config=...)) with ZeRO stage 2 and the config's "
                               "gradient_clipping (fabric.clip_gradients refuses under DeepSpeed): fabric.setup, "
                               "fabric.backward, fabric.save / fabric.load (DeepSpeed's folders)",
           "fabric-deepspeed-stage-3": "fabric-deepspeed with ZeRO stage 3, every param partitioned "
                                       "(stage3_param_persistence_threshold=0)",
           "trainer-deepspeed-exclude-frozen": "Trainer(strategy=DeepSpeedStrategy(stage=2, "
                                               "exclude_frozen_parameters=True)): checkpoints without the frozen "
                                               "params (2.5.5+), the rest as trainer-deepspeed",
           "fabric-deepspeed-exclude-frozen": "Fabric(strategy=DeepSpeedStrategy(config=..., "
                                              "exclude_frozen_parameters=True)): checkpoints without the frozen "
                                              "params (2.5.5+), the rest as fabric-deepspeed",
           "eager": "model built as usual", "none": "no activation checkpointing",
           "reentrant": "torch.utils.checkpoint(use_reentrant=True) around each block",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False) around each block"},
    observes=("driver", "strategy", "wrapper", "precision"),
    promises=BUILDS,
    distributions=("lightning", "deepspeed"),
    # finetuning.py OPTION: the params a BaseFinetuning callback freezes before training and unfreezes at epoch 0.
    options={"finetuning_unfreezes": "globs"},
    # Lightning's DeepSpeedStrategy imports DeepSpeed, which Lightning does not install.
    needs={plugin: {"deepspeed": "deepspeed"} for plugin in BUILDS if "-deepspeed" in plugin},
)
