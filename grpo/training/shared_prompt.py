"""``async.shared_prompt_forward``: the prompt's forward runs once per group, not once per completion, in the
log-prob forward (training and the old/IS log-probs) and in generation's prefill.

GRPO samples ``num_generations`` completions of every prompt, and TRL's log-prob forward runs prompt + completion for
each of them, so a group's prompt goes through the model ``num_generations`` times with identical results. Here the
backbone runs each distinct prompt once (keeping its keys/values), the cache is indexed out to the rows that share the
prompt, and the completions run on top of it (the shared-prefix forward of Prefix Grouper, arXiv 2506.05433). The
prompt's activations get the sum of their completions' gradients, exactly as with the repeated forward.

It is exact: positions, padding and the attention mask are TRL's (the prompt width of the batch, left padding, the
completions continuing at the same positions), and TRL's own fused LM head scores the result, so log-probs, entropies
and gradients equal the repeated forward's up to float summation order (tests/test_shared_prompt.py, and the
invariant matrix on 2 processes). On the tiny preset a prompt is ~7 tokens and a completion <= 4, so it removes more
than half of the training forward/backward's tokens; on long prompts (GSM8K's ~150 tokens vs ~200-token answers)
the share is the prompt's share of a sequence times (1 - 1/num_generations).

How: the trainer calls ``model(input_ids, attention_mask, labels, fused_lm_head=True)`` through DDP/PEFT wrappers as
always (one DDP forward), and for that call only the backbone's ``forward`` is swapped for :func:`_shared_forward`,
which returns the hidden states the LM head scores (and, for a MoE model, every layer's router logits: the prompt's
indexed out to its rows like its keys/values, so TRL's load-balancing aux loss is the repeated forward's). Where it
does not apply it calls the backbone as TRL does: a model whose cache cannot be shared (recurrent-state layers:
Mamba / linear attention; :func:`grpo.training.model_support.unsupported` decides per model), no prompt repeated in
the rows, multimodal or extra model inputs, gradient checkpointing (no cache while training); the reason is logged
once.

Generation (:func:`shared_prompt_prefill`, TRL's in-process generate and the CPU async generator) does the same for
the prefill: the distinct prompts fill the cache, which is indexed out to the rows before the first token is sampled;
the logits are the same, so are the random draws.
"""

from __future__ import annotations

import contextlib

import torch

from grpo.training.model_support import SHARED_PROMPT_FORWARD, applies, backbone, say_once

# Keyword arguments TRL's fused forward and PEFT's wrapper pass whatever their value; any other must be None/False.
# ``output_router_logits`` is reproduced: the prompt's router logits are indexed out to its rows (_rows_out).
_PASSED_THROUGH = {"use_cache", "return_dict", "output_router_logits"}


