"""Single-turn prompts in a chat template (data.chat_template; megatron_rl/data/chat.py): `auto` wraps them in
the tokenizer's own template exactly as `tokenizer.apply_chat_template` does and says so, falls back to raw
text for a tokenizer without one; `none`, `plain` and a .jinja file do what they say; the dry run shows one
rendered prompt and its token count.

    python -m pytest tests/unit/test_prompt_chat.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError
from megatron_rl.data.dataset import PromptTemplate
from megatron_rl.data.tasks import load_task
from megatron_rl.envs.chat_format import PLAIN_TEMPLATE
from megatron_rl.envs.example import Example
from megatron_rl.models.tokenizer import build_tokenizer
from megatron_rl.train.config import load_train_config
from tests.unit.tiny_chat import tiny_chat_tokenizer

pytestmark = pytest.mark.unit

EX = Example(id="1", question="What is 2+2?", answer="4")


def _apply(tok, text, template=None):
    out = tok.apply_chat_template([{"role": "user", "content": text}], chat_template=template,
                                  add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


def test_auto_uses_the_tokenizers_own_template_exactly_as_transformers_renders_it():
    tok = tiny_chat_tokenizer()
    tmpl = PromptTemplate("Q: {question}", chat="auto")
    ids = tmpl.encode(EX, tok)
    assert ids == _apply(tok, "Q: What is 2+2?")
    assert tok.decode(ids).startswith("<|im_start|>user\nQ: What is 2+2?<|im_end|>")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert "own chat template" in tmpl.describe(tok)


def test_auto_without_a_template_is_raw_text_and_says_so():
    tok = build_tokenizer()  # the tiny models' character tokenizer: no chat template
    tmpl = PromptTemplate("{question}=", chat="auto")
    assert tmpl.encode(EX, tok) == PromptTemplate("{question}=").encode(EX, tok)
    assert "no chat template" in tmpl.describe(tok)


def test_none_plain_and_a_jinja_text_do_what_they_say():
    tok = tiny_chat_tokenizer()
    raw = PromptTemplate("{question}", chat="none").encode(EX, tok)
    assert raw == [int(i) for i in tok("What is 2+2?")["input_ids"]]
    plain = PromptTemplate("{question}", chat="plain").encode(EX, tok)
    assert plain == _apply(tok, "What is 2+2?", PLAIN_TEMPLATE)
    assert tok.decode(plain) == "U: What is 2+2?\nA: "
    own = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
    assert tok.decode(PromptTemplate("{question}", chat=own).encode(EX, tok)) == "<<What is 2+2?>>=>"


def test_the_config_takes_a_jinja_file_and_refuses_anything_else(tmp_path):
    jinja = tmp_path / "mine.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    cfg = load_train_config(None, ["model.tiny.arch=llama", f"data.chat_template={jinja}"])
    assert cfg.data.chat_template == str(jinja)
    _, template = load_task(cfg.data)
    assert template.chat == jinja.read_text()
    assert load_train_config(None, ["model.tiny.arch=llama"]).data.chat_template == "auto"
    for bad in ("chatml", str(tmp_path / "missing.jinja"), str(tmp_path)):
        with pytest.raises(ConfigError, match="data.chat_template must be one of"):
            load_train_config(None, ["model.tiny.arch=llama", f"data.chat_template={bad}"])


def test_the_dry_run_shows_one_rendered_prompt_and_its_token_count(tmp_path):
    from megatron_rl.train.dry_run import check_and_plan

    cfg = load_train_config(None, ["model.tiny.arch=llama", f"run.dir={tmp_path}", "data.chat_template=plain"])
    prompt = check_and_plan(cfg)["data"]["prompt"]
    assert prompt["text"].startswith("U: ") and prompt["text"].endswith("\nA: ")
    assert prompt["tokens"] == len(build_tokenizer()(prompt["text"], add_special_tokens=False)["input_ids"])
    assert prompt["chat_template"] == "the plain chat template"
