"""GeminiPlugin's model checkpoint rounds the fp32 master weights to bf16 once a frozen branch makes the chunk sharded.

What a user sees: a model with a frozen part (requires_grad=False, e.g. an idle vision tower) trained under
GeminiPlugin in bf16, saved with `booster.save_model` and resumed with `booster.load_model`, resumes with fp32
master weights that are the bf16 roundings of the saved ones: near 1.0 (a LayerNorm weight) they move by up to
half a bf16 ulp (3.9e-3), so the resumed run no longer continues the uninterrupted one. No error, no warning.
The same model without the frozen part resumes exactly.

Mechanism (colossalai/zero/gemini, identical in 0.4.7 and 0.5.0):

1. `init_chunk_manager` -> `search_chunk_configuration` (chunk/search_utils.py) sizes the chunks *before*
   `GeminiDDP._init_chunks` marks params with requires_grad=False as ignored, so the frozen branch counts in
   `group_acc_size`; when the trainable params alone are below `min_chunk_size_m` but trainable + frozen are not,
   the chunk that holds the trainable params is `keep_gathered=False` (sharded) instead of one gathered chunk:

       if group_acc_size < min_chunk_size:
           config_dict[dp_degree] = dict(chunk_size=group_acc_size, keep_gathered=True)

2. `GeminiDDP._get_chunk_to_save_data` (save_model / state_dict_shard) reads the fp32 master chunk with
   `get_temp_total_chunk_on_cuda(chunk, self.mixed_precision)` (zero/gemini/utils.py), which returns a gathered
   chunk as it is (fp32) but casts a sharded one to the compute dtype (`shard_temp.to(dtype)`): the file holds bf16.
3. `GeminiDDP._load_from_state_dict` copies the loaded values into the fp32 master chunk through the same bf16
   temporary and then into the bf16 chunk, so the masters are bf16 values; the optimizer checkpoint holds no
   masters to restore them.

Gemini needs CUDA (its chunks live on the accelerator; HybridAdam's fused kernel is CUDA); on a machine without
one this script says SKIPPED. The matrix shows the same on CPU only behind its CUDA-on-CPU emulation shim.
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

#: Chunks of at least 5120 elements: the trainable part (4288) alone stays below it, trainable + frozen (8448) not.
MIN_CHUNK_SIZE_M = 5120 / 2**20


class TextAndVision(nn.Module):
    """`text` and `norm` are trained on every batch; `vision` (frozen when present) is never reached."""

    def __init__(self, vision: bool) -> None:
        super().__init__()
        self.text = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.vision = nn.Linear(64, 64) if vision else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.text(x))


def masters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 master weights Gemini keeps in its fp32 chunks, by name, gathered in fp32."""
    from colossalai.zero.gemini.utils import get_temp_total_chunk_on_cuda

    manager, out = model.chunk_manager, {}
    for p, fp32 in zip(model.fp16_params, model.fp32_params):
        chunk = manager.get_chunk(fp32)
        info = chunk.tensors_info[fp32]
        total = get_temp_total_chunk_on_cuda(chunk, torch.float32)
        out[model.param2name[p]] = total[info.offset:info.end].view(fp32.shape).detach().float().cpu().clone()
    return out


def boosted(vision: bool, **plugin_options):
    from colossalai.accelerator import get_accelerator
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin
    from colossalai.nn.optimizer import HybridAdam

    torch.manual_seed(0)
    model = TextAndVision(vision)
    if model.vision is not None:
        model.vision.requires_grad_(False)
    optimizer = HybridAdam([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    plugin = GeminiPlugin(placement_policy="static", precision="bf16", max_norm=0.0,
                          min_chunk_size_m=MIN_CHUNK_SIZE_M, search_range_m=0, **plugin_options)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer, get_accelerator().get_current_device()


def round_trip(vision: bool, **plugin_options) -> tuple[float, bool, str, bool]:
    """One step, save_model, a fresh boosted model, load_model: (max |master after - master saved|, whether the
    masters after load are exactly the bf16 roundings of the saved ones, the dtype in the file, keep_gathered)."""
    booster, model, optimizer, device = boosted(vision, **plugin_options)
    keep_gathered = model.chunk_manager.get_chunk(model.fp32_params[0]).keep_gathered
    torch.manual_seed(1)
    loss = model(torch.randn(8, 64, device=device, dtype=torch.bfloat16)).float().pow(2).mean()
    booster.backward(loss, optimizer)
    optimizer.step()  # the masters now hold fp32 values no bf16 can (they start as bf16 values at boost)
    optimizer.zero_grad()
    saved = masters(model)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "model"
        booster.save_model(model, str(path), shard=True)
        files = {k: v for f in sorted(path.glob("*.bin"))
                 for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}
        file_dtype = str(files["norm.weight"].dtype)
        fresh, fresh_model, _, _ = boosted(vision, **plugin_options)
        fresh.load_model(fresh_model, str(path))
    loaded = masters(fresh_model)
    diff = max(float((loaded[n] - saved[n]).abs().max()) for n in saved)
    rounded = all(torch.equal(loaded[n], saved[n].bfloat16().float()) for n in saved)
    return diff, rounded, file_dtype, keep_gathered


def check(**plugin_options) -> int:
    import colossalai

    diff, rounded, dtype, kept = round_trip(vision=True, **plugin_options)
    print(f"colossalai {colossalai.__version__}")
    print(f"frozen branch:    chunk keep_gathered={kept}, norm.weight saved as {dtype}, "
          f"max |master after load - saved| = {diff:.2e}, bf16 roundings of the saved masters: {rounded}")
    c_diff, _, c_dtype, c_kept = round_trip(vision=False, **plugin_options)
    print(f"no frozen branch: chunk keep_gathered={c_kept}, norm.weight saved as {c_dtype}, "
          f"max |master after load - saved| = {c_diff:.2e}")
    if diff > 1e-4 and rounded and c_diff == 0.0:
        print(f"REPRODUCED: with a frozen branch in the model, save_model/load_model round the trainable params' "
              f"fp32 masters to bf16 (max change {diff:.1e}); without it they come back exactly")
        return 0
    print("NOT REPRODUCED: the fp32 masters came back as they were saved")
    return 1


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIPPED: needs CUDA (GeminiPlugin keeps its chunks on the CUDA device and HybridAdam steps them with "
              "its fused CUDA kernel; the matrix runs it on CPU only behind an emulation shim)")
        return 3
    with socket.socket() as sock:  # one process: a free port on this host
        sock.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(sock.getsockname()[1]))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    return check()


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(code)
