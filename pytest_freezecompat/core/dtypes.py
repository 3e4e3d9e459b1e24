"""The dtypes a user's model holds its own params in, as the row states them.

A frozen base loaded in bf16 beside fp32 adapters (PEFT's LoRA default) is the model's own choice, not the stack's
precision: the cell's precision axis stays its mixed-precision config, and the row says what the model held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: The relative spacing of a stored value (one ulp of its magnitude, at most): a trained param kept in that dtype
#: rounds each update to it, so two correct runs may sit this far apart per step.
STORAGE_ULP = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10}


def precision(dtypes: Mapping[str, str]) -> str:
    """The dtypes as a precision reads (`bf16+fp32`); `fp32` for a model with no float params of its own."""
    return "+".join(sorted(set(dtypes.values()))) or "fp32"


def own_low_precision(dtypes: Mapping[str, str]) -> bool:
    """The model holds some params in a dtype narrower than fp32."""
    return any(name in STORAGE_ULP for name in dtypes.values())


def summary(dtypes: Mapping[str, str], trainable: Iterable[str]) -> str:
    """`bf16 frozen, fp32 trained`: the dtypes of the frozen params, then of the trained ones."""
    trains = set(trainable)
    parts = {"frozen": {d for n, d in dtypes.items() if n not in trains},
             "trained": {d for n, d in dtypes.items() if n in trains}}
    return ", ".join(f"{'+'.join(sorted(found))} {what}" for what, found in parts.items() if found)
