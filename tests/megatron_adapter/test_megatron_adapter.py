"""The Megatron adapter's parts in one process: the CUDA-on-CPU shim, plugin ids, the reference
mirror against a real GPTModel, and where Megatron DDP puts a grad (param.main_grad)."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.distributed as dist
from conftest import ShimProbe

from pytest_freezecompat import models
from pytest_freezecompat.adapters.megatron import DECLARATION, compat
from pytest_freezecompat.adapters.megatron import adapter as mg
from pytest_freezecompat.adapters.megatron.emulation import SHIM, TO_CPU

CPU = torch.device("cpu")


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the shim hides on a CPU-only torch")


def test_plugin_ids_carry_the_parallel_layout() -> None:
    assert mg.parse_plugin("megatron-ddp-tp2") == mg.Layout("megatron-ddp", tp=2, pp=1)
    assert mg.parse_plugin("megatron-ddp-distopt-pp2") == mg.Layout("megatron-ddp-distopt", tp=1, pp=2)
    assert mg.parse_plugin("torch-ddp-tp1") == mg.Layout("torch-ddp", tp=1, pp=1)
    with pytest.raises(ValueError, match="no plugin 'fsdp'"):
        mg.parse_plugin("fsdp")
    assert all(mg.parse_plugin(plugin) for plugin in DECLARATION.plugins)


@NO_CUDA
def test_shim_redirects_cuda_only_while_engaged_and_restores_everything() -> None:
    rng = torch.get_rng_state()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.ones(2, device="cuda")
    probe = ShimProbe()
    with SHIM.apply(None, probe, CPU):
        assert not probe.emulated_patches  # reported when it engages, not up front
        assert torch.ones(2, device="cuda").device.type == "cpu"
        assert probe.emulated_patches == [TO_CPU]
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"
        assert torch.zeros(2).cuda().device.type == "cpu"
        assert torch.zeros(2).to("cuda").device.type == "cpu"
        assert torch.zeros(2).type() == "torch.cuda.FloatTensor"  # what Megatron's optimizers assert on
        torch.rand(3)  # moves the CPU generator, which the shim restores
    assert torch.zeros(2).type() == "torch.FloatTensor"
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group with Megatron's parallel state, inside the shim (Megatron needs both)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with SHIM.apply(None, ShimProbe(), CPU):
            mg.ps.initialize_model_parallel(1, 1)
            mg.tensor_parallel.model_parallel_cuda_manual_seed(1)
            try:
                yield
            finally:
                mg.ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()


def _filled_gpt(seed: int) -> tuple[mg.GPTModel, dict[str, str]]:
    config = mg.TransformerConfig(num_layers=mg.LAYERS, hidden_size=mg.HIDDEN, num_attention_heads=mg.HEADS,
                                  hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                                  pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True)
    model = mg.GPTModel(config, mg.get_gpt_layer_local_spec(), vocab_size=mg.VOCAB, max_sequence_length=mg.SEQ)
    names = mg.global_names(model)
    mg.fill_deterministic(model, names, mg.partition_dims(model), seed)
    return model, names


def test_reference_mirror_has_gptmodels_names_and_computes_its_loss(one_rank_group: None) -> None:
    gpt, names = _filled_gpt(seed=5)
    mirror, loss_of = mg.MegatronAdapter().reference_model(None)
    assert list(names.values()) == [n for n, _ in mirror.named_parameters()]
    models.init_weights(mirror, 5)  # the same values: eager init depends only on (seed, name, shape)
    batch = models.make_batches("mcore-gpt", seed=3, steps=1, global_batch=2)[0]
    positions = torch.arange(mg.SEQ).expand_as(batch["tokens"])
    megatron_loss = gpt(batch["tokens"], positions, None, labels=batch["targets"]).mean()
    torch.testing.assert_close(megatron_loss, loss_of(mirror, batch), rtol=1e-5, atol=1e-6)


def test_megatron_ddp_grad_lives_in_main_grad_and_the_view_reads_it(one_rank_group: None) -> None:
    gpt, names = _filled_gpt(seed=5)
    gpt.embedding.word_embeddings.weight.requires_grad_(False)
    ddp = mg.DistributedDataParallel(gpt.config, mg.DistributedDataParallelConfig(), gpt)
    batch = models.make_batches("mcore-gpt", seed=3, steps=1, global_batch=2)[0]
    positions = torch.arange(mg.SEQ).expand_as(batch["tokens"])
    ddp(batch["tokens"], positions, None, labels=batch["targets"]).mean().backward()
    ddp.finish_grad_sync()
    fc1 = gpt.decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.grad is None and fc1.main_grad.abs().sum() > 0  # Megatron moved it into the grad buffer
    assert not hasattr(gpt.embedding.word_embeddings.weight, "main_grad")  # frozen before wrap: no buffer
    view = mg._View(gpt, names, mg.partition_dims(gpt), ddp, None, mg.parse_plugin("megatron-ddp-tp1"))
    grads = view.full_grads()
    assert view.grad_access.startswith("param.main_grad")
    assert torch.equal(grads["decoder.layers.0.mlp.linear_fc1.weight"], fc1.main_grad)
    assert grads["embedding.word_embeddings.weight"] is None


def test_compat_calls_megatron_under_this_releases_spelling(one_rank_group: None) -> None:
    norm = compat.grad_norm_fp32([torch.tensor([3.0, 4.0])], mg.ps.get_model_parallel_group())
    assert float(norm) == pytest.approx(5.0)
    gpt, _ = _filled_gpt(seed=5)
    ddp = mg.DistributedDataParallel(gpt.config, mg.DistributedDataParallelConfig(), gpt)
    config = mg.OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1)
    optimizers = compat.chained_optimizers(compat.megatron_optimizer(config, [ddp]))
    groups = [g for opt in optimizers for g in opt.optimizer.param_groups]
    # weight decay on biases and norms too, as the reference's plain AdamW
    assert {g["weight_decay"] * g.get("wd_mult", 1.0) for g in groups} == {0.1}
    assert sum(len(g["params"]) for g in groups) == len(list(gpt.parameters()))
