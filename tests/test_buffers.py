"""A user's model judged as it really trains: its buffers (BatchNorm's statistics) are state, `train()` is called
before stepping, plain BatchNorm under data parallelism is judged against each rank's rows (pytester, real 2-rank
CPU runs; `held_buffers` alone)."""

import json
import subprocess

import pytest
from own_project import run_project

from pytest_freezecompat.core.freeze import held_buffers

MODEL = '''
import torch
from torch import nn

from pytest_freezecompat import freeze_case


class Net(nn.Module):
    """A conv backbone with BatchNorm and a head. `norm_eval`: its own train() keeps every BatchNorm in eval."""

    def __init__(self, norm_eval=False):
        super().__init__()
        self.norm_eval = norm_eval
        self.backbone = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.head = nn.Linear(4, 3)

    def train(self, mode=True):
        super().train(mode)
        if mode and self.norm_eval:
            for module in self.modules():
                if isinstance(module, nn.BatchNorm2d):
                    module.eval()
        return self

    def forward(self, images):
        return self.head(self.backbone(images).mean((2, 3)))


def batch(global_batch_size, step):
    generator = torch.Generator().manual_seed(step)
    return {"images": torch.randn(global_batch_size, 3, 4, 4, generator=generator),
            "labels": torch.randint(0, 3, (global_batch_size,), generator=generator)}


def loss(model, b):
    return nn.functional.cross_entropy(model(b["images"]), b["labels"])


STACK = dict(frameworks=["torch"], plugins=["ddp"], init=["eager"], checkpoint=["none"])


@freeze_case(batch=batch, loss=loss, patterns={"head-only": {"trainable": ["head.*"]},
                                                "head-only-bn-eval": {"trainable": ["head.*"], "eval": ["backbone"]},
                                                "head-only-stats": {"trainable": ["head.*"],
                                                                    "buffers": ["*.running_*", "*.num_batches_*"]}},
             **STACK)
def plain_bn():
    return Net()


@freeze_case(batch=batch, loss=loss, patterns={"head-only": {"trainable": ["head.*"]}}, **STACK)
def norm_eval():
    return Net(norm_eval=True)


@freeze_case(batch=batch, loss=loss, patterns={"head-only": {"trainable": ["head.*"]}}, **STACK)
def sync_bn():
    return nn.SyncBatchNorm.convert_sync_batchnorm(Net())
'''


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    """One run of the project's 12 cells for the module (~15 s): model/pattern -> its row."""
    project = tmp_path_factory.mktemp("buffers")
    (project / "test_mine.py").write_text(MODEL)
    result = run_project(project, "--freeze-matrix-report=report", "-rs")
    rows = json.loads((project / "report" / "matrix.json").read_text())["cells"]
    return result, {f"{row['model']}/{row['freeze']}": row for row in rows}


def test_a_frozen_backbone_in_train_mode_is_silent_and_names_its_buffers(report):
    _, cells = report
    cell = cells["plain-bn/head-only"]
    assert cell["severity"] == "silent" and cell["check"] == "buffers"
    assert "backbone.1.running_mean" in cell["message"] and "backbone.1.num_batches_tracked" in cell["message"]
    assert [f["kinds"] for f in cell["failures"]] == [["held-buffer-moved"]]  # the grads and weights held


def test_a_models_own_train_override_keeps_frozen_norms_and_is_ok(report):
    _, cells = report
    assert cells["norm-eval/head-only"]["severity"] == "ok"


def test_eval_once_before_training_and_declared_statistics_are_ok(report):
    _, cells = report
    assert cells["plain-bn/head-only-bn-eval"]["severity"] == "ok"
    assert cells["plain-bn/head-only-stats"]["severity"] == "ok"


def test_plain_batchnorm_under_ddp_with_nothing_frozen_is_judged_per_rank(report):
    _, cells = report
    control = cells["plain-bn/none"]
    assert control["severity"] == "ok"
    assert any("each rank's 2 rows through the model alone" in note for note in control["notes"])
    assert any("rank 1's buffers differ from rank 0's" in note for note in control["notes"])


def test_syncbatchnorm_on_cpu_is_skipped_with_the_reason(report):
    result, cells = report
    assert {cells[f"sync-bn/{p}"]["severity"] for p in ("none", "head-only")} == {"skipped"}
    assert "SyncBatchNorm needs CUDA ranks" in result.stdout


def test_a_buffer_glob_that_names_nothing_is_a_collection_error(tmp_path):
    (tmp_path / "test_mine.py").write_text(MODEL.replace('"*.num_batches_*"', '"*.num_batches_seen"'))
    done = run_project(tmp_path, "--collect-only", "-q")
    assert done.returncode != 0
    assert "buffers glob '*.num_batches_seen' matches no buffer of the model" in done.stdout + done.stderr


def test_held_buffers_are_a_frozen_modules_unless_declared_trained():
    owners = {"bn.running_mean": ("bn.weight", "bn.bias"), "frozen_bn.running_mean": ("stem.weight",),
              "head_bn.running_mean": ("head_bn.weight",), "orphan.count": ()}
    assert held_buffers(owners, {"head_bn.weight"}, ()) == ("bn.running_mean", "frozen_bn.running_mean")
    assert held_buffers(owners, {"head_bn.weight"}, ("bn.*",)) == ("frozen_bn.running_mean",)
    assert held_buffers(owners, {"bn.weight", "stem.weight", "head_bn.weight"}, ()) == ()
