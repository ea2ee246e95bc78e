"""run_manifest.json records what produced a run and refuses a resume with other inputs."""

from __future__ import annotations

import json

import pytest

from megatron_rl.run_manifest import NAME, close_run, model_identity, open_run

pytestmark = pytest.mark.unit

IDENTITY = {"model": "m1", "tokenizer_hash": "t1", "dataset_version": "d1", "grader_version": "g1"}


def test_manifest_records_code_inputs_and_machine(tmp_path):
    open_run(tmp_path, kind="train", identity=IDENTITY, config_hash="c", resuming=False)
    close_run(tmp_path)
    m = json.loads((tmp_path / NAME).read_text())
    attempt = m["attempts"][0]
    assert m["identity"] == IDENTITY and attempt["config_hash"] == "c"
    assert attempt["versions"]["torch"] and attempt["versions"]["megatron-core"] == "0.16.1"
    assert set(attempt["git"]) == {"commit", "dirty"} and attempt["hardware"]["cpus"] >= 1
    assert attempt["started_at"] <= attempt["ended_at"]


@pytest.mark.parametrize("field", ["model", "tokenizer_hash", "dataset_version", "grader_version"])
def test_resume_with_other_inputs_is_refused_naming_the_field(tmp_path, field):
    open_run(tmp_path, kind="train", identity=IDENTITY, config_hash="c", resuming=False)
    with pytest.raises(ValueError, match=f"its {field} was '{IDENTITY[field]}', now 'other'"):
        open_run(tmp_path, kind="train", identity={**IDENTITY, field: "other"}, config_hash="c", resuming=True)
    open_run(tmp_path, kind="train", identity=IDENTITY, config_hash="c2", resuming=True)
    assert len(json.loads((tmp_path / NAME).read_text())["attempts"]) == 2
    open_run(tmp_path, kind="train", identity={**IDENTITY, field: "other"}, config_hash="c", resuming=False)
    assert json.loads((tmp_path / NAME).read_text())["identity"][field] == "other"  # a fresh run starts over


def test_model_identity_follows_content_not_location(tmp_path):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "config.json").write_text('{"hidden_size": 8}')
    assert model_identity(tmp_path / "a") == model_identity(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text('{"hidden_size": 16}')
    assert model_identity(tmp_path / "a") != model_identity(tmp_path / "b")
