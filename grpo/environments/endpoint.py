"""The policy behind an OpenAI-compatible endpoint, one URL per episode, served from the process that runs episodes.

An agent (:mod:`grpo.environments.agents`) talks to ``http://127.0.0.1:<port>/sessions/<id>/v1``: ``POST
/completions`` and ``GET /models``, OpenAI's schema plus vLLM's field names for what was sampled
(``choices[].token_ids``, ``choices[].prompt_token_ids``, and ``logprobs`` with ``tokens`` / ``token_logprobs``). The
server only receives and answers calls: a call waits in its :class:`Session` until THE episode runner
(:func:`grpo.environments.episodes.run_episodes`) samples it in its batched ``generate`` with every other live episode
(the runner's turn), so the endpoint runs wherever the runner runs (the sync trainer, the CPU generator process, the
vLLM server engine's rounds) with no second generation path, and weights never change inside an episode.

Rules a call meets (each refusal one HTTP error whose ``error.message`` says why):

* sampling parameters are the run's (``grpo.temperature``, ``top_p``, ``top_k``; greedy in evaluation: those of
  the runner's ``generate``, its ``sampling`` attribute): a call that sets one to another
  value, or sets one the run does not use (penalties, ``seed``, ``logit_bias``, ``n``/``best_of`` > 1), is refused
  with 400, so what trains is what the run's config says was sampled; ``max_tokens`` is capped by the episode's
  tokens left, ``stop`` is honoured and the returned text includes the stop string (vLLM's
  ``include_stop_str_in_output``: the sampled tokens are kept, so the text shows them);
* the model is ``policy`` (404 for another name); an unknown session is 404; a call after its episode ended is 409,
  as is a second call while one is waiting;
* a call whose prompt extends the episode's previous prompt and completion (a string prompt as text, a token-id
  prompt as ids, a chat's messages as the previous call's messages and its answer) continues the episode's sequence:
  only the appended part is tokenised, so nothing the model wrote is ever re-tokenised. A call that does not (the
  agent rewrote its history) starts the episode's next sample (:class:`~grpo.environments.base.Restart`): the
  sequence so far trains as a sample of its own with the episode's reward (Agent Lightning's per-call transitions),
  and the new call's prompt is tokenised whole (a token-id prompt kept as given).
* ``stream: true`` is served whole, once sampled: the completion as one chunk, then its finish reason, the usage
  (``stream_options.include_usage``) and ``[DONE]`` (chat programs such as verifiers' stream every call).

``grpo serve-model`` (:mod:`grpo.training.model_server`) serves a saved model without sessions through the same
server start (:func:`start_server`), request parsing (:func:`parse_call`) and response bodies
(:func:`completion_body`, :func:`chat_body`); only its sampling rule differs (the client's parameters count).
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.environments.episodes import _decode, _encode

SERVED_MODEL = "policy"
"""The model name the endpoint serves (an agent passes it as ``model``)."""

_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "n": 1, "best_of": 1,
            "logit_bias": None, "seed": None, "min_p": 0, "use_beam_search": False}


def sampling_params(temperature: float, top_p: float | None = 1.0, top_k: int | None = None) -> dict[str, Any]:
    """A ``generate``'s sampling settings as the endpoint compares them (greedy: temperature 0; no top-k: None). A
    ``generate`` that carries them as its ``sampling`` attribute lets its agents' calls repeat (not change) them."""
    return {"temperature": float(temperature), "top_p": 1.0 if top_p is None else float(top_p),
            "top_k": None if not top_k or top_k < 0 else int(top_k)}


