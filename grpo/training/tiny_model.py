"""A tiny character-level policy built entirely offline: tokenizer from ``tokenizers``, Qwen2 from a config.

This is what makes the default run work on a laptop with no network: nothing is downloaded, everything is built from
code and cached on disk by :mod:`grpo.training.policy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

if TYPE_CHECKING:
    from datasets import DatasetDict
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of ``alphabet`` plus pad/bos/eos; decoding concatenates characters."""
    chars = sorted(set(alphabet))
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS)
    fast.padding_side = "left"  # generation pads prompts on the left
    return fast


# What a tokenizer built by build_char_tokenizer saves as its class: a generic fast tokenizer over its tokenizer.json.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _is_char_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer build_char_tokenizer made: a generic fast tokenizer over a word-level
    model (one token per character)."""
    config, spec = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config.is_file() and spec.is_file()):
        return False
    if json.loads(config.read_text()).get("tokenizer_class") not in _GENERIC_TOKENIZER_CLASSES:
        return False
    return json.loads(spec.read_text()).get("model", {}).get("type") == "WordLevel"


def load_tokenizer_from(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained``, except for a saved tiny tokenizer (:func:`_is_char_tokenizer`), loaded as
    exactly what was saved, padding on the left as built. A byte-level BPE tokenizer saved the same generic way (the
    tests' own chat models) still gets the class its model's config names, as before.

    transformers 5's ``AutoTokenizer`` picks the class from the model's ``config.json`` (``qwen2``) and rebuilds
    Qwen2's byte-level pipeline over the saved vocabulary: that tokenizer drops spaces (``error: off|`` became
    ``error:off|``) and counts one token more than the vocabulary, so every cached or trained tiny policy tokenised
    text with spaces (environment observations, tool results) unlike the one the warm start trained."""
    if _is_char_tokenizer(Path(name_or_path)):
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(name_or_path))
        tokenizer.padding_side = "left"
        return tokenizer
    return AutoTokenizer.from_pretrained(str(name_or_path))


def build_tiny_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    seed: int,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized for CPU; deterministic for a given seed."""
    import torch

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def alphabet_of(ds: DatasetDict) -> str:
    """Every character that occurs in prompts or answers: the tiny tokenizer's vocabulary."""
    chars: set[str] = set()
    for split in ds.values():
        for col in ("prompt", "answer"):
            for text in split[col]:
                chars.update(text if isinstance(text, str) else "".join(m["content"] for m in text))
    return "".join(sorted(chars))
