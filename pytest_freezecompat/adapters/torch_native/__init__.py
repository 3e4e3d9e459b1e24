"""PyTorch's own wrappers (DDP, FSDP1, FSDP2): the adapter to copy when adding a framework."""

from ...core.declaration import AdapterDeclaration

DECLARATION = AdapterDeclaration(
    plugins=("ddp", "ddp-find-unused", "fsdp1", "fsdp1-orig-params", "fsdp2"),
    init=("eager", "meta"),
    checkpoint=("none", "reentrant", "non-reentrant"),
    implementation="pytest_freezecompat.adapters.torch_native.adapter:TorchAdapter",
)
