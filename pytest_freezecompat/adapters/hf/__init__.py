"""Hugging Face Accelerate, the Transformers Trainer and PEFT: the user's own loop through `accelerator.prepare` /
`backward` / `clip_grad_norm_` under DDP, FSDP1, FSDP2 and DeepSpeed ZeRO (`accelerate-*`), and `Trainer.train()`
(`trainer-*`)."""

from ...core.declaration import AdapterDeclaration

#: The `accelerate-*` driver: a user's own training loop around `Accelerator`.
ACCELERATE_PLUGINS = ("accelerate-ddp", "accelerate-fsdp2", "accelerate-fsdp1", "accelerate-fsdp1-orig-params",
                      "accelerate-fsdp1-full-state-dict", "accelerate-fsdp1-orig-params-full-state-dict")

#: The `trainer-*` driver: `Trainer.train()` owns the loop, its optimizer and its checkpoints.
TRAINER_PLUGINS = ("trainer-ddp", "trainer-fsdp2", "trainer-fsdp2-full-state-dict", "trainer-fsdp1")

#: Accelerate's DeepSpeed path, from both drivers (`zero`): ZeRO stage 2 or 3, the user's (the Trainer's) AdamW.
ZERO_PLUGINS = ("accelerate-zero2", "accelerate-zero3", "trainer-zero2", "trainer-zero3")

#: The `trl-*` driver: TRL's SFTTrainer over a Trainer plugin's stack (plugin -> that Trainer plugin): the model as
#: built, or its base and a `peft_config` (`trl_loop.PEFT_CONFIG_PLUGINS`).
TRL_PLUGINS = {"trl-sft-ddp": "trainer-ddp", "trl-sft-ddp-peft-config": "trainer-ddp", "trl-sft-fsdp2": "trainer-fsdp2",
               "trl-sft-zero3": "trainer-zero3"}

#: What each plugin promises of the stack besides its driver (`accelerate` or `trainer`, its id's first word).
_DDP = {"wrapper": "DistributedDataParallel"}


def _fsdp2(state_dict_type: str) -> dict[str, str]:
    return {"wrapper": "FSDPModule", "distributed_type": "FSDP", "fsdp_version": "2",
            "state_dict_type": state_dict_type}


def _fsdp1(orig_params: bool, state_dict_type: str) -> dict[str, str]:
    return {"wrapper": "FullyShardedDataParallel", "distributed_type": "FSDP", "fsdp_version": "1",
            "use_orig_params": str(orig_params), "sharding_strategy": "FULL_SHARD", "state_dict_type": state_dict_type}


#: The stack each Trainer or Accelerate plugin asks for; a `trl-*` plugin asks for its Trainer twin's.
_STACKS: dict[str, dict[str, str]] = {
    "accelerate-ddp": _DDP, "trainer-ddp": _DDP,
    "accelerate-fsdp2": _fsdp2("SHARDED_STATE_DICT"), "trainer-fsdp2": _fsdp2("SHARDED_STATE_DICT"),
    "trainer-fsdp2-full-state-dict": _fsdp2("FULL_STATE_DICT"),
    "accelerate-fsdp1": _fsdp1(False, "SHARDED_STATE_DICT"),
    "accelerate-fsdp1-orig-params": _fsdp1(True, "SHARDED_STATE_DICT"),
    "accelerate-fsdp1-full-state-dict": _fsdp1(False, "FULL_STATE_DICT"),
    "accelerate-fsdp1-orig-params-full-state-dict": _fsdp1(True, "FULL_STATE_DICT"),
    "trainer-fsdp1": _fsdp1(True, "FULL_STATE_DICT"),
    **{plugin: {"wrapper": "DeepSpeedEngine", "distributed_type": "DEEPSPEED", "zero_stage": plugin[-1]}
       for plugin in ZERO_PLUGINS}}


def _driver(plugin: str) -> str:
    """Who owns the loop: the user's (`accelerate`), or a trainer's `train()` (`trainer`; an SFTTrainer is one)."""
    return "trainer" if plugin.startswith("trl-") else plugin.partition("-")[0]


def _trainer_class(plugin: str) -> dict[str, str]:
    """The trainer class whose `train()` ran (state.py reads it from the trainer's class hierarchy)."""
    if plugin.startswith("trl-"):
        return {"trainer": "SFTTrainer"}
    return {"trainer": "Trainer"} if plugin.startswith("trainer-") else {}


