"""The plain data every layer shares: cell keys and report rows."""

import pytest

from pytest_freezecompat.core.cell import CellKey
from pytest_freezecompat.core.records import STATUSES, CellRecord, Status

KEY = CellKey("tiny-gpt", "torch", "fsdp2", "eager", "none", "embedding")


def test_a_cell_id_parses_back_into_its_key():
    assert KEY.id == "tiny-gpt/torch/fsdp2/eager/none/embedding"
    assert CellKey.parse(KEY.id) == KEY
    with pytest.raises(ValueError, match=r"is not model/framework\[@release\]/plugin/init/checkpoint/freeze"):
        CellKey.parse("tiny-gpt/torch")


def test_a_report_row_flattens_its_key_and_leaves_unset_optional_fields_out():
    row = CellRecord(key=KEY, environment="torch", world_size=2, precision="fp32", emulation=False,
                     status=Status.PASS.value, repro="pytest ...").to_json()
    assert {axis: row[axis] for axis in KEY.as_dict()} == KEY.as_dict() and row["id"] == KEY.id
    assert "key" not in row and not {"emulated", "pool_start_s", "known_issue"} & set(row)
    assert row["status"] == "pass" and STATUSES[0] == "pass"


def test_the_clip_axis_shows_in_an_id_only_where_a_cell_does_not_clip():
    unclipped = CellKey("tiny-gpt", "torch", "fsdp2", "eager", "none", "embedding", "no-clip")
    assert KEY.clip == "clip" and KEY.id == "tiny-gpt/torch/fsdp2/eager/none/embedding"  # ids published before it
    assert unclipped.id == "tiny-gpt/torch/fsdp2/eager/none/embedding/no-clip"
    assert CellKey.parse(unclipped.id) == unclipped and CellKey.parse(KEY.id).clip == "clip"


def test_a_report_row_written_before_the_clip_axis_held_a_clipped_cell():
    from pytest_freezecompat.core.records import with_later_axes

    assert with_later_axes({"id": KEY.id})["clip"] == "clip"
    assert with_later_axes({"id": "x", "clip": "no-clip"})["clip"] == "no-clip"


def test_the_release_shares_the_framework_segment_and_an_unrecorded_one_is_left_out():
    old = CellKey("tiny-gpt", "composer", "fsdp1", "eager", "none", "optimizer-subset", "no-clip", "0.23.5")
    assert old.id == "tiny-gpt/composer@0.23.5/fsdp1/eager/none/optimizer-subset/no-clip"
    assert CellKey.parse(old.id) == old and CellKey.parse(KEY.id).release == ""
    assert old.across_releases == "tiny-gpt/composer/fsdp1/eager/none/optimizer-subset/no-clip"
    assert old.selection() == ("model=tiny-gpt,framework=composer,release=0.23.5,plugin=fsdp1,init=eager,"
                               "checkpoint=none,freeze=optimizer-subset,clip=no-clip")
    assert "release" not in KEY.selection()
