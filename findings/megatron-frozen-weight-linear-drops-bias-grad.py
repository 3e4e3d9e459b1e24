"""BitFit under megatron-core: a ColumnParallelLinear whose weight is frozen never trains its bias (silent).

What a user sees: freeze every weight and train only the biases (BitFit). Training runs without a
warning, but the bias of every ColumnParallelLinear that adds its own bias (skip_bias_add=False: GPT's
`self_attention.linear_qkv` in the local layer spec) gets no gradient and Adam never moves it.

Mechanism (megatron/core/tensor_parallel/layers.py, megatron-core 0.16.1 line numbers; 0.8.0 in brackets):
- ColumnParallelLinear.forward passes `bias = self.bias if not self.skip_bias_add else None` (l. 991) to
  `_forward_impl`, which picks `linear_with_frozen_weight` when `not weight.requires_grad` (l. 949-950)
  [0.8.0: the same choice inline in forward, l. 891-892];
- LinearWithFrozenWeight.forward adds it: `output = output + bias` (l. 343) [l. 290];
- LinearWithFrozenWeight.backward returns a gradient for the input only:
  `return grad_input, None, None, None, None` (l. 357) [`grad_input, None, None, None`, l. 303].
  The bias's gradient (`grad_output` summed over the leading dims, as
  LinearWithGradAccumulationAndAsyncCommunication.backward computes `grad_bias`, l. 615 [l. 527]) is never
  returned, so autograd leaves `bias.grad` None.
Releases: run here on 0.3.0 (first with LinearWithFrozenWeight, commit d8858ee), 0.8.0 and 0.16.1 (REPRODUCED);
0.2.0 routes a frozen weight through LinearWithGradAccumulationAndAsyncCommunication and returns the bias grad.
The same backward is in the source of every release through 0.19.0 and on Megatron-LM main d98e8a6 (2026-08-22).

Checks, against plain torch on the same tensors (F.linear, weight frozen, bias trainable, one Adam step on the
bias): the forward output and the input gradient must match (the frozen path is otherwise right); the bias
gradient does not. A control run keeps the weight's requires_grad on and leaves it out of the optimizer (the
workaround read from the source): the bias then gets the reference gradient.
REPRODUCED (exit 0) only when the BitFit graph went through LinearWithFrozenWeight, output and input grad match
the reference, the bias's grad is None or all zero where the reference's is not, and the control matches.
NOT REPRODUCED (exit 1) when the bias's grad equals the reference. Any other state raises (the script is broken).

Shim: none. Nothing is replaced or patched; the CPU run uses megatron-core's own options
(ModelParallelConfig(use_cpu_initialization=True, perform_initialization=False): CPU params and no CUDA RNG
tracker; the values are copied in below), gather_output=False (the output gather allocates on CUDA) and a gloo
process group. The matrix's CUDA-on-CPU shim is not used.

Run (CPU, one gloo rank):
    python findings/megatron-frozen-weight-linear-drops-bias-grad.py
Run (GPUs, NCCL, tensor parallel 2; CPU/gloo as well when no GPU is visible):
    torchrun --nproc_per_node 2 findings/megatron-frozen-weight-linear-drops-bias-grad.py
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import package_info, parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear

SEQ, BATCH, IN_FEATURES, OUT_FEATURES = 3, 2, 4, 6  # Megatron's [s, b, h] input; OUT splits over 1 or 2 TP ranks
LR = 0.1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def autograd_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of every backward node reachable from `tensor` (which autograd.Function ran)."""
    seen, names, todo = set(), set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def fmt(t: torch.Tensor | None) -> str:
    return "None" if t is None else "[" + ", ".join(f"{v:+.4f}" for v in t.flatten().tolist()) + "]"


def megatron_step(config: ModelParallelConfig, full: dict[str, torch.Tensor], shard: slice, device: torch.device,
                  freeze_weight: bool) -> dict:
    """One forward/backward/Adam step of the layer as attention's linear_qkv builds it (gather_output=False,
    skip_bias_add=False). Each rank holds an output shard; its loss term is that shard's part of the reference's."""
    layer = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, config=config, init_method=torch.nn.init.zeros_,
                                 bias=True, gather_output=False, skip_bias_add=False).to(device)
    with torch.no_grad():
        layer.weight.copy_(full["weight"][shard])
        layer.bias.copy_(full["bias"][shard])
    layer.weight.requires_grad_(not freeze_weight)
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    x = full["x"].to(device, copy=True).requires_grad_(True)
    out, _ = layer(x)
    nodes = autograd_nodes(out)
    (out * full["grad_out"][..., shard].to(device)).sum().backward()  # the input grad is all-reduced over TP
    torch.optim.Adam([layer.bias], lr=LR).step()  # the optimizer holds the bias only (BitFit)
    return {
        "out": out.detach().cpu(), "x_grad": None if x.grad is None else x.grad.cpu(), "nodes": nodes,
        "requires_grad": {name: p.requires_grad for name, p in layer.named_parameters()},
        "grad": {name: None if p.grad is None else p.grad.cpu() for name, p in layer.named_parameters()},
        "delta": {name: (p.detach() - before[name]).abs().max().item() for name, p in layer.named_parameters()},
    }


