"""`benchmarks/profile_slice.py`'s summary of a py-spy raw profile: whose code each sample is in (pure, no py-spy)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "profile_slice.py"
_spec = importlib.util.spec_from_file_location("profile_slice", BENCHMARK)
profile_slice = importlib.util.module_from_spec(_spec)
sys.modules["profile_slice"] = profile_slice  # its dataclass looks its module up
_spec.loader.exec_module(profile_slice)

CONTROLLER = 'process 10:".nox/torch/bin/python -m pytest --freeze-matrix -q examples"'
RANK = 'process 11:"/x/.nox/torch/bin/python -m pytest_freezecompat.rank.template 0 adapter m"'
RANK_ROOT = (f"{CONTROLLER};{RANK};{RANK};_run_module_as_main (<frozen runpy>:198);"
             "serve (pytest_freezecompat/rank/main.py:111)")


def test_each_sample_goes_to_the_deepest_frame_outside_the_standard_library():
    roles = profile_slice.summarize([
        f"{RANK_ROOT};Tensor.backward (torch/_tensor.py:623);_engine_run_backward (torch/autograd/graph.py:979) 7\n",
        # stdlib frames below a framework's: the framework's
        f"{RANK_ROOT};DeepSpeedEngine.step (deepspeed/runtime/engine.py:1);put (queue.py:10);"
        "wait (threading.py:3) 3\n",
        f"{RANK_ROOT};to_numpy (pytest_freezecompat/rank/scenario.py:31) 2\n",
        # the rank's watchdog sleeping: not work
        f"{CONTROLLER};{RANK};{RANK};Thread.run (threading.py:982);_end_with_template.<locals>.watch "
        "(pytest_freezecompat/rank/main.py:88) 50\n",
        f"{CONTROLLER};_run_module_as_main (<frozen runpy>:198);write (pytest_freezecompat/report/write.py:37) 4\n",
        f"{CONTROLLER};_run_module_as_main (<frozen runpy>:198);select (selectors.py:415) 1\n",
        "a line that is no sample\n",
    ])
    ranks, controller = roles["ranks"], roles["controller"]
    assert ranks.samples == 12 and controller.samples == 5
    assert ranks.by_owner == {"torch": 7, "deepspeed": 3, "pytest_freezecompat": 2}
    assert ranks.our_frames == {"to_numpy (pytest_freezecompat/rank/scenario.py:31)": 2}
    assert controller.by_owner == {"pytest_freezecompat": 4, "stdlib": 1}


def test_the_tables_give_each_owners_share():
    roles = profile_slice.summarize([f"{RANK_ROOT};f (torch/x.py:1) 3\n", f"{RANK_ROOT};g (colossalai/y.py:2) 1\n"])
    text = profile_slice.tables(roles)
    assert "ranks: 4 samples" in text and "torch" in text and "75.0%" in text and "25.0%" in text
    assert "controller: 0 samples" in text
