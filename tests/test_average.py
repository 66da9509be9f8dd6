"""Averaging draft checkpoints (training/average.py): the weighted mean of every tensor, refused for drafts
of different shapes, and a checkpoint the exporter reads."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from dflash.exporters.draft import export_draft
from dflash.exporters.draft_checkpoint import make_tiny_draft
from dflash.training.average import average_checkpoints, main


@pytest.fixture(scope="module")
def two_drafts(tmp_path_factory, tiny_target_src):
    root = tmp_path_factory.mktemp("soup")
    a = make_tiny_draft(root / "a", tiny_target_src, kind="dspark", markov_rank=4, seed=1)
    b = make_tiny_draft(root / "b", tiny_target_src, kind="dspark", markov_rank=4, seed=2)
    return root, a, b


def test_the_average_is_the_weighted_mean_of_every_tensor_and_exports(two_drafts):
    root, a, b = two_drafts
    out = average_checkpoints([a, b], root / "avg", weights=[0.25, 0.75])
    wa, wb, avg = (load_file(str(p / "model.safetensors")) for p in (a, b, out))
    assert set(avg) == set(wa) and any(not np.array_equal(wa[n], wb[n]) for n in wa)
    for name, value in avg.items():
        assert value.dtype == wa[name].dtype
        expected = (0.25 * wa[name].astype(np.float32) + 0.75 * wb[name].astype(np.float32)).astype(value.dtype)
        np.testing.assert_array_equal(value, expected)
    assert json.loads((out / "config.json").read_text()) == json.loads((a / "config.json").read_text())
    assert json.loads((out / "average.json").read_text())["weights"] == [0.25, 0.75]
    exported = export_draft(out, root / "avg-ov")
    assert (exported / "openvino_model.xml").is_file()


def test_drafts_of_other_shapes_or_bad_weights_are_refused(two_drafts, tiny_target_src, capsys):
    root, a, b = two_drafts
    deeper = make_tiny_draft(root / "deeper", tiny_target_src, kind="dspark", markov_rank=4, seed=1, num_layers=3)
    with pytest.raises(ValueError, match="config.json differ"):
        average_checkpoints([a, deeper], root / "bad")
    with pytest.raises(ValueError, match="summing to 1"):
        average_checkpoints([a, b], root / "bad", weights=[0.5, 0.6])
    assert main([str(root / "bad"), str(a)]) == 2
    assert "at least two" in capsys.readouterr().err
