"""A small vision model with BatchNorm, fine-tuned with a frozen backbone: the oldest freezing trap in vision.

`requires_grad=False` stops a BatchNorm's weight and bias, not its running statistics: in `model.train()` every
forward moves `running_mean`, `running_var` and `num_batches_tracked`, frozen or not. The fixes users apply, each a
model or pattern below: keep the frozen norms in eval (`.eval()` once before training, or a `train()` override as
mmdet's `norm_eval=True` does), swap them for `FrozenBatchNorm2d` (torchvision, Detectron2), or mean to re-estimate
the statistics (declare them trained). Plain BatchNorm under data parallelism normalises each rank's rows apart; the
reference does the same (SyncBatchNorm promises the whole batch, and runs on GPUs only).

    pytest examples/test_vision_bn.py
"""

import torch
from torch import nn

from pytest_freezecompat import freeze_case

CLASSES = 4
#: BatchNorm's statistics and counter, for a pattern that means to re-estimate them on the new data.
STATISTICS = ["*.running_mean", "*.running_var", "*.num_batches_tracked"]


class FrozenBatchNorm2d(nn.Module):
    """torchvision.ops.FrozenBatchNorm2d, as Detectron2 and torchvision's detection backbones use it: the affine
    parameters and statistics are buffers, never updated."""

    def __init__(self, channels: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((channels,), fill))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


def norm(kind: str, channels: int) -> nn.Module:
    return FrozenBatchNorm2d(channels) if kind == "frozen" else nn.BatchNorm2d(channels)


class ResBlock(nn.Module):
    def __init__(self, channels: int, kind: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = norm(kind, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = norm(kind, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class TinyConvNet(nn.Module):
    """A ResNet in miniature: a stem, residual blocks (FSDP units, activation-checkpointed one by one), a head.
    `norm_eval`: its `train()` keeps every BatchNorm in eval, as mmdet backbones' `norm_eval=True` does."""

    def __init__(self, kind: str = "batchnorm", norm_eval: bool = False, channels: int = 8) -> None:
        super().__init__()
        self.norm_eval = norm_eval
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), norm(kind, channels), nn.ReLU())
        self.blocks = nn.ModuleList([ResBlock(channels, kind), ResBlock(channels, kind)])
        self.head = nn.Linear(channels, CLASSES)

    def train(self, mode: bool = True) -> "TinyConvNet":
        super().train(mode)
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def image_batch(global_batch_size: int, step: int) -> dict[str, torch.Tensor]:
    """Deterministic per step; each rank gets its rows."""
    generator = torch.Generator().manual_seed(step)
    return {"images": torch.randn(global_batch_size, 3, 8, 8, generator=generator),
            "labels": torch.randint(0, CLASSES, (global_batch_size,), generator=generator)}


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["images"]), batch["labels"])


@freeze_case(batch=image_batch, loss=classification_loss, patterns={
    "frozen-backbone": {"trainable": ["head.*"]},                              # BN statistics drift: not frozen
    "frozen-backbone-bn-eval": {"trainable": ["head.*"], "eval": ["stem", "blocks"]},   # .eval() once, then train
    "frozen-backbone-bn-stats": {"trainable": ["head.*"], "buffers": STATISTICS},  # statistics meant to adapt
    "head-and-norms": {"trainable": ["head.*", "*.bn*.*", "stem.1.*"]},        # Lightning's train_bn=True
})
def tiny_convnet() -> nn.Module:
    return TinyConvNet()


@freeze_case(batch=image_batch, loss=classification_loss, init=["eager"], checkpoint=["none"], patterns={
    "frozen-backbone": {"trainable": ["head.*"]},
})
def tiny_convnet_norm_eval() -> nn.Module:
    return TinyConvNet(norm_eval=True)


@freeze_case(batch=image_batch, loss=classification_loss, init=["eager"], checkpoint=["none"], patterns={
    "frozen-backbone": {"trainable": ["head.*"]},
})
def tiny_convnet_frozen_bn() -> nn.Module:
    return TinyConvNet(kind="frozen")


@freeze_case(batch=image_batch, loss=classification_loss, init=["eager"], checkpoint=["none"], patterns={
    "frozen-backbone": {"trainable": ["head.*"]},
})
def tiny_convnet_syncbn() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(TinyConvNet())
