"""The generation batch built per batch and per group, not row by row: host time a fast GPU waits on (always on; the
tokens and tensors are TRL's, exactly).

TRL tokenises every copy of a group's prompt, turns each row's token list into a tensor of its own, pads the rows
with one slice assignment each (``trl.trainer.utils.pad``) and cuts each completion at its end-of-sequence token with
a boolean index per row: about two thousand small tensor operations a step at 256 completions, 8 ms of Python on this
project's CPU box every step, while the device waits (``benchmarks/step_overhead``). Here:

* each run of equal prompts (a group's ``num_generations`` copies) is tokenised once, chat template included: a
  chat template renders in Python, about as long for each copy as for the first;
* in-process generation (transformers' ``generate``; vLLM and continuous batching stay TRL's) left-pads the prompts
  into one tensor from the token lists and cuts the completions at their first end-of-sequence token with one read
  of the whole batch;
* the scoring step (``_generate_and_score_completions``) is TRL's own code, unchanged, with its ``pad`` bound to
  :func:`grpo.training.padding.pad`: the same result with one copy of all the rows instead of one per row.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Sequence

import torch
import trl
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from grpo.training.padding import pad, padded_rows


def cut_at_eos(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> list[list[int]]:
    """Each row's ids up to and including its first end-of-sequence token (all of them when it has none), read from
    the device once (ids and lengths together): TRL's mask-and-index per row, as lists, where TRL waits for the device
    twice and copies the end-of-sequence ids to it."""
    is_eos = functools.reduce(torch.logical_or, (completion_ids == token for token in eos_token_ids),
                              torch.zeros_like(completion_ids, dtype=torch.bool))
    last = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), completion_ids.size(1) - 1)
    rows = torch.cat([completion_ids, last.unsqueeze(1).to(completion_ids.dtype)], dim=1).tolist()  # one read
    return [row[: row[-1] + 1] for row in rows]


def _with_pad(function: types.FunctionType) -> types.FunctionType:
    """``function`` (TRL's code, unchanged) with the global name ``pad`` bound to :func:`pad`. Its globals are a copy
    of TRL's module namespace taken when this module is imported (TRL's module is fully imported by then)."""
    namespace = dict(function.__globals__, pad=pad)
    bound = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__,
                               function.__closure__)
    bound.__kwdefaults__, bound.__qualname__, bound.__doc__ = (function.__kwdefaults__, function.__qualname__,
                                                                function.__doc__)
    return bound


class HostBatching:
    """Mixin of :class:`grpo.training.trainer.GRPOTrainer`, next to TRL's class: TRL's generation batch with its
    tensors built per batch (see the module docstring)."""

    _generate_and_score_completions = _with_pad(trl.GRPOTrainer._generate_and_score_completions)

    def _tokenize_prompts(self, prompts: list):
        """TRL's tokenisation (chat template included) of each run of equal prompts once: a group's prompt is
        repeated ``num_generations`` times in a row. Images, multimodal fields and per-environment tool schemas
        stay TRL's, row by row."""
        if len(prompts) < 2 or self._is_vlm or self.environment_factories is not None:
            return super()._tokenize_prompts(prompts)
        distinct, rows, last = [], [], None
        for prompt in prompts:
            # equal and of equal repr: == alone holds for {"a": 1, "b": 2} and {"b": 2, "a": 1}, or for 1, 1.0 and
            # True, which a chat template renders differently (``tojson`` keeps the key order)
            key = prompt if isinstance(prompt, str) else repr(prompt)
            if not distinct or key != last or prompt != distinct[-1]:
                distinct.append(prompt)
                last = key
            rows.append(len(distinct) - 1)
        if len(distinct) == len(prompts):
            return super()._tokenize_prompts(prompts)
        ids, images, multimodal_fields = super()._tokenize_prompts(distinct)
        if images is not None or multimodal_fields:
            return super()._tokenize_prompts(prompts)
        return [list(ids[row]) for row in rows], None, {}

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if (self.use_vllm or self.use_transformers_continuous_batching or images is not None or multimodal_fields
                or has_tool_images):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        input_ids, attention_mask = padded_rows(prompt_ids, self._tokenizer.pad_token_id, "left",
                                                self.pad_to_multiple_of)
        # TRL's super()._prepare_inputs: transformers' Trainer puts the tensors on the device
        inputs = super(trl.GRPOTrainer, self)._prepare_inputs({"input_ids": input_ids,
                                                                "attention_mask": attention_mask})
        with (
            profiling_context(self, "transformers.generate"),
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            out = unwrapped_model.generate(**inputs, generation_config=self.generation_config)
        return cut_at_eos(out[:, inputs["input_ids"].size(1):], self.eos_token_ids), None


__all__ = ["HostBatching", "cut_at_eos"]
