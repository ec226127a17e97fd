"""``grpo serve-model``: a saved model behind the agent endpoint's OpenAI-compatible API, for external eval harnesses.

The routes are the agent endpoint's (:mod:`grpo.environments.endpoint`) without sessions: ``GET /v1/models``,
``POST /v1/completions`` and ``POST /v1/chat/completions`` (``tools`` parsed by the parser the chat protocol
registers, :mod:`grpo.training.chat_loop`), the same request checks and response bodies (vLLM's ``token_ids``,
``prompt_token_ids`` and ``logprobs`` fields). What differs is whose sampling parameters count: an eval server honours
each call's ``temperature`` (0: greedy; default 1), ``top_p``, ``top_k``, ``max_tokens`` (default and cap: the
model's context left), ``stop`` and ``seed``, where the training endpoint refuses any that differ from the run's.
Stop strings end a completion as OpenAI's API does: the returned text stops before the stop string (its tokens are in
``token_ids``).

Calls are batched as the episode runner batches turns: the server thread only queues them; the main thread takes
every call waiting (at most ``max_batch``, after a few milliseconds for more to arrive), groups those with the same
sampling parameters (a seeded call samples alone, so its seed decides its tokens) and samples each group in one
``generate``, each row stopped at its own stop strings or budget (:class:`~grpo.training.turn_sampling.TurnStop`).
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, StoppingCriteriaList

import grpo.training.chat_loop  # noqa: F401 - registers the chat completions' tool-call parser
from grpo.environments.endpoint import (
    Call,
    EndpointError,
    answer_future,
    chat_body,
    check_model,
    completion_body,
    error_response,
    models_response,
    parse_call,
    read_body,
    start_server,
)
from grpo.errors import ConfigError
from grpo.training.model_support import GENERATION_KV_CACHE, applies
from grpo.training.padding import padded_rows
from grpo.training.tiny_model import load_tokenizer_from
from grpo.training.turn_sampling import TurnStop, trim

GATHER_SECONDS = 0.005
"""How long the batcher waits after the first call of a batch for others to join it."""

_REFUSED = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
            "use_beam_search": False, "echo": False, "suffix": None}


def default_model_name(folder: Path) -> str:
    """The name a model folder is served as: the run's name for ``runs/<name>/model``, else the folder's name."""
    folder = folder.resolve()
    return folder.parent.name if folder.name == "model" else folder.name


def load_model(folder: Path) -> tuple[Any, Any]:
    """The saved model and tokenizer in ``folder`` (a run's ``model``), in evaluation mode on the GPU when there is
    one. A folder that holds none is a ConfigError, one line."""
    if not folder.is_dir():
        raise ConfigError(f"model folder {folder}: no such folder (give a run's model folder, e.g. runs/NAME/model)")
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model folder {folder}: no config.json; give a saved model's folder, e.g. runs/NAME/model")
    try:
        tokenizer = load_tokenizer_from(folder)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    except (OSError, ValueError, json.JSONDecodeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"model folder {folder}: cannot load a model and tokenizer from it ({first})") from None
    if torch.cuda.is_available():
        model = model.to("cuda")
    model.eval()
    return model, tokenizer


def _sampling(body: dict[str, Any]) -> tuple[float, float, int, int | None]:
    """A call's ``(temperature, top_p, top_k, seed)``, checked (0 top-k: none); unsupported parameters are 400."""
    for name, neutral in _REFUSED.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logit_bias" and value == {}):
            raise EndpointError(400, f"{name}={value!r} is not served: one completion per call, sampled with "
                                     "temperature, top_p, top_k and seed only")
    temperature, top_p, top_k, seed = (body.get(k) for k in ("temperature", "top_p", "top_k", "seed"))
    temperature = 1.0 if temperature is None else temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise EndpointError(400, f"temperature={temperature!r}: a number >= 0 (0: greedy)")
    top_p = 1.0 if top_p is None else top_p
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise EndpointError(400, f"top_p={top_p!r}: a number in (0, 1]")
    top_k = 0 if top_k in (None, -1) else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise EndpointError(400, f"top_k={top_k!r}: a non-negative integer (0 or -1: no top-k)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise EndpointError(400, f"seed={seed!r}: an integer")
    return float(temperature), float(top_p), int(top_k), seed


@dataclass
class _Job:
    call: Call
    sampling: tuple[float, float, int, int | None]
    model: str
    chat: bool


class ModelServer:
    """The model, its tokenizer and the queue of calls the HTTP thread fills and :meth:`run` (the main thread)
    samples, at most ``max_batch`` sequences per ``generate``."""

    def __init__(self, model: Any, tokenizer: Any, name: str, max_batch: int = 64) -> None:
        self.model, self.tokenizer, self.name, self.max_batch = model, tokenizer, name, max_batch
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.server: Any = None

    def listen(self, host: str, port: int) -> int:
        """Start answering HTTP on ``host:port`` (a thread); the port."""
        from starlette.routing import Route

        self.server, port = start_server([
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
        ], host, port, "grpo-serve-model")
        return port

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True

    # ---- HTTP (the server's thread)

    async def _models(self, request: Any) -> Any:
        return models_response(self.name)

    async def _completions(self, request: Any) -> Any:
        return await self._serve(request, chat=False)

    async def _chat(self, request: Any) -> Any:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse

        try:
            body = await read_body(request)
            check_model(body, self.name)
            sampling = _sampling(body)
            req = parse_call(body, chat, "capped by the model's context left")
            answer, future = answer_future()
            text, ids = self._prompt(req)
            left = self.context - len(ids)
            if left < 1:
                raise EndpointError(400, f"the prompt is {len(ids)} tokens; the model's context is {self.context}")
            call = Call(text, ids, text, ids, req.stop, min(req.max_tokens or left, left), req.want_logprobs, answer,
                        messages=req.messages, tools=req.tools)
            self.jobs.put(_Job(call, sampling, self.name, chat))
            value = await future
        except EndpointError as err:
            return error_response(err)
        return JSONResponse(value) if not isinstance(value, EndpointError) else error_response(value)

    def _prompt(self, req: Any) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if req.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise EndpointError(400, f"model {self.name!r} has no chat template: use /v1/completions")
            text = tok.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=False,
                                           **({"tools": req.tools} if req.tools else {}))
            return text, list(tok(text, add_special_tokens=False)["input_ids"])
        if isinstance(req.prompt, str):
            return req.prompt, list(tok(req.prompt, add_special_tokens=False)["input_ids"])
        if max(req.prompt) >= len(tok) or min(req.prompt) < 0:
            raise EndpointError(400, f"prompt: token ids must lie in [0, {len(tok)})")
        return tok.decode(req.prompt, skip_special_tokens=True), list(req.prompt)

    # ---- sampling (the main thread)

    def run(self, poll_seconds: float = 0.2) -> None:
        """Answer calls until interrupted (KeyboardInterrupt, or the CLI's Terminated on SIGTERM)."""
        while True:
            try:
                first = self.jobs.get(timeout=poll_seconds)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + GATHER_SECONDS
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            groups: dict[Any, list[_Job]] = {}
            for i, job in enumerate(batch):  # a seeded call alone: its seed, not its batch-mates, decides its tokens
                key = job.sampling if job.sampling[3] is None else (*job.sampling, i)
                groups.setdefault(key, []).append(job)
            for jobs in groups.values():
                self._answer(jobs)

    def _answer(self, jobs: list[_Job]) -> None:
        try:
            results = self.generate(jobs)
        except Exception as err:  # noqa: BLE001 - a failed batch answers its calls, the server goes on
            for job in jobs:
                job.call.answer(EndpointError(500, f"generation failed: {type(err).__name__}: {err}", "server_error"))
            return
        for job, (ids, logprobs, cut, finish) in zip(jobs, results):
            call = job.call
            try:
                if job.chat:
                    body, _ = chat_body(self.tokenizer, call, ids, logprobs, finish, job.model, "chatcmpl")
                else:
                    body = completion_body(self.tokenizer, call, cut, ids, logprobs, finish, job.model, "cmpl")
            except Exception as err:  # noqa: BLE001 - a parser that fails answers its call
                body = EndpointError(500, f"the completion could not be parsed: {type(err).__name__}: {err}",
                                     "server_error")
            call.answer(body)

    @torch.no_grad()
    def generate(self, jobs: list[_Job]) -> list[tuple[list[int], list[float], str, str]]:
        """One ``generate`` for calls of one sampling setting: each call's ids, their log-probs (under its
        temperature; greedy: the model's distribution), its text cut before its first stop string, and its finish
        reason (``stop``: a stop string or end of sequence; ``length``: ``max_tokens``)."""
        tok, model = self.tokenizer, self.model
        temperature, top_p, top_k, seed = jobs[0].sampling
        eos = model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [tok.eos_token_id])
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        prompts = [job.call.prompt_ids for job in jobs]
        limits = [job.call.max_tokens for job in jobs]
        ids, mask = padded_rows(prompts, pad, "left")
        width = ids.shape[1]
        stops = [job.call.stop for job in jobs]
        stop = TurnStop.needed(tok, (), width, limits, eos, row_stops=stops)
        device = next(model.parameters()).device
        greedy = temperature == 0
        seeded = torch.random.fork_rng(devices=[device] if device.type == "cuda" else []) if seed is not None \
            else contextlib.nullcontext()
        with seeded:
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(limits),
                do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
                top_k=None if greedy else top_k, pad_token_id=pad, eos_token_id=eos, output_logits=True,
                return_dict_in_generate=True, use_cache=applies(GENERATION_KV_CACHE, model),
                stopping_criteria=StoppingCriteriaList([stop]) if stop is not None else None)
        seqs = out.sequences[:, width:]
        logps = [torch.log_softmax(step.float() / (temperature or 1.0), -1).gather(-1, seqs[:, j, None]).squeeze(-1)
                 for j, step in enumerate(out.logits)]
        token_logps = torch.stack(logps, 1).tolist() if logps else [[] for _ in jobs]
        rows = seqs.tolist()
        results = []
        for job, row, lp, end in zip(jobs, rows, token_logps, trim(rows, stop, eos)):
            kept = row[:end]
            text = tok.decode(kept, skip_special_tokens=True)
            hit = min((text.find(s) for s in job.call.stop if s in text), default=-1)
            ended = hit >= 0 or (bool(kept) and kept[-1] in eos)
            results.append((kept, lp[:end], text[:hit] if hit >= 0 else text,
                            "stop" if ended or len(kept) < job.call.max_tokens else "length"))
        return results


__all__ = ["ModelServer", "default_model_name", "load_model"]
