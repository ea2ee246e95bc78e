"""Fuzz (hypothesis) of the config files and dotted overrides: bad input gets a ValueError naming it.

    python -m pytest tests/unit/test_fuzz_config.py -q

`load_train_config(path, overrides)` reads YAML a user wrote and `key.path=value` strings from
the command line.  Damaged YAML text of a real recipe, arbitrary YAML documents, and real
keys (or near misses) overridden with arbitrary YAML values must either load or raise a
ValueError (ConfigError for what the loader itself finds, a ValueError naming the field from a
section's checks); never a TypeError, KeyError, AttributeError, RecursionError, a raw YAML
error or a hang.
"""

import dataclasses

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from megatron_rl.config import ConfigError, read_config_data
from megatron_rl.train.config import load_train_config
from tests.e2e.conftest import TINY
from tests.unit.fuzz_common import FUZZ, JSON_VALUES, mutate

pytestmark = pytest.mark.unit


def _keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        yield key
        if dataclasses.is_dataclass(value):
            yield from _keys(value, key + ".")


KEYS = sorted(set(_keys(load_train_config(TINY)))) + ["run", "nope", "run.nope", "run..steps", ".x", "a.b.c"]
YAML_TEXT = st.one_of(st.text(max_size=30), JSON_VALUES.map(lambda v: yaml.safe_dump(v, default_flow_style=True)),
                      st.sampled_from(["", "[", "{a: 1", "!!python/object:os.system x", "&a [*a]", ".nan", "-.inf",
                                       "1e400", "0x1F", "~", "'", "- - - 1", "{? [1]: 2}", "*undefined"]))


def load(path, overrides=()):
    """The contract: a TrainConfig or a ValueError with a message; raw YAML errors are not ValueErrors."""
    try:
        return load_train_config(path, list(overrides))
    except ValueError as err:
        assert str(err) and not isinstance(err, UnicodeDecodeError), repr(err)
        return None


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), YAML_TEXT), min_size=1, max_size=3))
def test_overrides_of_real_keys(items):
    load(TINY, [f"{k}={v}" for k, v in items])


@FUZZ
@given(st.lists(st.text(max_size=20), min_size=1, max_size=3))
def test_arbitrary_override_strings(items):
    try:
        read_config_data(TINY, items)
    except ConfigError:
        return
    load(TINY, items)


@FUZZ
@given(st.data())
def test_damaged_recipe_file(tmp_path_factory, data):
    blob = TINY.read_bytes()
    for _ in range(data.draw(st.integers(1, 3))):
        blob = mutate(blob, data)
    path = tmp_path_factory.getbasetemp() / "fuzz_recipe.yaml"
    path.write_bytes(blob)
    try:
        read_config_data(path)
    except ConfigError as err:
        assert str(path) in str(err)
        return
    load(path)


@FUZZ
@given(JSON_VALUES)
def test_arbitrary_yaml_document(tmp_path_factory, doc):
    path = tmp_path_factory.getbasetemp() / "fuzz_doc.yaml"
    path.write_text(yaml.safe_dump(doc))
    load(path)


# ------------------------------------------------------------------ regressions (found by the fuzz)

@pytest.mark.parametrize("overrides, match", [
    (["run.steps=["], "run.steps"),  # yaml.ParserError escaped apply_overrides
])
def test_override_regressions(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_train_config(TINY, overrides)


def test_a_bare_number_for_a_text_field_is_its_digits():
    """run.dir=5 once reached Path(5) (a TypeError in load_train_config); a text field given a number now takes
    its digits (YAML reads `cpu_cores: 0` or a directory named 5 as a number)."""
    cfg = load_train_config(TINY, ["run.dir=5", "learner.cpu_cores=0"])
    assert str(cfg.run.dir) == "5" and cfg.learner.cpu_cores == "0"
    with pytest.raises(ConfigError, match="run.dir"):
        load_train_config(TINY, ["run.dir=[1]"])


@pytest.mark.parametrize("text, match", [
    (b"run: {steps: 3}\n\xff\xfe", "UTF-8"),  # UnicodeDecodeError named no file
    (b"1: 2\nrun: {steps: 3}\n", "unknown config key"),  # sorted() of int and str keys: TypeError
    (b"[" * 2000 + b"]" * 2000, "nested"),  # the YAML composer recursed past the interpreter's limit
])
def test_file_regressions(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_train_config(path)
    assert str(path) in str(info.value) or match == "unknown config key"
