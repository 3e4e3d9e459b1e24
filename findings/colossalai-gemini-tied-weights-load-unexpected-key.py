"""GeminiPlugin cannot load its own checkpoint of a model with tied weights (an output head that is the embedding).

What a user sees: `booster.save_model(model, path, shard=True)` of a GPT-2-like model whose head weight IS its
input embedding weight writes the tensor under both names, and `booster.load_model(model, path)` of the same model,
boosted afresh, raises "Error(s) in loading state_dict for GeminiDDP: Unexpected key(s) in state_dict:
"head.weight"". ColossalAI #6160 (open) reports it for Qwen2.5 with tie_word_embeddings=True on 0.4.6; PR #6447
(open) proposes the fix.

Mechanism (colossalai/zero/gemini/gemini_ddp.py, 0.3.4 to 0.5.1 and the main branch):
- `GeminiDDP.__init__` fills `self.name2param` from every module's own params (`named_parameters(recurse=False)`
  per module), so a tied tensor is listed under each of its names;
- save: `GeminiDDP.state_dict_shard` (sharded, what GeminiCheckpointIO.save_sharded_model calls) and
  `_save_to_state_dict` (unsharded) iterate `self.name2param`: both names are written, as torch's
  `Module.state_dict` does;
- load: `GeminiDDP._load_from_state_dict` (called by checkpoint_io/utils.py `load_state_dict_into_model`, and by
  `GeminiDDP.load_state_dict`) builds `local_state` from `self.named_parameters()`, which lists a shared tensor
  once, under its first name, and its strict check reports every other key as unexpected.

Checks: the saved checkpoint's keys hold both `emb.weight` and `head.weight`; loading it into the same model, boosted
afresh, raises the "Unexpected key(s)" RuntimeError naming `head.weight`. REPRODUCED (exit 0) when both hold;
NOT REPRODUCED (exit 1) when the load succeeds. Anything else raises.

Gemini needs CUDA (its chunks live on the accelerator); without one this script says SKIPPED (exit 3). The matrix
shows the failure on CPU behind its CUDA-on-CPU emulation shim. One process, gloo (NCCL on a GPU).

Run:
    python findings/colossalai-gemini-tied-weights-load-unexpected-key.py
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

UNEXPECTED = 'Unexpected key(s) in state_dict: "head.weight"'


class TiedLM(nn.Module):
    """An embedding and a head that share one weight, as GPT-2's wte and lm_head do."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def boosted(booster_cls, plugin_cls, optimizer_cls):
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = optimizer_cls(model.parameters(), lr=1e-2)  # Gemini takes HybridAdam (or FusedAdam, CPUAdam)
    # pin_memory/enable_async_reduce off: the same plugin on a GPU, and the options the CPU shim needs.
    plugin = plugin_cls(pin_memory=False, enable_async_reduce=False)
    booster = booster_cls(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def main(require_cuda: bool = True) -> int:
    if require_cuda and not torch.cuda.is_available():
        print("SKIPPED: GeminiPlugin needs CUDA (its chunks live on the accelerator); no GPU here")
        return 3
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.nn.optimizer import HybridAdam

    print(f"colossalai {colossalai.__version__}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        booster, model, _ = boosted(Booster, GeminiPlugin, HybridAdam)
        print("named_parameters():", [name for name, _ in model.unwrap().named_parameters()])
        booster.save_model(model, str(path), shard=True)
        index = next(path.glob("*.index.json"), None)
        saved = sorted(__import__("json").loads(index.read_text())["weight_map"]) if index else []
        print("saved keys:", saved)
        booster, model, _ = boosted(Booster, GeminiPlugin, HybridAdam)
        try:
            booster.load_model(model, str(path))
            error = None
        except RuntimeError as raised:
            error = " ".join(str(raised).split())
    print(f"load: {'raises RuntimeError: ' + error if error else 'succeeds'}")
    print("expected: the plugin loads the checkpoint it saved")
    dist.destroy_process_group()
    if error is not None and UNEXPECTED in error and {"emb.weight", "head.weight"} <= set(saved):
        print("REPRODUCED: Gemini saves the tied weight under both names (name2param) and its strict load "
              "(named_parameters, one name per tensor) refuses head.weight as unexpected")
        return 0
    if error is None:
        print("NOT REPRODUCED: the checkpoint of the tied model loads")
        return 1
    raise RuntimeError(f"unexpected state: saved keys {saved}, load error {error!r}")


if __name__ == "__main__":
    sys.exit(main())