class EndpointError(Exception):
    """A refused call: its HTTP status and a message for the agent."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def check_sampling(body: Mapping[str, Any], sampling: Mapping[str, Any] | None) -> None:
    """Refuse (400) a call whose sampling parameters would change what the run samples (``sampling``: the runner's
    ``generate``'s, :func:`sampling_params`; None, unknown: any value is refused)."""
    for name in ("temperature", "top_p", "top_k"):
        value = body.get(name)
        if value is None:
            continue
        want = None if sampling is None else sampling.get(name)
        if name == "top_k" and value in (0, -1):
            value = None
        same = sampling is not None and (value == want if value is None or want is None
                                         else float(value) == float(want))
        if not same:
            run = f"{name}={want!r}" if sampling is not None else "unknown here"
            raise EndpointError(400, f"{name}={body.get(name)!r} is refused: sampling parameters come from the run's "
                                     f"config ({run}); leave it unset or send the run's value")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "logit_bias" and value == {}):
            raise EndpointError(400, f"{name}={value!r} is refused: the run samples without it (sampling parameters "
                                     f"come from the run's config)")


@dataclass
class Call:
    """One model call of an agent, waiting for its turn: the whole prompt (text and ids), the part of it the
    episode does not hold yet (``suffix_text`` / ``suffix_ids``), its ``stop`` strings and ``max_tokens``."""

    prompt_text: str
    prompt_ids: list[int]
    suffix_text: str
    suffix_ids: list[int]
    stop: tuple[str, ...]
    max_tokens: int | None
    want_logprobs: bool
    answer: Callable[[dict[str, Any] | EndpointError], None]
    started: float = field(default_factory=time.time)
    messages: list[dict[str, Any]] | None = None  # a chat call's conversation (normalised), None for a completion
    tools: list[dict[str, Any]] | None = None
    restart: bool = False  # it does not extend the episode's sequence: the episode's next sample starts with it


