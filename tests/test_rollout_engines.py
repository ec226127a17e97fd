"""The vLLM server rollout engine's control flow, on CPU, against a stub vLLM server; and benchmarks/gpu_smoke.py.

vLLM is GPU-only and not installed here, so a **stub HTTP server** (stdlib ``http.server``, in this process) stands in
for ``trl vllm-serve`` / ``vllm serve``. It speaks the endpoints TRL's real ``VLLMClient`` calls -- ``/health``,
``/v1/models``, ``/v1/completions`` (token-id prompts, ``n``, ``logprobs: 0``, ``return_token_ids``),
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/reset_prefix_cache`` -- and generates
with a copy of the tiny policy (HF generate, the same sampling and log-prob computation as the CPU generator process),
reporting every sampled token's log-prob shifted by ``OFFSET``, so the importance-sampling ratio shows whose
log-probs the correction used.

What is real: TRL's ``VLLMClient`` (request building, retries session, response and log-prob parsing,
``update_named_params``' announce-then-broadcast sequence, ``reset_prefix_cache``), the engine, the trainer and its
async code, the staleness bound and the IS correction. What is stubbed, because it needs CUDA and vLLM:

* ``VLLMClient.init_communicator`` (vLLM's NCCL rendezvous, refused by TRL on a CPU device): recorded, not run;
* the NCCL broadcast inside ``update_named_params`` (vLLM's ``NCCLWeightTransferEngine.trainer_send_weights``):
  replaced by a copy of each streamed tensor into the stub server's model -- so the test checks the tensors the
  engine sends, and that generation after a sync really uses them;
* the ``vllm`` import check of ``VLLMClient.__init__``.

Not exercised here: vLLM's own sampling/log-prob numerics, NCCL transfer, bf16 and GPU timing -- that is what
``benchmarks/gpu_smoke.py`` is for, on a machine with one GPU.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from grpo.config import load_config
from tests.conftest import MICRO, micro_overrides
from tests.servers import free_port

REPO = Path(__file__).resolve().parent.parent
OFFSET = -0.25  # the stub reports log p + OFFSET: with the trainer's weights the IS ratio is exp(-OFFSET) everywhere


class StubVLLMServer:
    """A stand-in for a vLLM server holding ``model``; records every call (see the module docstring)."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int) -> None:
        self.model = model.eval()
        self.params = dict(self.model.named_parameters())
        self.eos, self.pad = eos_token_id, pad_token_id
        self.events: list[tuple] = []  # ("update_weights", names) / ("reset_prefix_cache",) / ("generate", prompts, n)
        self.updates: list[dict[str, torch.Tensor]] = []  # the tensors each weight update streamed
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, body: dict, status: int = 200) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._reply({})
                elif self.path == "/v1/models":
                    self._reply({"data": [{"id": "stub-tiny"}]})
                else:
                    self._reply({"error": self.path}, 404)

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/v1/completions":
                    self._reply(server.complete(body))
                    return
                with server.lock:
                    if self.path == "/start_weight_update":
                        server.updates.append({})
                    elif self.path == "/update_weights":
                        server.events.append(("update_weights", tuple(body["update_info"]["names"])))
                    elif self.path == "/reset_prefix_cache":
                        server.events.append(("reset_prefix_cache",))
                    elif self.path != "/finish_weight_update":
                        self._reply({"error": self.path}, 404)
                        return
                self._reply({"success": True})

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """The NCCL broadcast's receiving end: the streamed tensor lands in the server's model."""
        with self.lock:
            self.updates[-1][name] = tensor.detach().clone()
            with torch.no_grad():
                self.params[name].copy_(tensor)

    def complete(self, body: dict) -> dict:
        prompts, n, temperature = body["prompt"], body["n"], body["temperature"]
        assert body["return_token_ids"] and body["return_tokens_as_token_ids"] and body["logprobs"] == 0
        rows = [p for p in prompts for _ in range(n)]  # prompt-major, as vLLM answers
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(rows):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with self.lock, torch.no_grad():
            self.events.append(("generate", len(prompts), n))
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=body["max_tokens"],
                temperature=temperature, top_p=body["top_p"], top_k=body["top_k"] or None, pad_token_id=self.pad,
                eos_token_id=self.eos, output_logits=True, return_dict_in_generate=True)
        seqs = out.sequences[:, width:]
        logps = torch.stack([torch.log_softmax(step_logits.float() / temperature, -1) for step_logits in out.logits], 1)
        token_logps = logps.gather(-1, seqs[..., None]).squeeze(-1)
        choices = []
        for prompt, row, lp in zip(rows, seqs.tolist(), token_logps.tolist()):
            end = next((j + 1 for j, t in enumerate(row) if t == self.eos), len(row))
            choices.append({"prompt_token_ids": prompt, "token_ids": row[:end], "logprobs": {
                "tokens": [f"token_id:{t}" for t in row[:end]],
                "token_logprobs": [v + OFFSET for v in lp[:end]], "top_logprobs": [None] * end}})
        return {"choices": choices}

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def vllm_stubs(monkeypatch):
    """TRL's client with its two CUDA/vLLM-only calls replaced (see the module docstring); yields the record of
    ``init_communicator`` calls and a setter for the server the broadcast delivers to."""
    from trl.generation import vllm_client

    opened: list = []
    target: dict = {}

    def init_communicator(self, device=0):
        opened.append(device)
        self.communicator = SimpleNamespace(group=SimpleNamespace(store=None, socket=None))

    class FakeNCCLEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            assert trainer_args.packed is True and trainer_args.group is not None
            for name, tensor in iterator:
                target["server"].receive(name, tensor)

    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vllm_client, "_HAS_STATEFUL_TRAINER_ENGINE", False)
    monkeypatch.setattr(vllm_client, "NCCLWeightTransferEngine", FakeNCCLEngine, raising=False)
    monkeypatch.setattr(vllm_client, "NCCLTrainerSendWeightsArgs", lambda **kw: SimpleNamespace(**kw), raising=False)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", init_communicator)
    yield SimpleNamespace(opened=opened, deliver_to=lambda server: target.__setitem__("server", server))


