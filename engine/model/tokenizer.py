"""Tokenizers without torch: the `tiny` model's byte tokenizer, and the tokenizer of a model
name or directory loaded the way a router needs it (no weights, no libtorch mapped).

transformers' tokenizer classes import without torch; `AutoTokenizer` does not (it imports
the model configs, which import torch). So a directory's tokenizer is loaded through the
class its `tokenizer_config.json` names, and through `AutoTokenizer` only when it names none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

TINY_NAME = "tiny"
BOS, EOS, PAD, END_OF_TURN = "<|bos|>", "<|eos|>", "<|pad|>", "<|end_of_turn|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, END_OF_TURN)  # ids 256.. after the 256 bytes
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "<|end_of_turn|>\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that the ByteLevel pre-tokenizer uses."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: token id = byte value; specials 256..259; a plain chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 256)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[END_OF_TURN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def named_tokenizer_class(path: Path) -> type | None:
    """The transformers class `tokenizer_config.json` names, None when it names none (or
    one this transformers lacks)."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return getattr(transformers, name, None) if isinstance(name, str) else None


def load_tokenizer_of(name_or_path: str) -> Any:
    """The tokenizer `load_model(name_or_path)` would load, without the weights (a router
    renders prompts as its replicas do)."""
    from engine.model.dummy import dummy_shape, dummy_tokenizer_dir
    from engine.model.files import ModelLoadError, load_tokenizer
    from engine.model.gguf import BUILTINS, gguf_model_dir

    if name_or_path == TINY_NAME:
        return byte_tokenizer()
    if dummy_shape(name_or_path) is not None:
        directory = dummy_tokenizer_dir()
        return load_tokenizer(directory, named_tokenizer_class(directory))
    if (converted := gguf_model_dir(name_or_path)) is not None:
        return load_tokenizer(converted[0], named_tokenizer_class(converted[0]))
    if Path(name_or_path).is_dir():
        return load_tokenizer(Path(name_or_path), named_tokenizer_class(Path(name_or_path)))
    names = ", ".join([TINY_NAME, *BUILTINS, "dummy:NAME"])
    raise ModelLoadError(
        f"{name_or_path!r} is not a model: use {names}, a .gguf file or a model directory"
    )
