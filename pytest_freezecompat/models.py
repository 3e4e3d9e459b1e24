"""Tiny reference models, built in code from a seed (no hub, no download).

`tiny-gpt` is GPT-shaped on purpose: token and position embeddings, a stack of
pre-norm blocks, a final norm and an output head that is *not* tied to the
embedding, so that every freeze pattern of the matrix names a distinct set of
parameters. Optional features exist only for the patterns that need them:
LoRA adapters on the attention projections, a vision branch that a
text-only batch never reaches, and experts that each rank's rows reach apart
(`experts`, `experts-unequal`, `dense`: see `TinyGPT._experts`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_MODES = ("none", "reentrant", "non-reentrant")


@dataclass(frozen=True)
class TinyGPTConfig:
    vocab: int = 64
    dim: int = 16
    heads: int = 2
    layers: int = 3
    seq: int = 8
    lora_rank: int = 0
    vision: bool = False
    vision_dim: int = 12
    experts: int = 0
    experts_unequal: bool = False
    dense: bool = False


class LoRALinear(nn.Module):
    """A frozen-able base projection plus a trainable low-rank update (as peft does)."""

    def __init__(self, in_features: int, out_features: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_a = nn.Parameter(torch.empty(rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(out_features, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # FSDP1 calls this when it materializes a meta module; lora_b is small but
        # non-zero so that lora_a gets a real gradient from the first step.
        nn.init.normal_(self.lora_a, std=0.02)
        nn.init.normal_(self.lora_b, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _linear(cfg: TinyGPTConfig, fan_in: int, fan_out: int, lora: bool) -> nn.Module:
    return LoRALinear(fan_in, fan_out, cfg.lora_rank) if lora and cfg.lora_rank else nn.Linear(fan_in, fan_out)


class Expert(nn.Module):
    """One expert's update (added to its rows' stream by the model); `hidden` sets its params' shapes."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = _linear(cfg, cfg.dim, 3 * cfg.dim, lora=True)
        self.proj = _linear(cfg, cfg.dim, cfg.dim, lora=True)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.fc2 = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    #: Block classes a sharding wrapper should wrap one by one (the Hugging Face convention).
    _no_split_modules = ("Block",)

    def __init__(self, cfg: TinyGPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        if cfg.experts:
            # Unequal shapes make the ranks' packed grads differ in size (a loud mismatch); equal ones let a collective
            # that packs only the grads a rank holds pair one expert's grad with another's without noticing.
            self.experts = nn.ModuleList(Expert(cfg.dim, cfg.dim * (1 + index if cfg.experts_unequal else 1))
                                         for index in range(cfg.experts))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        if cfg.vision:
            self.vision = nn.Sequential(
                nn.Linear(cfg.vision_dim, cfg.dim), nn.GELU(), nn.Linear(cfg.dim, cfg.dim)
            )
        self.checkpoint_mode = "none"

    def set_activation_checkpointing(self, mode: str) -> None:
        """Checkpoint every block the way Hugging Face models do it (inside forward)."""
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {mode!r}; valid: {', '.join(CHECKPOINT_MODES)}")
        self.checkpoint_mode = mode

    def forward(self, tokens: torch.Tensor, pixels: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        if pixels is not None and self.cfg.vision:
            x = x + self.vision(pixels).unsqueeze(1)
        for block in self.blocks:
            if self.checkpoint_mode == "none":
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.checkpoint_mode == "reentrant")
        if self.cfg.experts:
            x = self._experts(x, tokens)
        return self.head(self.ln_f(x))

    def _experts(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Each row goes to the expert its first token names. Sparse, an expert that got no rows is skipped (as
        transformers 4.x's Mixtral block did), so a rank whose rows all reach one expert leaves the other out of its
        graph; `dense` runs every expert on every row and masks the outputs (the recipe: every expert in the graph)."""
        route = tokens[:, 0] % self.cfg.experts
        out = x
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if self.cfg.dense:
                out = out + chosen.to(x.dtype)[:, None, None] * expert(x)
                continue
            rows = chosen.nonzero().flatten()
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]))
        return out


NORM_WEIGHT = re.compile(r"(^|\.)(ln[^.]*|[^.]*norm[^.]*)\.weight$|norm_weight$", re.IGNORECASE)


def deterministic_values(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    """Values for one parameter that depend only on (seed, name, shape).

    Any rank, any device and any init order produce the same numbers, so eager,
    meta and lazy init can be compared and a sharded model can fill its shard.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") % (2**63))
    if NORM_WEIGHT.search(name):  # norms scale activations: near 1, or grads vanish and Adam amplifies noise
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return 0.05 * torch.randn(shape, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    for name, param in model.named_parameters():
        param.copy_(deterministic_values(seed, name, param.shape).to(param.device, param.dtype))


MODELS = {"tiny-gpt": TinyGPT}


#: The optional parts a freeze pattern's `features` may ask for.
FEATURES = ("lora", "vision", "experts", "experts-unequal", "dense")
#: How many experts the `experts` features build (each rank's rows reach one of them at world size 2).
N_EXPERTS = 2


def config(features: Collection[str] = ()) -> TinyGPTConfig:
    """The tiny GPT's config with a pattern's features."""
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown model feature(s) {', '.join(unknown)}; valid: {', '.join(FEATURES)}")
    experts = "experts" in features or "experts-unequal" in features
    if "dense" in features and not experts:
        raise ValueError("feature 'dense' runs the experts densely: ask for 'experts' or 'experts-unequal' too")
    return TinyGPTConfig(lora_rank=4 if "lora" in features else 0, vision="vision" in features,
                         experts=N_EXPERTS if experts else 0, experts_unequal="experts-unequal" in features,
                         dense="dense" in features)


def build(model_id: str, *, seed: int, features: Collection[str] = (),
          device: str | torch.device | None = None, initialize: bool = True) -> nn.Module:
    """Build a reference model with a pattern's `features`; `device="meta"` builds it without storage (deferred
    init)."""
    if model_id not in MODELS:
        raise KeyError(f"unknown model {model_id!r}; known: {', '.join(MODELS)}")
    cfg = config(features)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = MODELS[model_id](cfg)
    if initialize and device != "meta":
        init_weights(model, seed)
    return model


def make_batches(model_id: str, *, seed: int, steps: int, global_batch: int,
                 features: Collection[str] = ()) -> list[dict[str, torch.Tensor]]:
    """A fixed global batch per step; every rank takes its own rows of it. With experts, row i's first token routes
    it to expert `i * experts // global_batch`: each rank's contiguous rows (`adapters.base.rows_of`) reach one expert
    at world size 2, another than the other rank's, in the same step."""
    cfg = config(features)
    generator = torch.Generator().manual_seed(seed + 7919)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab, (global_batch, cfg.seq + 1), generator=generator)
        if cfg.experts:
            tokens[:, 0] = torch.arange(global_batch) * cfg.experts // global_batch
        batches.append({"tokens": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()})
    return batches


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def apply_checkpointing(model: nn.Module, mode: str) -> None:
    """Activation checkpointing through the model's own switch (ours, or Hugging Face's), else around each of its
    blocks (`block_modules`) with `torch.utils.checkpoint`, as a user without a switch writes it."""
    if hasattr(model, "set_activation_checkpointing"):
        model.set_activation_checkpointing(mode)
    elif hasattr(model, "gradient_checkpointing_enable"):
        if mode != "none":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    elif mode != "none":
        blocks = block_modules(model)
        if not blocks:
            raise ValueError(f"{type(model).__name__} has no activation-checkpointing switch "
                             "(set_activation_checkpointing or gradient_checkpointing_enable) and no blocks")
        for block in blocks:  # the forward is replaced, not wrapped in a module: parameter names stay the model's
            block.forward = functools.partial(_checkpointed, block.forward, mode == "reentrant")


def _checkpointed(forward: Callable[..., Any], reentrant: bool, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=reentrant, **kwargs)


def blocks_of(model: nn.Module) -> tuple[str, ...]:
    """A model's repeated blocks by class name: its `_no_split_modules` (Hugging Face's), else the classes its largest
    `nn.ModuleList` holds (a stack of layers); () where it has neither."""
    declared = tuple(getattr(model, "_no_split_modules", None) or ())
    if declared:
        return declared
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return ()
    largest = max(lists, key=len)
    return tuple(dict.fromkeys(type(m).__name__ for m in largest))


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks a sharding wrapper wraps one by one, from `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]