class Record(TrainerCallback):
    """Every log dict, and the policy's parameters after every optimizer step."""

    def __init__(self) -> None:
        self.logs: list[dict] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.named_parameters()}

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def train_against_stub(tmp_path, stubs, after_load=None, **extra):
    from grpo.pipeline.data import load_data
    from grpo.rewards import get_reward
    from grpo.training.policy import load_policy
    from grpo.training.rollout_engines import VLLMServerEngine
    from grpo.training.train import grpo_args
    from grpo.training.trainer import GRPOTrainer

    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "async.use_data_producer": "true", "async.async_prefetch": "true", "grpo.max_steps": 8,
        "grpo.logging_steps": 1, "grpo.save_steps": 100, "evaluation.enabled": "false",
        # the micro model almost never answers exactly; a format reward has variance, so the policy moves every step
        "grpo.reward_funcs": "[digits_format]", **extra}))
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    server = StubVLLMServer(copy.deepcopy(policy.model), policy.tokenizer.eos_token_id, policy.tokenizer.pad_token_id)
    stubs.deliver_to(server)
    # use_vllm needs vllm installed to load; set past the load-time rules, as a GPU machine's config would say.
    cfg.grpo.use_vllm, cfg.grpo.vllm_mode = True, "server"
    cfg.grpo.vllm_server_host, cfg.grpo.vllm_server_port = "127.0.0.1", server.port
    for key, value in (after_load or {}).items():
        setattr(cfg.async_, key, value)
    record = Record()
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward(n) for n in cfg.grpo.reward_funcs],
                          args=grpo_args(cfg, tmp_path / "out"), train_dataset=data["train"], experiment=cfg,
                          callbacks=[record])
    try:
        assert isinstance(trainer._producer, VLLMServerEngine) and not trainer.use_vllm  # TRL's vLLM path is off
        trainer.train()
    finally:
        trainer.close_producer()
        server.close()
    rows = [r for r in record.logs if "async/staleness_max" in r]
    return server, record, rows, trainer


