"""A character-level tokenizer for local test models, and the tokenizer hash.

    from megatron_rl.models.tokenizer import build_tokenizer, tokenizer_hash
    tok = build_tokenizer()            # transformers PreTrainedTokenizerFast
    tok.encode("12+7=19")              # one id per character, no BOS added
    tokenizer_hash("/path/to/model")   # sha256 hex; the trajectory contract carries it

Fixed ids: <pad>=0, <s>=1 (bos), </s>=2 (eos), <unk>=3, then tab, newline and the 95
printable ASCII characters from space to "~" (ids 4..100).  Anything else maps to <unk>
(transformers' Qwen2 loader drops such bytes instead; ASCII text is identical in both).
Built with the `tokenizers` library (a BPE model with no merges is exactly a char
tokenizer), so `AutoTokenizer.from_pretrained(dir)` loads it with no custom code.  The
vocabulary is spelled in GPT-2 byte-level symbols (space is "\u0120", newline "\u010a")
with a ByteLevel pre-tokenizer and decoder: transformers rebuilds Qwen2 checkpoints'
tokenizers as byte-level BPE from the vocabulary, and this spelling makes that rebuild
produce the same ids as the generic loader for every ASCII string.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron_rl.config import ConfigError

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
CHARS = "\t\n" + "".join(chr(c) for c in range(32, 127))
# Files whose content defines the token <-> id mapping, in hashing order.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tokenizer():
    """The char-level tokenizer as a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbol = _byte_level_alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARS:
        vocab[byte_symbol[ord(ch)]] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable unicode symbol table (what ByteLevel pre-tokenizers emit)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 over the canonical JSON of the tokenizer files present in `model_dir`.

    JSON is re-serialised with sorted keys, so formatting and key order do not change
    the hash; any change of vocabulary, special tokens or settings does.
    """
    root = Path(model_dir)
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {root}")
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = root / name
        if not path.is_file():
            continue
        try:
            content = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        digest.update(name.encode() + b"\0")
        digest.update(json.dumps(content, sort_keys=True, separators=(",", ":")).encode() + b"\0")
    return digest.hexdigest()
