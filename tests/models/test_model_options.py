"""Options belong to their model: switching model.name with -S leaves params.yaml's options
(written for its mlp) out, so a README command needs no `model.options={}`."""

from __future__ import annotations

import pytest

from trainyard.runs.record import load_record
from trainyard.storage import Store

from conftest import trainyard_cli

LINE = "the quick brown fox jumps over the lazy dog\n"


@pytest.mark.slow
def test_switching_to_the_transformer_trains_without_an_options_workaround(project, use_store):
    (project / "data/raw").mkdir(parents=True, exist_ok=True)
    (project / "data/raw/corpus.txt").write_text(LINE * 40, "utf-8")
    switch = ["-S", "model.name=transformer", "-S", "task.name=language_model",
              "-S", "data.path=data/raw/corpus.txt", "-S", "data.context=16",
              "-S", "train.workers=1", "-S", "tracking.backend=none"]  # fmt: skip
    done = trainyard_cli(
        "run", "--run-id", "switched", *switch, "-S", "train.epochs=1", cwd=project
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "model.name=transformer: params.yaml's model.options for mlp left out "
        "(hidden_sizes, dropout)" in done.stderr
    )
    record = load_record(Store(use_store), "switched")
    assert record.status == "completed"
    assert record.params["model"] == {"name": "transformer", "options": {}}

    # An option given for the new model is still checked against its factory.
    refused = trainyard_cli("run", *switch, "-S", "model.options.hidden_sizes=[8]", cwd=project)
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = [line for line in refused.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "Traceback" not in refused.stderr
    assert error[0].startswith("trainyard: error: model.options = {'hidden_sizes': [8]}")
    assert "unexpected keyword argument 'hidden_sizes'" in error[0]