class Session:
    """One episode's calls. The server thread hands calls in (:meth:`submit`); the runner's thread takes them
    (:meth:`wait`), answers them (:meth:`complete`) and ends the session (:meth:`end`)."""

    def __init__(self, session_id: str, base_url: str, tokenizer: Any, sampling: Mapping[str, Any] | None) -> None:
        self.id, self.base_url, self.tokenizer, self.sampling = session_id, base_url, tokenizer, sampling
        self.cv = threading.Condition()
        self.pending: Call | None = None  # submitted, not taken by the runner
        self.current: Call | None = None  # taken, being sampled
        self.text: str | None = None  # the last call's prompt + completion, as text
        self.ids: list[int] = []  # ... as ids
        self.ended = False
        self.finished = False  # the agent returned or raised
        self.reward: float | None = None
        self.error: str | None = None  # the agent's failure
        self.messages: list[dict[str, Any]] | None = None  # chat: the last call's conversation and its answer
        self.tools: list[dict[str, Any]] | None = None
        self.refused: list[tuple[float, int, str]] = []  # its calls answered with an error: (time, status, message)

    # ---- the server's side

    def _check_accepting(self) -> None:
        """409 for a call after the episode ended or while another call of it waits (under ``cv``)."""
        if self.ended:
            raise EndpointError(409, f"session {self.id}: its episode has ended; no more calls are served", "conflict")
        if self.pending is not None or self.current is not None:
            raise EndpointError(409, f"session {self.id}: a call is already waiting; an episode's calls are made "
                                     "one at a time", "conflict")

    def submit(self, prompt: str | list[int], stop: tuple[str, ...], max_tokens: int | None, want_logprobs: bool,
               answer: Callable[[dict[str, Any] | EndpointError], None]) -> None:
        with self.cv:
            self._check_accepting()
            held = self.text if self.messages is None else None  # after chat calls: no text to extend
            if isinstance(prompt, str):
                extends = held is not None and prompt.startswith(held)
                suffix_text = prompt[len(held):] if extends else prompt
                suffix_ids = _encode(self.tokenizer, suffix_text) if suffix_text else []
                prompt_text = prompt
            else:
                extends = held is not None and list(prompt[:len(self.ids)]) == self.ids
                suffix_ids = list(prompt[len(self.ids):]) if extends else list(prompt)
                suffix_text = _decode(self.tokenizer, suffix_ids)
                prompt_text = held + suffix_text if extends else suffix_text
            prefix_ids = self.ids if extends else []
            self.pending = Call(prompt_text, prefix_ids + suffix_ids, suffix_text, suffix_ids, stop, max_tokens,
                                want_logprobs, answer, restart=self.text is not None and not extends)
            self.cv.notify_all()

    def submit_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, stop: tuple[str, ...],
                    max_tokens: int | None, want_logprobs: bool,
                    answer: Callable[[dict[str, Any] | EndpointError], None]) -> None:
        """A chat call: the conversation rendered with the tokenizer's chat template (and ``tools``). A later call
        extends the episode when its messages start with the previous call's messages and the assistant message it
        was answered with; only what the template writes after that assistant turn is tokenised. Another call (other
        messages or tools, or a chat call after completions) starts the episode's next sample, rendered whole."""
        from grpo.environments.chat import turn_suffix_text

        with self.cv:
            self._check_accepting()
            held = len(self.messages) if self.messages is not None else 0
            if self.messages is None or tools != self.tools or messages[:held] != self.messages \
                    or len(messages) == held:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                          **({"tools": tools} if tools else {}))
                prompt_ids = _encode(self.tokenizer, text)
                self.pending = Call(text, prompt_ids, text, prompt_ids, stop, max_tokens, want_logprobs, answer,
                                    messages=messages, tools=tools, restart=self.text is not None)
            else:
                suffix = turn_suffix_text(self.tokenizer, messages[held:], tools)
                suffix_ids = _encode(self.tokenizer, suffix)
                self.pending = Call(self.text + suffix, self.ids + suffix_ids, suffix, suffix_ids, stop, max_tokens,
                                    want_logprobs, answer, messages=messages, tools=tools)
            self.cv.notify_all()

    # ---- the runner's side

    def wait(self) -> Call | None:
        """The next call (taken: it is being sampled), or None once the agent finished, failed or the episode
        ended. Blocks; the runner's step timeout bounds it, and :meth:`end` releases it."""
        with self.cv:
            while self.pending is None and not self.finished and not self.ended and self.error is None:
                self.cv.wait()
            call, self.pending = self.pending, None
            self.current = call
            return call

    def finish(self, reward: float | None = None, error: str | None = None) -> None:
        """The agent returned ``reward`` or raised (``error``)."""
        with self.cv:
            self.finished, self.reward = True, reward
            if error is not None and self.error is None:
                self.error = error
            self.cv.notify_all()

    def complete(self, text: str, ids: Sequence[int], logprobs: Sequence[float] | None,
                 finish: str) -> dict[str, Any] | None:
        """Answer the call being sampled with the turn the runner kept (the session's state first: the agent's next
        call may arrive as soon as it reads the answer). A chat call's parsed assistant message is returned (its
        ``tool_calls`` are the episode's tool calls), else None."""
        message = None
        with self.cv:
            call, self.current = self.current, None
            if call is None:
                return None
            self.text, self.ids = call.prompt_text + text, call.prompt_ids + list(ids)
            self.messages, self.tools = None, None  # a chat call's conversation is set below once parsed
            if call.messages is None:
                body: dict[str, Any] | EndpointError = completion_body(self.tokenizer, call, text, list(ids), logprobs,
                                                                       finish, SERVED_MODEL, f"cmpl-{self.id}")
            else:
                try:
                    body, message = chat_body(self.tokenizer, call, list(ids), logprobs, finish, SERVED_MODEL,
                                              f"chatcmpl-{self.id}")
                    self.messages, self.tools = [*call.messages, message], call.tools
                except Exception as err:  # noqa: BLE001 - a parser that fails answers the agent, not the runner
                    body = EndpointError(500, f"the completion could not be parsed: {type(err).__name__}: {err}",
                                         "server_error")
                    self.refused.append((time.time(), body.status, body.message))
        call.answer(body)
        return message

    def end(self) -> None:
        """The episode is over: later calls get 409, a call still waiting is refused, the runner's wait returns."""
        with self.cv:
            self.ended = True
            waiting, self.pending = self.pending, None
            self.cv.notify_all()
        if waiting is not None:
            waiting.answer(EndpointError(409, f"session {self.id}: its episode has ended", "conflict"))



_ids = itertools.count()

ChatParser = Callable[[Any, list[int], list[dict[str, Any]] | None], Mapping[str, Any]]
_CHAT_PARSER: list[ChatParser] = []


