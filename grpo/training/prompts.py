"""Prompts in TRL's two dataset formats turned into the text the model reads.

A standard prompt is text; a conversational one is a list of ``{"role", "content"}`` messages, rendered with the
tokenizer's chat template and the generation prompt, as ``trl.GRPOTrainer`` renders it before generating. The warm
start, evaluation and the plan's token counts use this so that they see exactly what training sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def prompt_texts(prompts: Sequence[str | list[dict[str, str]]], tokenizer: Any,
                 tools: Sequence[Any] | None = None) -> list[str]:
    """``prompts`` as text: conversational ones through ``tokenizer``'s chat template (with the schemas of ``tools``,
    as TRL renders prompts for its tool loop), standard ones unchanged."""
    extra = {"tools": list(tools)} if tools else {}  # no tools: no argument (Llama renders tool boilerplate for [])
    return [p if isinstance(p, str) else tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False,
                                                                       **extra) for p in prompts]