def test_vllm_engine_pushes_weights_every_sync_interval_and_tags_rollouts(tmp_path, vllm_stubs):
    """``vllm_sync_interval`` 2, ``prefetch_depth`` 2: the same policy versions as the CPU engine
    (tests/test_async.py), the server receives the trainer's exact weights at step 0 and after steps 2, 4, 6 (each
    followed by a prefix-cache reset), and generation asks for ``num_generations`` completions per prompt."""
    server, record, rows, trainer = train_against_stub(tmp_path, vllm_stubs, **{
        "async.vllm_sync_interval": 2, "async.prefetch_depth": 2, "async.max_staleness": 3})
    assert vllm_stubs.opened == [trainer.accelerator.device]  # one weight-sync group, opened by the first sync
    versions = [step - int(r["async/staleness_max"]) for step, r in enumerate(rows)]
    assert versions == [0, 0, 0, 0, 2, 2, 4, 4], versions
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 0
    # weights: at step 0 (the first round's "generate now"), then every 2 steps; the push after the last step may
    # or may not be served before close() (it skips what is left in the queue)
    assert len(server.updates) in (4, 5), len(server.updates)
    names = list(record.weights[2])
    assert [e[1] for e in server.events if e[0] == "update_weights"][:4] == [tuple(names)] * 4
    for update, step in zip(server.updates[1:4], (2, 4, 6)):
        assert list(update) == names
        assert all(torch.equal(update[k], record.weights[step][k]) for k in names), step
    for a, b in ((0, 2), (2, 4), (4, 6)):  # the policy moved between pushes: the equalities above are not vacuous
        assert not all(torch.equal(record.weights.get(a, server.updates[0])[k], record.weights[b][k]) for k in names)
    kinds = [e[0] for e in server.events]
    for i, kind in enumerate(kinds):
        if kind == "update_weights":
            assert kinds[i + 1] == "reset_prefix_cache", kinds  # no generation from a cache of the old weights
    generated = [e for e in server.events if e[0] == "generate"]
    per_round = trainer.batch_layout.completions_per_rank // trainer.num_generations
    assert len(generated) >= 8 and all(e[1:] == (per_round, trainer.num_generations) for e in generated)


def test_vllm_engine_stale_rollouts_are_dropped_and_is_uses_the_servers_logprobs(tmp_path, vllm_stubs):
    """``max_staleness`` 0 (set after load, as in tests/test_async.py): every prefetched round is one version old,
    so it is dropped and generated again after a weight push. Every trained rollout then comes from the trainer's
    current weights, and the IS ratio pi_train / pi_vllm is exp(-OFFSET) on every token: the correction used the
    log-probs the server returned (its own would give 1), and the server generated with the pushed weights (stale
    or wrong weights would spread the ratio)."""
    server, record, rows, trainer = train_against_stub(
        tmp_path, vllm_stubs, after_load={"max_staleness": 0},
        **{"async.vllm_importance_sampling_correction": "true", "async.vllm_importance_sampling_cap": 2.0})
    staleness = [r["async/staleness_max"] for r in rows]
    assert len(staleness) == 8 and max(staleness) == 0
    assert sum(r.get("async/dropped_stale", 0) for r in rows) == 7
    expected = math.exp(-OFFSET)
    for key in ("min", "max"):
        ratios = [r[f"sampling/importance_sampling_ratio/{key}"] for r in record.logs
                  if f"sampling/importance_sampling_ratio/{key}" in r]
        assert len(ratios) == 8 and all(abs(v - expected) < 1e-4 for v in ratios), (key, ratios)
    assert len(server.updates) >= 8  # a push before each regenerated round
    names = list(record.weights[1])
    assert not all(torch.equal(record.weights[1][k], record.weights[8][k]) for k in names)  # the policy moved