DECLARATION = AdapterDeclaration(
    plugins=(*ACCELERATE_PLUGINS, *TRAINER_PLUGINS, *ZERO_PLUGINS, *TRL_PLUGINS),
    init=("eager",),
    checkpoint=("none", "reentrant", "non-reentrant"),
    implementation="pytest_freezecompat.adapters.hf.adapter:HFAdapter",
    emulation="pytest_freezecompat.adapters.hf.emulation:SHIM",
    words={"accelerate-ddp": "Accelerator(cpu=True) (DDP), the user's own loop",
           "accelerate-fsdp2": "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))",
           "accelerate-fsdp1": "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)) "
                               "(its default use_orig_params=False), state_dict_type=SHARDED_STATE_DICT",
           "accelerate-fsdp1-orig-params": "Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1, "
                                           "use_orig_params=True)), state_dict_type=SHARDED_STATE_DICT",
           "accelerate-fsdp1-full-state-dict": "FullyShardedDataParallelPlugin(fsdp_version=1) with its default "
                                               "state_dict_type=FULL_STATE_DICT for save_state",
           "accelerate-fsdp1-orig-params-full-state-dict": "FullyShardedDataParallelPlugin(fsdp_version=1, "
                                                           "use_orig_params=True), state_dict_type=FULL_STATE_DICT",
           "trainer-ddp": "Trainer(args=TrainingArguments(use_cpu=True)) (DDP), train(); its own AdamW over the "
                          "params that require grad, max_grad_norm clipping and checkpoints",
           "trainer-fsdp2": "Trainer(args=TrainingArguments(fsdp='full_shard auto_wrap', fsdp_config={'version': 2, "
                            "'state_dict_type': 'SHARDED_STATE_DICT'})), train(); its own optimizer, clipping and "
                            "checkpoints (4.57.1: FSDP_STATE_DICT_TYPE, as accelerate launch exports it)",
           "trainer-fsdp1": "Trainer(args=TrainingArguments(fsdp='full_shard auto_wrap', fsdp_config={'version': 1})), "
                            "train(): its defaults use_orig_params=true and FULL_STATE_DICT; a PeftModel takes peft's "
                            "fsdp_auto_wrap_policy (the Trainer sets it)",
           "trainer-fsdp2-full-state-dict": "trainer-fsdp2 with state_dict_type FULL_STATE_DICT (transformers 5.x's "
                                            "fsdp_config default): a PeftModel saves through "
                                            "save_fsdp_model(adapter_only=True)",
           **{f"accelerate-zero{n}": f"Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...)) with ZeRO "
                                     f"stage {n}, the user's AdamW and loop; the config's gradient_clipping"
              for n in (2, 3)},
           **{f"trainer-zero{n}": f"Trainer(args=TrainingArguments(deepspeed={{'zero_optimization': {{'stage': {n}}}, "
                                  "...})), train(); its own AdamW, clipping and checkpoints (the engine's)"
              for n in (2, 3)},
           "trl-sft-ddp": "trl.SFTTrainer(model, args=SFTConfig(use_cpu=True)) (DDP), train(): the model as built "
                          "(a PeftModel passed in); SFTConfig's gradient_checkpointing as the cell's checkpoint axis",
           "trl-sft-ddp-peft-config": "trl.SFTTrainer(base_model, peft_config=LoraConfig(...)) (DDP), train(): "
                                      "SFTTrainer applies the adapter itself",
           "trl-sft-fsdp2": "trl.SFTTrainer(model, args=SFTConfig(fsdp='full_shard auto_wrap', fsdp_config={'version': "
                            "2})), train()",
           "trl-sft-zero3": "trl.SFTTrainer(model, args=SFTConfig(deepspeed={'zero_optimization': {'stage': 3}, "
                            "...})), train()",
           "eager": "model built as usual", "none": "no activation checkpointing",
           "reentrant": "torch.utils.checkpoint(use_reentrant=True) around each block",
           "non-reentrant": "torch.utils.checkpoint(use_reentrant=False) around each block"},
    # Read back after wrapping (adapters/hf/state.py `observe`): the prepared model's class, the precision it computes
    # in, accelerator.state.distributed_type and who drives the loop (the Trainer inside train() or the user's loop);
    # FSDP's version and state dict type from accelerator.state.fsdp_plugin, FSDP1's flat or original params and
    # sharding from the wrapper, ZeRO's stage from the engine. DDP's distributed type is the device's (MULTI_CPU,
    # MULTI_GPU): observed, not promised.
    observes=("wrapper", "precision", "distributed_type", "driver"),
    promises={plugin: {"driver": _driver(plugin), **_trainer_class(plugin), **_STACKS[TRL_PLUGINS.get(plugin, plugin)]}
              for plugin in (*_STACKS, *TRL_PLUGINS)},
    distributions=("accelerate", "transformers", "peft", "deepspeed"),
    # staged.py OPTION: params unfrozen once the optimizer is built.
    options={"unfreeze_after_optimizer": "globs"},
    # Every rank imports the Trainer driver (adapter.warm_up); TRL, DeepSpeed and peft (a peft_config handed to
    # SFTTrainer) only the plugins that use them (adapter.run).
    needs={plugin: {"transformers": "transformers", **({"trl": "trl"} if plugin in TRL_PLUGINS else {}),
                    **({"deepspeed": "deepspeed"} if TRL_PLUGINS.get(plugin, plugin) in ZERO_PLUGINS else {}),
                    **({"peft": "peft"} if plugin == "trl-sft-ddp-peft-config" else {})}
           for plugin in (*_STACKS, *TRL_PLUGINS)},
    # SFTTrainer reads `model.config` (a PeftModel forwards it; the peft_config plugin hands SFTTrainer its base).
    takes={plugin: (("PreTrainedModel", "PeftModel"), "trl.SFTTrainer reads model.config") for plugin in TRL_PLUGINS},
)