def _distinct_rows(*columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of ``columns`` side by side: the index of each distinct row's first occurrence (``first``), and
    for every row the number of its distinct row (``inverse``), so that row ``first[inverse[i]]`` equals row ``i``."""
    key = torch.cat(columns, 1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.size(0), device=key.device)
    first = torch.full((distinct.size(0),), key.size(0), device=key.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def _rows(tensor: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``tensor[inverse]`` along the rows, by ``index_select``. Its backward (``index_add``) sums each prompt's
    completions' gradients in one order; advanced indexing's (``index_put_`` accumulating) sums them in whatever order
    the CPU's threads finish, so two runs of one seed drifted apart from their second step (last bits of the
    gradients, then whole accuracy points after 50 steps: the same preset ended at 0.964 and 0.974)."""
    return tensor.index_select(0, inverse)


def _select_cache_rows(cache, inverse: torch.Tensor) -> None:
    """Each row gets its prompt's keys/values (differentiable, by :func:`_rows`). A cache layer with more state than
    keys and values (sliding windows, indexers) selects its rows itself, as transformers does."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.get_seq_length() > 0:
            layer.keys, layer.values = _rows(layer.keys, inverse), _rows(layer.values, inverse)
        else:
            layer.batch_select_indices(inverse)


def _only_neutral(kwargs: dict) -> bool:
    """No keyword argument asks the backbone for more than hidden states and a cache (see ``_PASSED_THROUGH``)."""
    return all(v in (None, False) for k, v in kwargs.items() if k not in _PASSED_THROUGH)


def _rows_out(per_token: torch.Tensor, inverse: torch.Tensor, width: int) -> torch.Tensor:
    """A router's logits for the distinct rows (``(distinct * width, experts)``, token-major as the routers flatten
    them) indexed out to every row: ``(rows, width, experts)``."""
    return _rows(per_token.reshape(-1, width, per_token.size(-1)), inverse)


def _router_logits(head, tail, inverse: torch.Tensor, distinct: int, prompt_width: int) -> tuple | None:
    """Every layer's router logits for the full rows (prompt + completion, flattened token-major as the repeated
    forward's), from the ``distinct`` prompts' (``head``) and the completions' (``tail``); ``None`` where the routers'
    outputs do not have that shape (the caller then runs the full forward)."""
    heads, tails = getattr(head, "router_logits", None), getattr(tail, "router_logits", None)
    if heads is None or tails is None or len(heads) != len(tails):
        return None
    rows, completion_width = tail.last_hidden_state.shape[:2]
    if any(h.dim() != 2 or h.size(0) != distinct * prompt_width or t.dim() != 2 or t.size(0) != rows * completion_width
           for h, t in zip(heads, tails)):
        return None
    return tuple(torch.cat([_rows_out(h, inverse, prompt_width), t.reshape(rows, completion_width, -1)], 1)
                 .flatten(0, 1) for h, t in zip(heads, tails))


def _shared_forward(original, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_width: int, **kwargs):
    """The backbone's output for ``input_ids`` (prompt of ``prompt_width`` columns + completion) with each distinct
    prompt computed once, and the number of distinct prompts; ``None`` where it does not apply (the caller then runs
    the full forward). With ``output_router_logits`` (TRL's MoE aux loss) the output carries every layer's router
    logits for all rows and positions, as the repeated forward's does."""
    if not _only_neutral(kwargs) or not 0 < prompt_width < input_ids.size(1):
        return None
    first, inverse = _distinct_rows(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    if first.size(0) == input_ids.size(0):
        return None
    routers = {"output_router_logits": True} if kwargs.get("output_router_logits") else {}
    head = original(input_ids=input_ids[first, :prompt_width], attention_mask=attention_mask[first, :prompt_width],
                    use_cache=True, **routers)
    cache = head.past_key_values
    if cache is None or not hasattr(cache, "layers"):
        return None
    _select_cache_rows(cache, inverse)
    tail = original(input_ids=input_ids[:, prompt_width:], attention_mask=attention_mask, past_key_values=cache,
                    use_cache=True, **routers)
    fields = {}
    if routers:
        fields["router_logits"] = _router_logits(head, tail, inverse, first.size(0), prompt_width)
        if fields["router_logits"] is None:
            return None
    # The LM head scores position t with the hidden state of t - 1: the prompt's last position scores the first
    # completion token. Earlier prompt positions score nothing (their labels are -100), so they stay zero.
    hidden = head.last_hidden_state
    filler = hidden.new_zeros(input_ids.size(0), prompt_width - 1, hidden.size(-1))
    hidden = torch.cat([filler, _rows(hidden[:, -1:], inverse), tail.last_hidden_state], 1)
    # The backbone's own output class: a MoE causal LM reads ``router_logits`` from it whatever its value.
    return type(tail)(last_hidden_state=hidden, **fields), first.size(0)


def _shared_prefill(original, input_ids, attention_mask, past_key_values, position_ids=None, **kwargs):
    """Generation's first forward (the prompts into an empty cache) with each distinct prompt computed once: the
    cache and the hidden states are indexed out to the rows; ``None`` where it does not apply."""
    from transformers.cache_utils import DynamicCache

    if (not isinstance(past_key_values, DynamicCache) or past_key_values.get_seq_length() != 0
            or (attention_mask is not None and attention_mask.dim() != 2)  # None: no padding anywhere
            or not _only_neutral(kwargs)):
        return None
    rows = input_ids.size(0)
    key = [input_ids] if attention_mask is None else [input_ids, attention_mask]
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.size(0) != rows:
            return None
        key.append(position_ids)
    first, inverse = _distinct_rows(*key)
    if first.size(0) == rows:
        return None
    out = original(input_ids=input_ids[first], past_key_values=past_key_values,
                   attention_mask=None if attention_mask is None else attention_mask[first],
                   position_ids=None if position_ids is None else position_ids[first], **kwargs)
    _select_cache_rows(past_key_values, inverse)
    fields = {}
    routers = getattr(out, "router_logits", None)  # generation does not use them; kept row for row where they fit
    if routers is not None and all(r.dim() == 2 and r.size(0) == first.size(0) * input_ids.size(1) for r in routers):
        fields["router_logits"] = tuple(_rows_out(r, inverse, input_ids.size(1)).flatten(0, 1) for r in routers)
    # The backbone's own output class: a MoE causal LM reads ``router_logits`` from it whatever its value.
    return type(out)(last_hidden_state=_rows(out.last_hidden_state, inverse), past_key_values=past_key_values,
                     **fields)


@contextlib.contextmanager
def _swapped_forward(backbone, shared):
    """Inside the block, ``backbone``'s forward runs ``shared(original, **inputs)``, or the original forward where
    that returns ``None``; afterwards the forward is what it was (the class's, or an instance-level one such as
    accelerate's hooks)."""
    original = backbone.forward
    patched_before = backbone.__dict__.get("forward")

    def forward(*args, **inputs):
        out = None if args else shared(original, **inputs)  # transformers and TRL call the backbone by keyword
        return original(*args, **inputs) if out is None else out

    backbone.forward = forward
    try:
        yield
    finally:
        if patched_before is None:
            del backbone.forward
        else:
            backbone.forward = patched_before


def shared_prompt_prefill(model):
    """Inside the block, generation with ``model`` (any wrapper) prefills each distinct prompt once: GRPO asks for
    ``num_generations`` samples of every prompt, and their prefill is the same computation. Sampling is unchanged
    (the same logits, the same random draws). A model whose cache cannot be shared
    (:func:`grpo.training.model_support.unsupported`) generates as it would without the block, which is logged once."""
    if not applies(SHARED_PROMPT_FORWARD, model):
        return contextlib.nullcontext()

    def prefill(original, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
        if input_ids is None:
            return None
        return _shared_prefill(original, input_ids, attention_mask, past_key_values, **kwargs)

    return _swapped_forward(backbone(model), prefill)


class SharedPromptForward:
    """Mixin for :class:`grpo.training.trainer.GRPOTrainer`: the log-prob forward and in-process generation share
    each group's prompt."""

    @property
    def _shares_prompts(self) -> bool:
        exp = getattr(self, "experiment", None)
        return exp is not None and exp.async_.shared_prompt_forward

    def _shared_prompt_unavailable(self, model, kwargs: dict) -> str | None:
        """Why the shared-prompt forward cannot run for this call, or ``None``: the model's (logged once by
        :func:`~grpo.training.model_support.applies`, and then ``"model"``), or this call's."""
        if not self._shares_prompts:
            return "off"
        if not applies(SHARED_PROMPT_FORWARD, model):
            return "model"
        if any(v is not None for k, v in kwargs.items()
               if k not in ("batch_size", "compute_entropy", "compute_aux_loss")):
            return "the model takes image or token-type inputs"
        if getattr(backbone(model), "gradient_checkpointing", False) and torch.is_grad_enabled():
            return "gradient checkpointing keeps no cache while training"
        return None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **kwargs):
        why = self._shared_prompt_unavailable(model, kwargs)
        if why is None:
            context = self._sharing_prompts(model, input_ids.size(1) - logits_to_keep)
        else:
            if why not in ("off", "model"):
                say_once(SHARED_PROMPT_FORWARD, model, why)
            context = contextlib.nullcontext()
        with context:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              batch_size, compute_entropy, compute_aux_loss, **kwargs)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's generation (transformers' generate; vLLM untouched) with each distinct prompt prefilled once."""
        share = (self._shares_prompts and images is None and not multimodal_fields and not self.use_vllm
                 and not self.use_transformers_continuous_batching)
        with shared_prompt_prefill(self.model) if share else contextlib.nullcontext():
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)

    @contextlib.contextmanager
    def _sharing_prompts(self, model, prompt_width: int):
        """Swap the backbone's forward for the shared-prompt one for the calls inside the block."""
        counts = {"rows": 0, "prompts": 0}

        def shared(original, input_ids=None, attention_mask=None, **kwargs):
            if input_ids is None or attention_mask is None:
                return None
            out = _shared_forward(original, input_ids, attention_mask, prompt_width, **kwargs)
            if out is None:
                return None
            counts["rows"] += input_ids.size(0)
            counts["prompts"] += out[1]
            return out[0]

        with _swapped_forward(backbone(model), shared):
            yield
        if counts["rows"] and torch.is_grad_enabled():
            self._record("shared_prompt/prompt_forwards_frac", counts["prompts"] / counts["rows"])


__all__ = ["SharedPromptForward", "shared_prompt_prefill"]
