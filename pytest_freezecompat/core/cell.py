"""A matrix cell: its key, and everything a rank needs to run it.

The cell is the one message that crosses from the controller to the ranks, so
it is plain data (dataclasses of str/int/float/tuples) and knows nothing of
pytest or of any framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .freeze import FreezePattern
from .names import ID_SEPARATOR, KEY_AXES, LATER_AXES, RELEASE_SEPARATOR

#: The id's segments: the release shares the framework's (`composer@0.23.5`), the clip is shown only as `no-clip`.
_SEGMENTS = ("model", "framework", "plugin", "init", "checkpoint", "freeze", "clip")


@dataclass(frozen=True, order=True)
class CellKey:
    model: str
    framework: str
    plugin: str
    init: str
    checkpoint: str
    freeze: str
    clip: str = LATER_AXES["clip"]
    #: The framework's version in the cell's environment: the same cell on two releases is two cells.
    release: str = LATER_AXES["release"]

    @property
    def id(self) -> str:
        """`model/framework@release/plugin/init/checkpoint/freeze`, then `/no-clip` where the cell does not clip."""
        values = self.as_dict()
        if self.release:
            values["framework"] += RELEASE_SEPARATOR + self.release
        return ID_SEPARATOR.join(values[axis] for axis in _SEGMENTS if values[axis] != LATER_AXES.get(axis))

    @property
    def across_releases(self) -> str:
        """The id without the release: what the same cell is called on every release of its framework."""
        return CellKey(**{**self.as_dict(), "release": ""}).id

    def as_dict(self) -> dict[str, str]:
        return {axis: getattr(self, axis) for axis in KEY_AXES}

    def selection(self) -> str:
        """`axis=value,...` for `--freeze-matrix-select`: exactly this cell (an unrecorded release is left out)."""
        return ",".join(f"{axis}={value}" for axis, value in self.as_dict().items() if value)

    @classmethod
    def parse(cls, cell_id: str) -> CellKey:
        """The inverse of `id`; a ValueError names what is wrong."""
        parts = cell_id.split(ID_SEPARATOR)
        if len(parts) not in (len(_SEGMENTS) - 1, len(_SEGMENTS)):
            raise ValueError(f"cell id {cell_id!r} is not model/framework[@release]/plugin/init/checkpoint/freeze"
                             "[/no-clip]")
        values = dict(zip(_SEGMENTS, parts))
        values["framework"], _, values["release"] = values["framework"].partition(RELEASE_SEPARATOR)
        return cls(**values)


@dataclass(frozen=True)
class Hyper:
    """Pinned training hyperparameters; weight decay > 0 so a spurious zero grad moves a param."""

    lr: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    #: 0 turns clipping off (the cell's `clip` axis is `no-clip`), as ColossalAI, Megatron and DeepSpeed spell it.
    max_norm: float = 1.0
    steps: int = 2
    seed: int = 1234
    batch_per_rank: int = 2

    @property
    def clips(self) -> bool:
        return self.max_norm > 0


@dataclass(frozen=True)
class UserModel:
    """A user's own model, by importable references (`module:qualname`) that rank processes resolve.

    factory() -> nn.Module; batch(global_batch_size, step) -> dict of tensors split by rows
    across ranks; loss(model, batch) -> scalar tensor.
    """

    factory: str
    batch: str
    loss: str
    #: The class names of the model's repeated blocks: FSDP makes each a unit, activation checkpointing wraps each
    #: (`freeze_case(blocks=...)`, else the model's `_no_split_modules`, else what its largest ModuleList holds).
    blocks: tuple[str, ...] = ()

    @property
    def modules(self) -> set[str]:
        """The modules its functions live in (a rank template imports them before it forks ranks)."""
        return {ref.partition(":")[0] for ref in (self.factory, self.batch, self.loss)}


@dataclass(frozen=True)
class Cell:
    key: CellKey
    environment: str
    adapter: str  # `module:Class` of the adapter's implementation
    world_size: int
    device: str
    pattern: FreezePattern
    groups: dict[str, tuple[str, ...]]
    precision: str = "fp32"
    emulation: bool = False
    #: `module:name` of the adapter's CUDA-on-CPU shim, set when a rule asks for emulation.
    shim: str | None = None
    options: dict[str, object] = field(default_factory=dict)
    hyper: Hyper = field(default_factory=Hyper)
    skip: str | None = None
    known_issue: str | None = None
    user_model: UserModel | None = None
    tolerance: dict[str, float] = field(default_factory=dict)
    #: Tests only: a param the round trip leaves out of what it loads, proving the `resume` check catches it.
    break_load: str | None = None
    #: The cells of one round-trip group take the same save -> load path (`spec.matrix.Framework.round_trip`): the
    #: first one to judge it runs it, the others cite that cell (`round_trip_of`) and their ranks skip theirs.
    round_trip: str = ""
    round_trip_of: str | None = None
    #: The stack this cell's name promises (`AdapterDeclaration.promised`), and the facts its adapter reports once
    #: it has wrapped: the verdict compares them with what the ranks observed (`verdict.stack`).
    promised_stack: dict[str, str] = field(default_factory=dict)
    observes: tuple[str, ...] = ()
    #: Whose installed versions the ranks record (the framework's and its companions', torch always).
    distributions: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return self.key.id

    @property
    def adapter_module(self) -> str:
        """What a rank imports ahead of its first cell (the pool preloads it)."""
        return self.adapter.partition(":")[0]
