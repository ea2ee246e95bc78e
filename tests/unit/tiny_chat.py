"""A tiny offline Qwen3-style chat tokenizer for the multi-turn tests (nothing is downloaded).

    tok = tiny_chat_tokenizer()      # byte-level BPE + ChatML specials + a tool-calling template

Byte-level BPE over the 256-byte alphabet with a few merges (so tokenization depends on
context, as in a real BPE), ChatML special tokens (`<|im_start|>`, `<|im_end|>` = eos), the
tool-call markers as added tokens, and a Jinja chat template written here in the style of
Qwen3's: tools listed in the system turn, assistant tool calls as `<tool_call>` JSON, tool
results wrapped in `<tool_response>` inside a user turn (consecutive ones share it).
"""

from __future__ import annotations

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MERGES = [("Ċ", "Ċ"), ("Ġ", "t"), ("e", "r"), ("Ġt", "o"), ("o", "l"), ("a", "n"), ("}", "Ċ")]

TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' %}"
    "<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ '\\n' + messages[0].content }}{%- endif %}"
    "{%- if tools %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nCall a tool as <tool_call>\\n{\"name\": ..., \"arguments\": {...}}\\n</tool_call>' }}"
    "{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for call in (m.tool_calls or []) %}"
    "{%- if m.content or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _byte_symbols() -> list[str]:
    """GPT-2's printable symbol for each byte (the alphabet of byte-level BPE)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_chat_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = TEMPLATE
    return tok
