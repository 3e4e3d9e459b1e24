"""Dropout judged as data parallelism draws it: each rank's rows replayed from the generator state that rank drew its
masks from, grads averaged (pytester-style scratch project, real 2-rank CPU runs; `unreplayable` and
`resumed_states` alone)."""

import json

import numpy as np
import pytest
import torch
from own_project import run_project

from pytest_freezecompat.core.records import RankRecord, ResumeFacts, StepFacts
from pytest_freezecompat.rank.scenario import resumed_states, unreplayable

MODEL = '''
import torch
import torch.distributed as dist
from torch import nn

from pytest_freezecompat import freeze_case


class Tagger(nn.Module):
    """Embedding, a dropout-0.1 MLP block and a classifier. `skew`: each rank draws rank + 1 numbers while it is
    built, so the ranks' generators part before the first step."""

    def __init__(self, skew=False):
        super().__init__()
        if skew and dist.is_initialized():
            torch.rand(dist.get_rank() + 1)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 8))
        self.classifier = nn.Linear(8, 3)

    def forward(self, tokens):
        x = self.emb(tokens)
        return self.classifier(x + self.block(x))


def batch(global_batch_size, step):
    generator = torch.Generator().manual_seed(step)
    return {"tokens": torch.randint(0, 16, (global_batch_size, 6), generator=generator),
            "tags": torch.randint(0, 3, (global_batch_size, 6), generator=generator)}


def loss(model, b):
    return nn.functional.cross_entropy(model(b["tokens"]).flatten(0, 1), b["tags"].flatten())


STACK = dict(frameworks=["torch"], plugins=["ddp", "fsdp2"], init=["eager"], checkpoint=["none"])


@freeze_case(batch=batch, loss=loss, patterns={"head-only": {"trainable": ["classifier.*"]}}, **STACK)
def tagger():
    return Tagger()


@freeze_case(batch=batch, loss=loss, patterns={"head-only": {"trainable": ["classifier.*"]}}, **STACK)
def skewed():
    return Tagger(skew=True)
'''


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One run of the project's cells for the module: model/plugin/pattern -> its row."""
    project = tmp_path_factory.mktemp("dropout")
    (project / "test_mine.py").write_text(MODEL)
    run_project(project, "--freeze-matrix-report=report")
    cells = json.loads((project / "report" / "matrix.json").read_text())["cells"]
    return {f"{row['model']}/{row['plugin']}/{row['freeze']}": row for row in cells if row["clip"] == "clip"}


@pytest.mark.parametrize("plugin", ["ddp", "fsdp2"])
@pytest.mark.parametrize("pattern", ["none", "head-only"])
def test_dropout_under_data_parallelism_is_judged_per_rank_not_silent(rows, plugin, pattern):
    row = rows[f"tagger/{plugin}/{pattern}"]
    assert (row["status"], row["severity"], row.get("unchecked")) == ("pass", "ok", None), row["message"]
    assert any("block.2 (Dropout p=0.1)" in note and "replayed" in note for note in row["notes"])


def test_ranks_that_drew_apart_are_unproven_with_the_reason(rows):
    row = rows["skewed/ddp/none"]
    assert (row["status"], row["severity"]) == ("pass", "unproven")
    assert "randomness" in row["unchecked"]
    assert any("rank 1 drew step 0's masks from another generator state" in note for note in row["notes"])


def _steps(*forwards: int, rows: int = 2, on_cpu: bool = True) -> list[StepFacts]:
    state = torch.get_rng_state().numpy()
    return [StepFacts(rng=state if on_cpu else None, forwards=count, rows=rows) for count in forwards]


def test_a_step_is_replayable_only_as_one_data_parallel_ranks_single_cpu_loss():
    assert unreplayable(_steps(1, 1), 2, 2) is None
    assert "stack's own forward" in unreplayable(_steps(1, 0), 2, 2)
    assert "micro-batches" in unreplayable(_steps(1, 2), 2, 2)
    assert "accelerator" in unreplayable(_steps(1, on_cpu=False), 2, 2)
    assert "tensor or pipeline" in unreplayable(_steps(1, rows=4), 2, 2)


def test_the_round_trip_replays_the_resumed_runs_states_only_where_they_differ():
    record = RankRecord(rank=0, steps=_steps(1, 1, 1))
    rng = [torch.from_numpy(step.rng) for step in record.steps]
    record.resume = ResumeFacts(saved_after=0, steps=[StepFacts(), *_steps(1, 1)])
    assert resumed_states(record, rng) is None  # the stack restored the generator
    other = torch.Generator().manual_seed(1).get_state().numpy()
    record.resume.steps[2].rng = other
    states = resumed_states(record, rng)
    assert states is not None and np.array_equal(states[2].numpy(), other) and torch.equal(states[1], rng[1])