def set_chat_parser(parser: ChatParser) -> None:
    """How chat completions are parsed into ``content`` and ``tool_calls`` (``parser(tokenizer, ids, tools)``, an
    assistant message whose calls' ``arguments`` are dicts): the training layer sets TRL's, the chat protocol's
    parser (:mod:`grpo.training.chat_loop`), so both read a model's tool calls alike."""
    _CHAT_PARSER[:] = [parser]


def normalise_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the chat template renders it and the endpoint compares it: role, content (None as ""), tool
    calls as ``{type, function: {name, arguments as a dict}}``, a tool message's name; nothing else (ids,
    refusals, annotations)."""
    import json

    out: dict[str, Any] = {"role": message.get("role"), "content": message.get("content") or ""}
    if isinstance(out["content"], list):  # content parts: their text
        out["content"] = "".join(str(p.get("text", "")) for p in out["content"] if isinstance(p, Mapping))
    calls = []
    for call in message.get("tool_calls") or []:
        function = dict(call.get("function") or {})
        args = function.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append({"type": "function", "function": {"name": function.get("name"), "arguments": args}})
    if calls:
        out["tool_calls"] = calls
    if message.get("name"):
        out["name"] = message["name"]
    return out


def chat_body(tokenizer: Any, call: Call, ids: list[int], logprobs: Sequence[float] | None, finish: str,
              model: str, id_prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat completion's body (``model`` answering, its id starting ``id_prefix``) and the assistant message it
    stands for (normalised): the episode endpoint's and ``grpo serve-model``'s."""
    import json

    if not _CHAT_PARSER:
        raise RuntimeError("no chat parser in this process (grpo.training.chat_loop sets it)")
    parsed = _CHAT_PARSER[0](tokenizer, ids, call.tools)
    message = normalise_message({"role": "assistant", **parsed})
    n = next(_ids)
    tool_calls = [{"id": f"call_{n}_{i}", "type": "function",
                   "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])}}
                  for i, c in enumerate(message.get("tool_calls", []))]
    choice: dict[str, Any] = {
        "index": 0, "message": {"role": "assistant", "content": message["content"], "tool_calls": tool_calls or None},
        "finish_reason": "tool_calls" if tool_calls and finish == "stop" else finish, "token_ids": ids,
        "logprobs": None}
    if call.want_logprobs and logprobs is not None:
        choice["logprobs"] = {"content": [{"token": tokenizer.decode([t]), "logprob": float(lp),
                                           "bytes": None, "top_logprobs": []} for t, lp in zip(ids, logprobs)]}
    body = {"id": f"{id_prefix}-{n}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "prompt_token_ids": call.prompt_ids, "choices": [choice],
            "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(call.prompt_ids) + len(ids)}}
    return body, message


def completion_body(tokenizer: Any, call: Call, text: str, ids: list[int], logprobs: Sequence[float] | None,
                    finish: str, model: str, id_prefix: str) -> dict[str, Any]:
    """A text completion's body (``model`` answering, its id starting ``id_prefix``), with vLLM's ``token_ids`` and
    ``prompt_token_ids``: the episode endpoint's and ``grpo serve-model``'s."""
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids,
                              "prompt_token_ids": call.prompt_ids, "logprobs": None}
    if call.want_logprobs and logprobs is not None:
        choice["logprobs"] = {"tokens": [tokenizer.decode([t]) for t in ids],
                              "token_logprobs": [float(lp) for lp in logprobs], "text_offset": None,
                              "top_logprobs": None}
    return {"id": f"{id_prefix}-{next(_ids)}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(call.prompt_ids) + len(ids)}}


class Endpoint:
    """The process's server (uvicorn in a daemon thread on 127.0.0.1, a free port) and its sessions. Ended
    sessions are remembered (the last 100 000) so a late call reads 409, not 404."""

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.ended: deque[str] = deque(maxlen=100_000)
        self.ended_set: set[str] = set()
        self.lock = threading.Lock()
        self.port = self._start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _start(self) -> int:
        from starlette.routing import Route

        _, port = start_server([
            Route("/sessions/{sid}/v1/completions", self._completions, methods=["POST"]),
            Route("/sessions/{sid}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/sessions/{sid}/v1/models", self._models, methods=["GET"]),
        ], "127.0.0.1", 0, "grpo-agent-endpoint")
        return port

    def open(self, tokenizer: Any, sampling: Mapping[str, Any] | None) -> Session:
        sid = secrets.token_hex(8)
        session = Session(sid, f"{self.url}/sessions/{sid}/v1", tokenizer, sampling)
        with self.lock:
            self.sessions[sid] = session
        return session

    def close(self, session: Session) -> None:
        session.end()
        with self.lock:
            self.sessions.pop(session.id, None)
            if len(self.ended) == self.ended.maxlen:
                self.ended_set.discard(self.ended[0])
            self.ended.append(session.id)
            self.ended_set.add(session.id)

    # ---- HTTP

    def _session(self, sid: str) -> Session:
        with self.lock:
            session = self.sessions.get(sid)
            if session is None and sid in self.ended_set:
                raise EndpointError(409, f"session {sid}: its episode has ended; no more calls are served", "conflict")
        if session is None:
            raise EndpointError(404, f"unknown session {sid!r}: each episode's agent gets its own base URL",
                                "not_found_error")
        return session

    async def _models(self, request):
        try:
            self._session(request.path_params["sid"])
        except EndpointError as err:
            return error_response(err)
        return models_response(SERVED_MODEL)

    async def _chat(self, request):
        return await self._serve(request, chat=True)

    async def _completions(self, request):
        return await self._serve(request, chat=False)

    async def _serve(self, request, chat: bool):
        from starlette.responses import JSONResponse

        session = None
        try:
            session = self._session(request.path_params["sid"])
            body = await read_body(request)
            check_model(body, SERVED_MODEL)
            check_sampling(body, session.sampling)
            call = parse_call(body, chat, "capped by the episode's tokens left", streams=True)
            answer, future = answer_future()
            if chat:
                session.submit_chat(call.messages, call.tools, call.stop, call.max_tokens, call.want_logprobs,
                                    answer)
            else:
                session.submit(call.prompt, call.stop, call.max_tokens, call.want_logprobs, answer)
            value = await future
        except EndpointError as err:
            if session is not None:  # the episode's trace and env/refused_calls show it
                session.refused.append((time.time(), err.status, err.message))
            return error_response(err)
        if isinstance(value, EndpointError):
            return error_response(value)
        if call.stream:
            from starlette.responses import Response

            return Response(stream_events(value, bool((body.get("stream_options") or {}).get("include_usage"))),
                            media_type="text/event-stream")
        return JSONResponse(value)


def start_server(routes: list, host: str, port: int, name: str) -> tuple[Any, int]:
    """A Starlette app of ``routes`` served by uvicorn in a daemon thread on ``host:port`` (0: a free one), once it
    listens: the server and its port. The agent endpoint's and ``grpo serve-model``'s."""
    import uvicorn
    from starlette.applications import Starlette

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # accepted connections inherit it: a response's header and body writes go out at once, not 40 ms apart
    # (Nagle's algorithm waiting on the client's delayed ACK, one call in 40 ms a connection)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(4096)  # a round's agents connect at once: a short queue drops connections (retried after 1 s)
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), log_level="warning", access_log=False,
                                           lifespan="off", timeout_keep_alive=600, backlog=4096))

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(server.serve(sockets=[sock]))

    threading.Thread(target=serve, name=name, daemon=True).start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        raise RuntimeError(f"{name} did not start within 30 s")
    return server, sock.getsockname()[1]