def main() -> int:
    if "RANK" not in os.environ:  # plain `python`: one rank
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, pipeline_model_parallel_size=1)
    tag = f"[rank {rank}/{world}]"
    try:
        # The same full tensors on every rank.
        gen = torch.Generator().manual_seed(0)
        full = {"weight": torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen),
                "bias": torch.randn(OUT_FEATURES, generator=gen),
                "x": torch.randn(SEQ, BATCH, IN_FEATURES, generator=gen),
                "grad_out": torch.randn(SEQ, BATCH, OUT_FEATURES, generator=gen)}
        per_rank = OUT_FEATURES // world
        shard = slice(rank * per_rank, (rank + 1) * per_rank)

        # Reference: plain torch, weight frozen, bias trainable, one Adam step.
        ref_bias, ref_x = full["bias"].clone().requires_grad_(True), full["x"].clone().requires_grad_(True)
        ref_out = F.linear(ref_x, full["weight"], ref_bias)
        (ref_out * full["grad_out"]).sum().backward()
        torch.optim.Adam([ref_bias], lr=LR).step()
        expected = {"out": ref_out.detach()[..., shard], "x_grad": ref_x.grad,
                    "grad": {"weight": None, "bias": ref_bias.grad[shard]},
                    "delta": {"weight": 0.0, "bias": (ref_bias.detach() - full["bias"]).abs().max().item()}}

        config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                     perform_initialization=False)
        bitfit = megatron_step(config, full, shard, device, freeze_weight=True)
        # Control (the workaround read from the source): the weight keeps requires_grad, out of the optimizer.
        control = megatron_step(config, full, shard, device, freeze_weight=False)

        lines = [f"{tag} megatron-core {package_info.__version__}, torch {torch.__version__}, "
                 f"{'nccl' if cuda else 'gloo'} on {device}, TP={world}; bias shard {shard.start}:{shard.stop}"]
        runs = (("BitFit (weight frozen)", bitfit), ("control (weight requires_grad, not stepped)", control))
        for label, run in runs:
            lines.append(f"{tag} {label}: autograd path {sorted(n for n in run['nodes'] if 'Linear' in n)}")
            for name in ("weight", "bias"):
                if name == "weight" and run["requires_grad"][name]:  # computed, then left out of the optimizer
                    want, got = "present", "None" if run["grad"][name] is None else "present"
                else:
                    want, got = fmt(expected["grad"][name]), fmt(run["grad"][name])
                lines.append(f"{tag}   {name:6s} requires_grad={run['requires_grad'][name]!s:5s} "
                             f"grad expected={want} actual={got} |Δ| after one Adam step "
                             f"expected={expected['delta'][name]:.4f} actual={run['delta'][name]:.4f}")
            err = "None" if run["x_grad"] is None else f"{(run['x_grad'] - expected['x_grad']).abs().max().item():.2e}"
            lines.append(f"{tag}   input  grad max |actual - expected| = {err}; "
                         f"output max |actual - expected| = {(run['out'] - expected['out']).abs().max().item():.2e}")
        print("\n".join(lines), flush=True)

        def close(a: torch.Tensor | None, b: torch.Tensor) -> bool:
            return a is not None and torch.allclose(a, b, atol=1e-5)

        want_bias = expected["grad"]["bias"]
        got_bias = bitfit["grad"]["bias"]
        frozen_path = "LinearWithFrozenWeightBackward" in bitfit["nodes"]
        forward_ok = close(bitfit["out"], expected["out"])
        dgrad_ok = close(bitfit["x_grad"], expected["x_grad"])
        dropped = (got_bias is None or not got_bias.any()) and bool(want_bias.any())
        control_ok = close(control["grad"]["bias"], want_bias) and close(control["x_grad"], expected["x_grad"])
        if close(got_bias, want_bias):
            verdict = 1
        elif frozen_path and forward_ok and dgrad_ok and dropped and control_ok:
            verdict = 0
        else:
            raise AssertionError(f"{tag} unexpected state: frozen_path={frozen_path} forward_ok={forward_ok} "
                                 f"dgrad_ok={dgrad_ok} control_ok={control_ok} bias grad={fmt(got_bias)}")
        agreed = torch.tensor([verdict], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    if rank == 0:
        if agreed.item() == 0:
            print("REPRODUCED: with its weight frozen, ColumnParallelLinear(skip_bias_add=False) runs "
                  "LinearWithFrozenWeight, whose backward returns no bias grad: bias.grad is None and Adam leaves "
                  "the bias unchanged (plain torch: grad = grad_output summed over [s, b], |Δ| = lr), while output "
                  "and input grad match plain torch, and the bias grad does when the weight keeps requires_grad")
        else:
            print("NOT REPRODUCED: the bias of a frozen-weight ColumnParallelLinear gets the reference gradient")
    return int(agreed.item())


if __name__ == "__main__":
    sys.exit(main())
