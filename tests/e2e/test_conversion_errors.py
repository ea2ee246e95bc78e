"""Bad input to the converter: a clear error naming the problem, and nothing written.

    python -m pytest tests/e2e/test_conversion_errors.py -q

All checks happen before any rank is spawned, so these run in-process and fast.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from megatron_rl.conversion.hf_io import atomic_output_dir
from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf
from megatron_rl.models.tiny import make_tiny_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("src") / "hf", arch="qwen2", seed=1)


@pytest.fixture
def hf(tiny, tmp_path):
    return shutil.copytree(tiny, tmp_path / "hf")


def edit_config(hf, **changes):
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def assert_nothing_written(out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_missing_and_corrupt_config(hf, tmp_path):
    out = tmp_path / "out"
    (hf / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        convert_hf_to_mcore(hf, out)
    (hf / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        convert_hf_to_mcore(hf, out)
    assert_nothing_written(out)


def test_unsupported_architecture(hf, tmp_path):
    edit_config(hf, architectures=["MistralForCausalLM"])
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_missing_and_corrupt_safetensors(hf, tmp_path):
    st = hf / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"corrupt safetensors file .*model.safetensors"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    st.unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_shape_mismatch_against_config(hf, tmp_path):
    edit_config(hf, intermediate_size=384)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight.*\(352, 128\).*\(384, 128\)"):
        convert_hf_to_mcore(hf, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("tp,pp,msg", [(3, 1, "num_heads 4"), (4, 1, "num_kv_heads 2"), (1, 3, "num_layers 2")])
def test_layout_that_does_not_divide(hf, tmp_path, tp, pp, msg):
    with pytest.raises(ValueError, match=msg):
        convert_hf_to_mcore(hf, tmp_path / "out", tp=tp, pp=pp)
    assert_nothing_written(tmp_path / "out")


def test_existing_output_refused_and_untouched(hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert_hf_to_mcore(hf, out)
    with pytest.raises(FileExistsError, match="--force"):
        convert_mcore_to_hf(hf, out)
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1


def test_megatron_dir_without_manifest(hf, tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        convert_mcore_to_hf(hf, tmp_path / "out")
    assert_nothing_written(tmp_path / "out")


def test_interrupted_write_leaves_no_directory(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out) as tmp:
            (tmp / "weights").mkdir()
            raise KeyboardInterrupt
    assert_nothing_written(out)
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, force=True) as tmp:
            (tmp / "new").write_text("new")
            raise RuntimeError("crash")
    assert sorted(p.name for p in out.iterdir()) == ["old"]  # the old dir survives a failed --force
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_cli_reports_error_and_exit_code(hf, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "convert", "hf-to-mcore", "--hf", str(hf),
                           "--out", str(tmp_path / "out"), "--tp", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "error: num_heads 4 is not divisible by tensor parallel size 3" in proc.stderr
    assert_nothing_written(tmp_path / "out")