def test_vllm_engine_episode_turns_ask_the_server_to_stop_at_the_stop_strings(vllm_stubs):
    """A round of guess_digit episodes through the engine: each turn is one ``/v1/completions`` request whose body
    carries the environment's stop strings as vLLM's ``stop`` (with ``include_stop_str_in_output``), so the server
    stops each sequence there, and ``max_tokens`` the largest budget left; the token ids the server returned are the
    episodes' (never re-tokenised) and are counted as generated. (The stub server samples on past a stop: the runner
    cuts the turn, as it would a server that ignored ``stop``.)"""
    from grpo.training.async_producer import EpisodeSettings
    from grpo.training.rollout_engines import VLLMServerEngine
    from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

    tok = build_char_tokenizer("0123456789+=<>")
    bodies: list[dict] = []

    class Recording(StubVLLMServer):
        def complete(self, body: dict) -> dict:
            reply = super().complete(body)
            bodies.append({**body, "returned": [c["token_ids"] for c in reply["choices"]]})
            return reply

    server = Recording(build_tiny_qwen2(tok, 32, 1, 2, 64, 128, seed=0), tok.eos_token_id, tok.pad_token_id)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "max_tokens": 24, "generation_kwargs": {}}
    engine = VLLMServerEngine.connect(host="127.0.0.1", port=server.port, timeout=30, sampling=sampling,
                                      num_generations=1, episodes=EpisodeSettings(name="guess_digit", max_turns=3,
                                                                                   max_completion_length=24),
                                      tokenizer=tok, eos_token_ids=[tok.eos_token_id])
    prompts = ["12+3=", "4+4=", "7+1=", "2+2="]
    try:
        engine.submit(0, [tok(p, add_special_tokens=False)["input_ids"] for p in prompts],
                      rows=[{"prompt": p} for p in prompts])
        episodes = engine.get(0, timeout=60).episodes
    finally:
        engine.close()
        server.close()
    assert bodies and all(b["stop"] == list("0123456789") and b["include_stop_str_in_output"] for b in bodies)
    assert bodies[0]["max_tokens"] == 24 and all(b["max_tokens"] <= 24 for b in bodies)
    assert sum(ep.generated_tokens for ep in episodes) == sum(len(ids) for b in bodies for ids in b["returned"])
    for ep in episodes:  # each model turn: the start of what the server returned for it, ids as they came
        start = 0
        for j in range(1, len(ep.env_mask) + 1):
            if j == len(ep.env_mask) or ep.env_mask[j] != ep.env_mask[start]:
                run = ep.completion_ids[start:j]
                assert ep.env_mask[start] == 0 or any(ids[:len(run)] == run for b in bodies for ids in b["returned"])
                start = j


def test_vllm_named_weights_merges_a_lora_adapter_under_base_names():
    """With ``model.lora`` the server gets the merged weights under the plain model's names (TRL's way), and the
    trainer's model is left unmerged."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.training.rollout_engines import vllm_named_weights

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2))
    plain = {k: v.clone() for k, v in base.named_parameters()}
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    before = {k: v.clone() for k, v in model.named_parameters()}
    sent = {name: t.clone() for name, t in vllm_named_weights(model)}
    assert list(sent) == list(plain)
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.allclose(sent[q], plain[q] + layer.get_delta_weight("default"), atol=1e-6)
    assert not torch.equal(sent[q], plain[q])
    assert all(torch.equal(sent[k], plain[k]) for k in plain if k != q)
    assert all(torch.allclose(v, before[k], atol=1e-6) for k, v in model.named_parameters())


def gpu_smoke(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_gpu_smoke_parses_its_arguments_and_refuses_cleanly_without_a_gpu():
    """``benchmarks/gpu_smoke.py`` documents itself, rejects bad arguments, and on a machine without CUDA or vLLM
    stops at once with exit status 2 and one line saying what is missing (it never starts a run here)."""
    usage = gpu_smoke("--help")
    assert usage.returncode == 0
    for option in ("--server", "--preset", "--steps", "--gpu", "--port", "--environment"):
        assert option in usage.stdout
    assert gpu_smoke("--preset", "nope").returncode == 2
    refused = gpu_smoke("--steps", "4")
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_smoke: ") and ("CUDA" in lines[0] or "vllm" in lines[0])
    assert refused.stdout == ""
