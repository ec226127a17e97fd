"""The scripted tool task of ``env_concurrency`` and ``agent_concurrency``: the tiny preset's policy shape over a
character tokenizer, the ids of a tool call (``[k]``) and of the answer (``v`` then end-of-sequence), and a slow
``lookup`` tool, so that every episode makes every call whatever an untrained model samples."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class ToolTask:
    tokenizer: Any
    model: Any
    gen: dict[str, Any]
    """``sample_round``'s generation settings."""
    call: list[int]
    """A tool call's ids (``[k]``); ``k_id`` is in no other text of the task."""
    k_id: int
    answer: list[int]
    lookup: Callable[[str], str]


def tool_task(gen_tokens: int, tool_s: float) -> ToolTask:
    from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer("0123456789+=[]|()kv:<>")
    model = build_tiny_qwen2(tok, 128, 3, 4, 256, 256, seed=0).eval()
    gen = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "max_new_tokens": gen_tokens,
           "temperature": 1.0, "top_p": 1.0, "top_k": 0, "shared_prompt": False}
    call = tok("[k]", add_special_tokens=False)["input_ids"]

    def lookup(key: str) -> str:
        """A slow tool: a remote call's latency.

        Args:
            key: what to look up
        """
        time.sleep(tool_s)
        return "v"

    answer = tok("v", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return ToolTask(tok, model, gen, call, call[1], answer, lookup)