@dataclass
class Request:
    """A call's request body, checked: ``prompt`` (a completion's: text or ids) or ``messages`` and ``tools`` (a
    chat's, normalised), ``stop``, ``max_tokens`` (None: unset), ``want_logprobs``, ``stream`` (answer as server-sent
    events)."""

    prompt: str | list[int] | None
    messages: list[dict[str, Any]] | None
    tools: list[dict[str, Any]] | None
    stop: tuple[str, ...]
    max_tokens: int | None
    want_logprobs: bool
    stream: bool = False


async def read_body(request: Any) -> dict[str, Any]:
    """A request's JSON object; anything else is a 400."""
    try:
        body = await request.json()
    except ValueError:
        raise EndpointError(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise EndpointError(400, "the request body is not a JSON object")
    return body


def check_model(body: Mapping[str, Any], served: str) -> None:
    """Refuse (404) a call for another model than ``served``."""
    model = body.get("model")
    if model != served:
        raise EndpointError(404, f"model {model!r} does not exist; this endpoint serves {served!r}",
                            "not_found_error")


def parse_call(body: Mapping[str, Any], chat: bool, max_tokens_cap: str, streams: bool = False) -> Request:
    """The parts of a completion (``chat`` False) or chat completion request every server reads alike; a malformed
    one is a 400 (``max_tokens_cap`` says what caps ``max_tokens`` in its message; ``streams``: ``stream: true`` is
    served, else refused). Sampling parameters and the model name are each server's to check."""
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stop):
        raise EndpointError(400, f"stop={body.get('stop')!r}: a string or a list of strings")
    max_tokens = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise EndpointError(400, f"max_tokens={max_tokens!r}: a positive integer ({max_tokens_cap})")
    stream = bool(body.get("stream"))
    if stream and not streams:
        raise EndpointError(400, "stream=true is not served: each call returns whole")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise EndpointError(400, "messages: a non-empty list of messages")
        return Request(None, [normalise_message(m) for m in messages], body.get("tools") or None, stop, max_tokens,
                       bool(body.get("logprobs")), stream)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                        and all(isinstance(t, int) for t in prompt))):
        raise EndpointError(400, "prompt: one string or one list of token ids")
    return Request(prompt, None, None, stop, max_tokens, body.get("logprobs") is not None, stream)


