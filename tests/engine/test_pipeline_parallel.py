"""Pipeline parallelism (trainyard.parallel.pipeline, through torch.distributed.pipelining):
the transformer cut into stages on two gloo workers trains one process's loss curve on the
same batches under GPipe, 1F1B and interleaved 1F1B (each worker holding two of four
stages), to within 1e-5 relative at every one of 50 steps: each micro-batch's summed loss
over the batch's tokens seeds its backward, so the stages add up one process's gradient. The stages' weights
end as one process's, under the whole model's names, the tied embedding and head equal on
the two workers holding them, and saved by the stages as one DCP checkpoint they load whole
into one process. A model that declares no pieces, or too few, is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pipeline_support import SCHEDULES, STEPS, model, one_process
from torch import nn

from trainyard.checkpoint.sharded import load_shards
from trainyard.parallel.pipeline import pipeline_pieces, stage_ranges

from conftest import REPO

TESTS = Path(__file__).parents[1]


@pytest.mark.distributed
def test_every_schedule_trains_the_curve_and_weights_of_one_process(tmp_path):
    one_process(tmp_path)
    env = os.environ | {"PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(TESTS / "pipeline_support.py"), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected = json.loads((tmp_path / "one.json").read_text())
    assert len(expected) == STEPS and expected[-1] < 0.6 * expected[0], expected  # it learns
    whole = torch.load(tmp_path / "one.pt", weights_only=True)
    for schedule in SCHEDULES:
        losses = json.loads((tmp_path / f"{schedule}.json").read_text())
        assert losses == pytest.approx(expected, rel=1e-5), schedule
        first, last = (
            torch.load(tmp_path / f"{schedule}-rank{rank}.pt", weights_only=True) for rank in (0, 1)
        )
        assert set(first) | set(last) == set(whole), schedule  # every name, no other
        assert set(first) & set(last) == {"tok.weight", "head.weight"}, schedule
        assert torch.equal(first["tok.weight"], last["tok.weight"]), schedule
        for name, value in (first | last).items():
            torch.testing.assert_close(value, whole[name], rtol=0, atol=1e-4, msg=name)
        # The stages' checkpoint loads whole into one process (trainyard's safe DCP reader).
        loaded = model()
        load_shards(loaded, None, tmp_path / f"{schedule}-dcp")
        for name, value in loaded.state_dict().items():
            assert torch.equal(value, (first | last)[name]), (schedule, name)
        assert loaded.head.weight is loaded.tok.weight  # still tied


def test_a_model_without_pieces_or_with_too_few_is_one_line():
    with pytest.raises(ValueError, match=r"the model \(Sequential\) declares no pipeline_stages"):
        pipeline_pieces(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="the model has 3 pipeline pieces, fewer than the 4"):
        stage_ranges(3, 4)
    assert stage_ranges(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
