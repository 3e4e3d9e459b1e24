"""LazyInitContext: every tensor it materializes shares one autograd version counter, so a BatchNorm in train mode
breaks the backward.

What a user sees: a model with BatchNorm built under `LazyInitContext` (materialized by
`LazyInitContext.materialize(model)`, or by GeminiPlugin / HybridParallelPlugin during `booster.boost`) raises in
its first backward: "one of the variables needed for gradient computation has been modified by an inplace
operation: [torch.FloatTensor [...]] is at version N; expected version M instead" (under Gemini also "Output 1 of
PreFwdPostBwdBackward is a view and its base or another view of its base has been modified inplace"). The same
model built eagerly trains. Nothing frozen is needed: BatchNorm's own in-place update of its running statistics in
train mode is what bumps the counter.

Mechanism (colossalai/lazy/lazy_init.py, 0.3.1 to 0.5.1 and the main branch):
- `LazyTensor.__new__` builds every lazy tensor as `torch.Tensor._make_subclass(cls, _EMPTY_DATA, ...)` over one
  module-level `_EMPTY_DATA = torch.empty(0)`; `_make_subclass` shares the version counter of the tensor it wraps,
  so every LazyTensor (params and buffers alike) shares `_EMPTY_DATA`'s counter;
- `LazyTensor.materialize` -> `_convert_cls` turns the lazy tensor into a real one in place with
  `tensor.data = target`, and torch's `set_data` keeps the tensor's own version counter ("The original version of
  the `Variable` is always preserved", torch/csrc/autograd/variable.cpp, VariableHooks::set_data).
So after materializing, an in-place op on any one of them (BatchNorm's `num_batches_tracked.add_(1)` and running
mean/var update in every train-mode forward) bumps the version of all of them, and autograd's check of each param it
saved for backward (a conv or linear weight) fails.

Checks: the same model built eagerly runs forward and backward; built under LazyInitContext and materialized, an
in-place add on a BatchNorm buffer moves the Linear weight's `_version` too (the shared counter), and the backward
raises the in-place RuntimeError. REPRODUCED (exit 0) when both hold; NOT REPRODUCED (exit 1) when the lazily built
model's tensors have counters of their own and its backward runs. Anything else raises (the script is broken).

No process group, no GPU, no shim: LazyInitContext runs on CPU as shipped.

Run:
    python findings/colossalai-lazy-init-shared-version-counter.py
"""

from __future__ import annotations

import sys

import colossalai
import torch
from colossalai.lazy import LazyInitContext
from torch import nn

INPLACE_ERROR = "one of the variables needed for gradient computation has been modified by an inplace operation"


def build() -> nn.Module:
    """Two Linear + BatchNorm1d pairs: the second Linear's weight is saved for backward (its input requires grad),
    and the BatchNorm after it moves its buffers in place in the same forward."""
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))


def forward_backward(model: nn.Module) -> str | None:
    """One train-mode step's forward and backward; the RuntimeError's text if it raises."""
    model.train()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    try:
        model(x).sum().backward()
    except RuntimeError as error:
        return " ".join(str(error).split())
    return None


def main() -> int:
    print(f"colossalai {colossalai.__version__}, torch {torch.__version__}")
    torch.manual_seed(0)
    eager_error = forward_backward(build())
    print(f"eager model: backward {'raises: ' + eager_error if eager_error else 'runs'}")
    if eager_error is not None:
        raise RuntimeError(f"the eagerly built model must train: {eager_error}")

    with LazyInitContext():
        lazy = build()
    LazyInitContext.materialize(lazy)
    weight, running_mean = lazy[0].weight, lazy[1].running_mean
    before = weight._version
    with torch.no_grad():
        running_mean.add_(0.0)  # an in-place op on a BatchNorm buffer, as its train-mode forward makes
    shared = weight._version != before
    print(f"lazy model: 0.weight._version {before} -> {weight._version} after an in-place add on 1.running_mean "
          f"(expected {before}: separate tensors keep separate counters)")
    lazy_error = forward_backward(lazy)
    print(f"lazy model: backward {'raises: ' + lazy_error if lazy_error else 'runs'}")
    print("expected: the backward runs, as for the eagerly built model")

    if shared and lazy_error and INPLACE_ERROR in lazy_error:
        print("REPRODUCED: LazyInitContext's materialized params and buffers share one version counter; BatchNorm's "
              "in-place update of its statistics invalidates every saved param and the backward raises")
        return 0
    if not shared and lazy_error is None:
        print("NOT REPRODUCED: the materialized tensors keep counters of their own and the backward runs")
        return 1
    raise RuntimeError(f"unexpected state: shared counter {shared}, backward error {lazy_error!r}")


if __name__ == "__main__":
    sys.exit(main())