def stream_events(body: Mapping[str, Any], include_usage: bool) -> bytes:
    """A whole (chat) completion ``body`` as the server-sent events of a stream: one chunk with the completion (its
    message as the delta, tool calls indexed; vLLM's ``token_ids`` kept), one with the finish reason, the usage
    chunk when asked, ``[DONE]``."""
    import json

    chunk_object = "chat.completion.chunk" if body["object"] == "chat.completion" else "text_completion"
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": chunk_object}
    choice = dict(body["choices"][0])
    finish = choice.pop("finish_reason")
    if "message" in choice:
        message = choice.pop("message")
        delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        choice["delta"] = delta
    chunks = [{**head, "choices": [{**choice, "finish_reason": None}]},
              {**head, "choices": [{"index": 0, "finish_reason": finish,
                                    **({"delta": {}} if "delta" in choice else {"text": ""})}]}]
    if "prompt_token_ids" in body:
        chunks[0]["prompt_token_ids"] = body["prompt_token_ids"]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def answer_future() -> tuple[Callable[[dict[str, Any] | EndpointError], None], asyncio.Future]:
    """A call's answer callback (any thread may call it) and the future the server's handler awaits it on."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def answer(value: dict[str, Any] | EndpointError) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))

    return answer, future


def error_response(err: EndpointError) -> Any:
    """A refused call as OpenAI answers one: ``{"error": {message, type, code}}`` with its HTTP status."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": err.message, "type": err.kind, "code": err.status}},
                        status_code=err.status)


def models_response(served: str) -> Any:
    """``GET /models``: the one model served."""
    from starlette.responses import JSONResponse

    return JSONResponse({"object": "list", "data": [{"id": served, "object": "model", "owned_by": "grpo"}]})


_ENDPOINT: Endpoint | None = None
_ENDPOINT_LOCK = threading.Lock()


def endpoint() -> Endpoint:
    """This process's endpoint, started on first use."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None:
            _ENDPOINT = Endpoint()
        return _ENDPOINT


__all__ = ["SERVED_MODEL", "Call", "Endpoint", "EndpointError", "Request", "Session", "answer_future", "chat_body",
           "check_model", "check_sampling", "completion_body", "endpoint", "error_response", "models_response",
           "normalise_message", "parse_call", "read_body", "sampling_params", "set_chat_parser", "start_server",
           "stream_events"]
