"""Agents (#47): a plain ``openai``-SDK function trains through the OpenAI-compatible endpoint the episode runner
serves (grpo.environments.agents, grpo.environments.endpoint). The real ``openai`` package talks to the real
endpoint in every test; ``generate`` is scripted where a test needs known tokens (the runner's input contract, as in
tests/test_episodes.py) and is the tiny policy's sampler on the trainer's paths (sync and CPU generator process)."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import openai
import pytest
import torch

from grpo.algo.group_balancing import BALANCED_ROWS
from grpo.environments import make_environment
from grpo.environments.agents import register_agent
from grpo.environments.endpoint import SERVED_MODEL, endpoint, sampling_params
from grpo.environments.episodes import ENV_LOGPROB, run_episodes
from tests.test_episodes import EOS, TOK, enc

RECORDED: dict[str, list] = {}


class Scripted:
    """The runner's ``generate``: each episode (told apart by its first 6 tokens) writes its next scripted turn
    (``<eos>``: the end-of-sequence token), with log-probs ``-(turn + 1) / 10 - j / 1000``; it samples at the run's
    temperature 1.0 (``sampling``)."""

    sampling = sampling_params(1.0)

    def __init__(self, turns: dict[str, list[list[int]]], tokenizer=TOK) -> None:
        self.turns, self.tokenizer, self.done = turns, tokenizer, dict.fromkeys(turns, 0)

    def __call__(self, seqs, max_new_tokens, stop_strings):
        out = []
        for seq in seqs:
            key = self.tokenizer.decode(seq[:6])
            ids = self.turns[key][self.done[key]]
            self.done[key] += 1
            out.append((ids, [-(self.done[key]) / 10 - j / 1000 for j in range(len(ids))]))
        return out


def ids(text: str) -> list[int]:
    return enc(text.replace("<eos>", "")) + ([EOS] if text.endswith("<eos>") else [])


def agent_episodes(agent: str, turns: dict[str, list[str]], rows=None, tokenizer=TOK, **kw):
    scripted = Scripted({k: [ids(t) if isinstance(t, str) else t for t in v] for k, v in turns.items()})
    rows = rows or [{"prompt": p} for p in turns]
    kw = {"max_turns": 4, "max_completion_length": 32, "step_timeout": 30.0, **kw}
    return run_episodes([enc(r["prompt"]) for r in rows], [make_environment("agent", agent=agent) for _ in rows],
                        scripted, tokenizer, rows=rows, **kw)


@register_agent("test_recording_agent")
def recording_agent(client: openai.OpenAI, row: dict) -> float:
    """The calculator loop by hand, keeping every response (token ids, prompt ids, log-probs)."""
    text, responses = row["prompt"], []
    while True:
        out = client.completions.create(model=SERVED_MODEL, prompt=text, stop=["]"], logprobs=0)
        responses.append(out.model_dump())
        piece = out.choices[0].text
        text += piece
        if not piece.endswith("]"):
            RECORDED[row["prompt"]] = responses
            return float(piece == row["answer"])
        text += "42|"


def test_an_extending_agent_is_one_sequence_whose_appended_text_is_environment_tokens():
    """Two calls, the second's prompt extending the first's prompt and completion: one sequence, the agent's
    appended ``42|`` as environment tokens (env_mask 0, log-prob ENV_LOGPROB), the responses carrying exactly the
    sampled ids and log-probs (vLLM's field names), the second call's prompt_token_ids the sequence so far."""
    [ep] = agent_episodes("test_recording_agent", {"27+15=": ["[27+15]", "42<eos>"]},
                          rows=[{"prompt": "27+15=", "answer": "42"}])
    assert (ep.reward, ep.stop_reason, ep.error, ep.turns) == (1.0, "eos", None, 2)
    assert ep.prompt_ids == enc("27+15=")
    assert ep.completion_ids == enc("[27+15]") + enc("42|") + enc("42") + [EOS]
    assert ep.env_mask == [1] * 7 + [0] * 3 + [1] * 3
    assert ep.logprobs == pytest.approx([-0.1 - j / 1000 for j in range(7)] + [ENV_LOGPROB] * 3
                                        + [-0.2 - j / 1000 for j in range(3)])
    first, second = RECORDED["27+15="]
    assert first["choices"][0]["token_ids"] == enc("[27+15]") and first["choices"][0]["finish_reason"] == "stop"
    assert first["choices"][0]["prompt_token_ids"] == enc("27+15=")
    assert first["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(ep.logprobs[:7])
    assert second["choices"][0]["prompt_token_ids"] == ep.prompt_ids + ep.completion_ids[:10]
    assert second["choices"][0]["token_ids"] == enc("42") + [EOS] and second["choices"][0]["text"] == "42"
    assert second["model"] == SERVED_MODEL and second["usage"]["completion_tokens"] == 3

    # its MLflow trace: the agent's episode, one chat-model span per call with what the agent appended after it
    from grpo.tracking.traces import episode_trace
    from grpo.training.episodes import episode_record

    ep.environment = "agent"
    _, spans = episode_trace(episode_record(ep, "27+15=", step=1), "0", "run")
    calls = [sp for sp in spans if sp.span_type == "CHAT_MODEL"]
    assert [(sp.outputs, sp.attributes["observation"]) for sp in calls] == [("[27+15]", "42|"), ("42", None)]


def test_the_sampled_ids_are_kept_where_tokenising_their_text_gives_other_ids():
    """A tokenizer with a merge (``4`` ``2`` -> ``42``): the model samples ``4``, ``2`` as two tokens, which the
    text tokenises as one. The episode, the response and the next call's prompt ids keep the two sampled ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("0123456789+=[]|"))
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *chars, "42"])}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[("4", "2")]))
    bpe.pre_tokenizer = pre_tokenizers.Split("|", behavior="isolated")
    bpe.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    four, two, merged = vocab["4"], vocab["2"], vocab["42"]
    assert tok("42", add_special_tokens=False)["input_ids"] == [merged] and tok.decode([four, two]) == "42"

    def t(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    first = t("[") + [four, two] + t("+1]")  # "[42+1]" sampled with 4 and 2 apart: its text tokenises as [..., 42, ...]
    scripted = Scripted({"27+15=": [first, [four, two, tok.eos_token_id]]}, tokenizer=tok)
    [ep] = run_episodes([t("27+15=")], [make_environment("agent", agent="test_recording_agent")], scripted, tok,
                        rows=[{"prompt": "27+15=", "answer": "42"}], max_turns=4, max_completion_length=32,
                        step_timeout=30.0)
    assert ep.error is None and ep.reward == 1.0
    assert t("27+15=[42+1]42|") != t("27+15=") + first + t("42|")  # what re-tokenising the prompt would give
    assert ep.completion_ids == first + [merged, vocab["|"]] + [four, two, tok.eos_token_id]
    assert ep.env_mask == [1] * 6 + [0, 0] + [1] * 3  # the agent's "42|": tokenised once, as text, on its own
    second = RECORDED["27+15="][1]["choices"][0]
    assert second["prompt_token_ids"] == t("27+15=") + first + [merged, vocab["|"]]
    assert second["token_ids"] == [four, two, tok.eos_token_id]


@register_agent("test_rewriting_agent")
def rewriting_agent(client: openai.OpenAI, row: dict) -> float:
    """Rewrites its history twice: a call, then the first call's answer under another prompt (token ids, kept as
    given), a call extending that one after the agent's ``42|``, then a new text prompt; every response kept."""
    responses = []

    def call(prompt, **kw):
        responses.append(client.completions.create(model=SERVED_MODEL, prompt=prompt, logprobs=0, **kw).model_dump())
        return responses[-1]["choices"][0]

    first = call(row["prompt"], stop=["]"])
    second = call(enc("11+11=") + first["token_ids"], stop=["]"])
    call("11+11=" + first["text"] + second["text"] + "42|", stop=["]"])
    call("33+33=")
    RECORDED[row["prompt"]] = responses
    return 1.0


def test_an_agent_that_rewrites_its_history_trains_each_sequence_as_a_sample_of_its_own():
    """Where a call does not extend the previous call's prompt and completion, the sequence so far becomes a sample
    of its own and the episode goes on from the new call's prompt: three samples here, each with exactly the token
    ids the endpoint returned (prompt and completion, a token-id prompt kept as given) and the sampled log-probs,
    the extending call's appended text as environment tokens; the episode's row is its last sample."""
    from grpo.environments.episodes import Sample, rollout_fields
    from grpo.environments.metrics import episode_metrics

    [ep] = agent_episodes("test_rewriting_agent", {"27+15=": ["[27+15]"], "11+11=": ["[1]", "2]"],
                                                    "33+33=": ["66<eos>"]}, rows=[{"prompt": "27+15="}])
    assert (ep.error, ep.reward, ep.turns, ep.stop_reason) == (None, 1.0, 4, "eos")
    r1, r2, r3, r4 = (r["choices"][0] for r in RECORDED["27+15="])

    def logprobs(r):
        return r["logprobs"]["token_logprobs"]

    assert ep.samples == [
        Sample(enc("27+15="), enc("[27+15]"), [1] * 7, pytest.approx(logprobs(r1))),
        Sample(enc("11+11=[27+15]"), enc("[1]42|2]"), [1, 1, 1, 0, 0, 0, 1, 1],
               pytest.approx(logprobs(r2) + [ENV_LOGPROB] * 3 + logprobs(r3))),
    ]
    first, second = ep.samples
    assert (first.prompt_ids, first.completion_ids) == (r1["prompt_token_ids"], r1["token_ids"])
    assert second.prompt_ids == r2["prompt_token_ids"] == enc("11+11=") + r1["token_ids"]  # the ids as sent
    assert second.completion_ids == r2["token_ids"] + enc("42|") + r3["token_ids"]
    assert r3["prompt_token_ids"] == second.prompt_ids + second.completion_ids[:6]
    assert (ep.prompt_ids, ep.completion_ids, ep.env_mask) == (r4["prompt_token_ids"], r4["token_ids"], [1, 1, 1])
    assert ep.completion_ids == enc("66") + [EOS] and ep.logprobs == pytest.approx(logprobs(r4))
    row = rollout_fields([ep])
    assert (row["prompt_ids"], row["completion_ids"], row["env_reward"]) == ([enc("33+33=")], [enc("66") + [EOS]],
                                                                             [1.0])
    assert (ep.model_tokens, ep.env_tokens, ep.first_prompt_ids) == (15, 3, enc("27+15="))
    assert episode_metrics([ep])["env/samples/mean"] == 3.0


CALLS: dict[str, object] = {}
RELEASE = threading.Event()


@register_agent("test_probing_agent")
def probing_agent(client: openai.OpenAI, row: dict) -> float | None:
    """Per row's ``probe``: a refused call then a good one, a raise, a hang."""
    probe = row["probe"]
    if probe == "params":
        for bad in ({"temperature": 0.5}, {"top_p": 0.9}, {"seed": 3}, {"model": "gpt-4o"}):
            try:
                client.completions.create(**{"model": SERVED_MODEL, "prompt": row["prompt"], **bad})
            except openai.APIStatusError as err:
                CALLS[str(bad)] = (err.status_code, err.body["message"])
        client.completions.create(model=SERVED_MODEL, prompt=row["prompt"], temperature=1.0, max_tokens=2)
        CALLS["base_url"] = str(client.base_url)
        CALLS["models"] = [m.id for m in client.models.list()]
        return 0.5
    if probe == "raise":
        client.completions.create(model=SERVED_MODEL, prompt=row["prompt"], stop="]")
        raise ValueError("the agent's parser broke")
    if probe == "hang":
        client.completions.create(model=SERVED_MODEL, prompt=row["prompt"], stop="]")
        RELEASE.wait(120)
        return 1.0
    return None


def test_refused_calls_faults_and_ended_sessions_each_get_one_clear_answer():
    """One round: a call changing the run's sampling (temperature, top_p, seed) or naming another model is refused
    with one clear HTTP error and the agent goes on (the run's temperature and a ``max_tokens`` cap are served); an
    agent that raises and one that hangs past the step timeout end their own episodes with NaN and the reason while
    the round completes; afterwards the ended session answers 409 and an unknown one 404."""
    probes = ["params", "raise", "hang"]
    rows = [{"prompt": f"{i}{i}+{i}{i}=", "probe": p} for i, p in enumerate(probes, 1)]
    turns = {r["prompt"]: ["[1]", "2<eos>"] for r in rows}
    try:
        eps = agent_episodes("test_probing_agent", turns, rows=rows, step_timeout=3.0)
    finally:
        RELEASE.set()
    params, raised, hung = eps
    assert CALLS["{'temperature': 0.5}"] == (400, "temperature=0.5 is refused: sampling parameters come from the run's "
                                              "config (temperature=1.0); leave it unset or send the run's value")
    assert CALLS["{'top_p': 0.9}"][0] == 400 and "top_p=0.9 is refused" in CALLS["{'top_p': 0.9}"][1]
    assert CALLS["{'seed': 3}"][0] == 400 and "seed=3 is refused" in CALLS["{'seed': 3}"][1]
    assert CALLS["{'model': 'gpt-4o'}"] == (404, "model 'gpt-4o' does not exist; this endpoint serves 'policy'")
    assert (params.reward, params.error, params.turns) == (0.5, None, 1) and CALLS["models"] == [SERVED_MODEL]
    assert params.completion_ids[:2] == enc("[1") and params.env_mask[:2] == [1, 1]  # max_tokens=2 cut the turn
    for ep, why in ((raised, "environment step: RuntimeError: agent raised ValueError: the agent's parser broke"),
                    (hung, "environment step: timed out after 3 s")):
        assert math.isnan(ep.reward) and ep.stop_reason == "error" and ep.error == why, ep.error

    ended = openai.OpenAI(base_url=CALLS["base_url"], api_key="x", max_retries=0)
    with pytest.raises(openai.ConflictError, match="its episode has ended"):
        ended.completions.create(model=SERVED_MODEL, prompt="1+1=")
    unknown = openai.OpenAI(base_url=f"{endpoint().url}/sessions/nope/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="unknown session 'nope'"):
        unknown.completions.create(model=SERVED_MODEL, prompt="1+1=")


# ---------------------------------------------------------------- the trainer's paths: sync, CPU generator process

AGENT_TRAINER = {"model.warm_start.steps": 0, "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4,
                 "grpo.max_completion_length": 32, "grpo.temperature": 1.5, "environment.agent": "test_retrying_agent",
                 "grpo.reward_funcs": "[env_reward]"}


def record_episodes(trainer) -> list:
    """The episodes the trainer's rollouts run from now on, as they are handed to TRL (a list filled in place)."""
    episodes, run = [], trainer._episodes_for
    trainer._episodes_for = lambda ids, rows: episodes.extend(run(ids, rows)) or episodes[-len(rows):]
    return episodes


@pytest.mark.integration
def test_the_sync_and_generator_process_paths_train_on_the_same_agent_episodes_and_samples(tmp_path):
    """``tests/retrying_agent.py`` on the micro trainer: a try (two calls, the second extending the first after the
    agent's ``1|``), then a retry that rewrites its history, so every episode is two samples. The sync trainer's
    episodes (its endpoint in this process) and the async trainer's (the agent and the endpoint in the CPU generator
    process) are the same for the same seed, token for token, earlier samples included. In the sync trainer's
    generation batch the episodes' rows come first and each earlier sample follows as a row of its own: its exact
    prompt and completion ids as the runner recorded them, ``tool_mask`` its ``env_mask``,
    ``sampling_per_token_logps`` its recorded log-probs, its episode's advantage, the loss-token count covering it.
    The agent's appended text is environment tokens in every row, whose per-token log-probs get exactly zero
    gradient; the episode metrics are logged; a training step runs on the generator process's episodes, every row
    in a micro-batch."""
    from pathlib import Path

    from grpo.environments import load_environment_module
    from grpo.training.off_policy import loss_mask
    from tests.test_async_episodes import ASYNC, sync_episodes_of_first_batch
    from tests.trainers import logp_gradient, micro_trainer

    load_environment_module(Path(__file__).parent / "retrying_agent.py")
    # two optimisation passes and a KL term: the batch holds old and reference log-probs, the extra rows' included
    sync = micro_trainer(tmp_path / "sync", {**AGENT_TRAINER, "grpo.num_iterations": 2, "grpo.beta": 0.04})
    prompt_ids, rows, expected = sync_episodes_of_first_batch(sync)
    assert all(ep.error is None and len(ep.samples) == 1 and 0 in ep.samples[0].env_mask for ep in expected)

    torch.manual_seed(0)
    episodes = record_episodes(sync)
    batch = sync.assemble_generation_batch([dict(row) for row in rows])
    n = len(episodes)
    picked = [(k, s) for k, ep in enumerate(episodes) for s in ep.samples]
    assert picked and batch["completion_ids"].shape[0] == n + len(picked) == n + sync._call_sample_rows
    for row, (k, sample) in enumerate(picked, start=n):
        size = len(sample.completion_ids)
        assert batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist() == sample.prompt_ids
        assert batch["completion_ids"][row][:size].tolist() == sample.completion_ids
        assert batch["completion_mask"][row].sum() == size
        assert batch["tool_mask"][row][:size].tolist() == sample.env_mask
        assert batch["sampling_per_token_logps"][row][:size].tolist() == pytest.approx(sample.logprobs)
        assert batch["advantages"][row] == batch["advantages"][k]
    assert batch["advantages"][:n].abs().sum() > 0
    assert batch["num_items_in_batch"] == loss_mask(batch).sum()
    with torch.no_grad():  # one forward over the whole batch: the extra rows' old and reference log-probs are TRL's
        logps = sync._get_per_token_logps_and_entropies(
            sync.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].shape[1])[0]
    mask = batch["completion_mask"].bool()
    for key in ("old_per_token_logps", "ref_per_token_logps"):
        assert batch[key][mask].tolist() == pytest.approx(logps[mask].tolist(), abs=1e-5), key
    assert sync._metrics["train"]["env/samples/mean"] == [1 + len(picked) / n]
    for name in ("env/turns/mean", "env/env_tokens/mean", "env/errors", "env/generated_tokens/mean",
                 "env/agent/reward_mean"):
        assert sync._metrics["train"][name], name

    env = (batch["completion_mask"] * (1 - batch["tool_mask"])).bool()
    tok = sync.processing_class
    for i in range(env.shape[0]):  # environment tokens: the agent's "1|" in the first tries, the EOS ending a retry
        text = "".join(tok.convert_ids_to_tokens(t) for t in batch["completion_ids"][i][env[i]].tolist())
        assert text == "1|" if i >= n else text in ("", tok.eos_token), text
    batch = dict(batch, advantages=torch.linspace(-1, 1, batch["advantages"].numel()))
    grad = logp_gradient(sync, batch)
    sampled = (batch["completion_mask"] * batch["tool_mask"]).bool()
    assert env[n:].any() and grad[env].abs().max() == 0 and grad[n:][sampled[n:]].abs().min() > 0

    trainer = micro_trainer(tmp_path / "async", {**AGENT_TRAINER, **ASYNC})
    try:
        got = record_episodes(trainer)
        loss = trainer.training_step(trainer.model, [dict(row) for row in rows], None)
    finally:
        trainer.close_producer()

    def tokens(ep):
        return replace(ep, logprobs=None, environment=None, samples=[replace(s, logprobs=None) for s in ep.samples])

    assert [tokens(ep) for ep in got] == [tokens(ep) for ep in expected]
    for ep, ref in zip(got, expected):
        assert ep.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        for sample, ref_sample in zip(ep.samples, ref.samples):
            assert sample.logprobs == pytest.approx(ref_sample.logprobs, abs=1e-5)
    rows_trained = sum(part.get(BALANCED_ROWS, 0) for part in trainer._buffered_inputs)
    assert rows_trained == n + trainer._call_sample_rows == n + sum(len(ep.samples) for ep in got)
    assert torch.isfinite(loss) and any(p.grad is not None and p.grad.abs().sum() > 0
                                        for p in trainer.model.parameters())


@pytest.mark.integration
def test_per_call_samples_are_each_trained_once_with_one_rows_weight_across_accumulated_micro_steps(tmp_path):
    """Gradient accumulation 2 and ``grpo.steps_per_generation`` 4: one generation round is four micro-steps (two
    optimizer steps). The episodes make 0, 1 or 2 retries (``tests/retrying_agent.py``), so the round's 16 episode
    rows gain 15 sample rows and its 31 rows split unevenly. Over the round's micro-steps, driven through
    ``training_step`` as the training loop drives them (at fixed weights, the optimizer step being the loop's),
    every row is trained exactly once, in micro-batches of near-equal size that record their rows, and the gradient
    of each loss token's log-prob is the one the whole round's objective gives it, whichever micro-batch holds it:
    ``-advantage * steps_per_generation / (accumulation * loss tokens of the round)`` for ``dapo`` (the default),
    ``-advantage / (tokens of its row * per_device_train_batch_size * accumulation)`` for ``grpo``; 0 for
    environment tokens (the ratio to the old log-probs, the appended rows' included, is 1 at fixed weights).
    Advantages are set to distinct values after scoring, so each row is known by its own."""
    from pathlib import Path

    from grpo.environments import load_environment_module
    from grpo.training.off_policy import loss_mask
    from tests.trainers import logp_gradient, micro_trainer

    load_environment_module(Path(__file__).parent / "retrying_agent.py")
    size, accumulation, steps = 4, 2, 4
    trainer = micro_trainer(tmp_path, {**AGENT_TRAINER, "grpo.per_device_train_batch_size": size,
                                       "grpo.gradient_accumulation_steps": accumulation,
                                       "grpo.steps_per_generation": steps})
    trainer.current_gradient_accumulation_steps = accumulation  # what the training loop sets for each window
    rows = [dict(trainer.train_dataset[k // 4], retries=k % 3) for k in range(size * steps)]
    torch.manual_seed(0)
    episodes = record_episodes(trainer)
    whole, assemble = {}, trainer.assemble_generation_batch

    def tagged(inputs):  # the scored batch, each row's advantage a value of its own
        batch = assemble(inputs)
        whole.update(batch, advantages=torch.linspace(0.1, 1.0, batch["advantages"].numel()))
        return whole

    served, captured = [], []
    policy_loss, logps = trainer.compute_policy_loss, trainer._get_per_token_logps_and_entropies

    def record_inputs(model, inputs):
        served.append(inputs)
        return policy_loss(model, inputs)

    def capture(*args, **kwargs):
        out = logps(*args, **kwargs)
        if torch.is_grad_enabled():
            out[0].retain_grad()
            captured.append(out[0])
        return out

    trainer.assemble_generation_batch, trainer.compute_policy_loss = tagged, record_inputs
    trainer._get_per_token_logps_and_entropies = capture
    for _ in range(steps):
        trainer.training_step(trainer.model, rows, None)
    del trainer.assemble_generation_batch, trainer.compute_policy_loss, trainer._get_per_token_logps_and_entropies

    n, extra = len(episodes), sum(len(ep.samples) for ep in episodes)
    total = whole["advantages"].numel()
    assert (n, extra, total, trainer._call_sample_rows) == (16, 15, 31, 15)
    counts = [part["advantages"].numel() for part in served]
    assert len(served) == len(captured) == steps and [part[BALANCED_ROWS] for part in served] == counts
    assert sum(counts) == total and max(counts) - min(counts) == 1
    tags = torch.cat([part["advantages"] for part in served])
    assert sorted(tags.tolist()) == whole["advantages"].tolist()  # every row once: none dropped, none twice
    mask = loss_mask(whole).float()
    assert whole["num_items_in_batch"] == mask.sum() and (mask[n:].sum(-1) > 0).all()

    def index(part):  # each micro-batch row's row in the whole batch
        return [whole["advantages"].tolist().index(a) for a in part["advantages"].tolist()]

    def check(loss, grads, expected):
        for step, (part, grad) in enumerate(zip(served, grads)):
            want = expected[index(part)]
            assert grad.shape == want.shape and torch.allclose(grad, want, rtol=1e-4, atol=1e-9), (
                f"{loss}, micro-step {step} ({part[BALANCED_ROWS]} rows): gradient / expected "
                f"{float(grad.sum() / want.sum()):.4f}")

    adv = whole["advantages"][:, None]
    check("dapo", [out.grad for out in captured], -adv * mask * steps / (accumulation * mask.sum()))
    trainer.loss_type = "grpo"  # the same micro-batches under a loss that averages over a micro-batch's rows
    check("grpo", [logp_gradient(trainer, part) for part in served],
          -adv * mask / (mask.sum(-1, keepdim=True) * size * accumulation))


def test_the_config_names_an_agent_and_an_unknown_one_is_one_line(tmp_path):
    """``environment.agent`` selects a registered agent (an ``--env-module`` file's too); an unknown name, or an
    agent beside another environment name, is one line naming the field."""
    from grpo.config import load_config
    from grpo.environments import load_environment_module
    from grpo.errors import ConfigError

    cfg = load_config("tiny-calculator-agent")
    assert (cfg.environment.name, cfg.environment.agent, cfg.environment.kwargs) == (
        "agent", "calculator_agent", {"agent": "calculator_agent"})
    with pytest.raises(ConfigError, match=r"environment\.agent: unknown agent 'nope'; registered agents: .*"
                                          r"calculator_agent") as err:
        load_config("tiny-calculator-agent", ["environment.agent=nope"])
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"environment\.agent 'calculator_agent' runs in the environment 'agent'; "
                                          r"environment\.name is 'calculator': leave it empty"):
        load_config("tiny-calculator-agent", ["environment.name=calculator"])
    module = tmp_path / "my_agents.py"
    module.write_text("from grpo.environments.agents import register_agent\n\n\n"
                      "@register_agent('my_file_agent')\ndef agent(client, row):\n    return None\n")
    assert load_environment_module(module) == ["my_file_agent"]
    mine = load_config("tiny-calculator-agent", ["environment.agent=my_file_agent"])
    assert (mine.environment.agent, mine.environment.kwargs) == ("my_file_agent", {"agent": "my_file_agent"})


@register_agent("test_async_agent")
async def async_agent(client: openai.AsyncOpenAI, row: dict) -> None:
    """An ``async def`` agent: it gets an ``AsyncOpenAI`` client; returning None leaves the reward to the run."""
    assert isinstance(client, openai.AsyncOpenAI)
    out = await client.completions.create(model=SERVED_MODEL, prompt=row["prompt"], stop="]")
    await client.completions.create(model=SERVED_MODEL, prompt=row["prompt"] + out.choices[0].text + "42|")
    return None


def test_an_async_agent_runs_with_an_async_client_and_may_leave_the_reward_to_the_run():
    [ep] = agent_episodes("test_async_agent", {"27+15=": ["[27+15]", "42<eos>"]})
    assert (ep.error, ep.reward, ep.turns, ep.stop_reason) == (None, None, 2, "eos")
    assert ep.completion_ids == enc("[27+15]42|42") + [EOS] and ep.env_mask == [1] * 7 + [0] * 3 + [1] * 3


@register_agent("test_refusing_agent")
def refusing_agent(client: openai.OpenAI, row: dict) -> float:
    """Two refused calls it catches (another temperature, another model), one good call, then per row's ``probe``
    a raise, a third refused call (a seed) or a call that rewrites its history (a new sample) before returning."""
    for bad in ({"temperature": 0.5}, {"model": "gpt-4o"}):
        try:
            client.completions.create(**{"model": SERVED_MODEL, "prompt": row["prompt"], **bad})
        except openai.APIStatusError:
            pass
    out = client.completions.create(model=SERVED_MODEL, prompt=row["prompt"], stop="]", max_tokens=5)
    if row["probe"] == "raise":
        raise ValueError("the agent's parser broke")
    if row["probe"] == "restart":
        client.completions.create(model=SERVED_MODEL, prompt=row["prompt"] + "0", stop="]", max_tokens=5)
        return 1.0
    try:
        client.completions.create(model=SERVED_MODEL, prompt=row["prompt"] + out.choices[0].text, seed=3)
    except openai.BadRequestError:
        pass
    return 1.0


def test_refused_calls_and_failing_agents_show_in_the_metrics_and_the_trace():
    """What the endpoint recorded of each call reaches the episode (``model_calls``): its token counts, stop,
    ``max_tokens`` and the run's sampling parameters; the calls it refused count in ``env/refused_calls``, an agent
    that raised in ``env/errors``; in the episode's MLflow trace each answered call is a chat-model span with its
    prompt, completion, token counts, sampling parameters and policy version, each refused call an error span with
    its message, a call that restarted the sequence has its own prompt, and a raising agent's root span is an error
    with the reason."""
    from grpo.environments.metrics import episode_metrics
    from grpo.tracking.traces import episode_trace
    from grpo.training.episodes import episode_record

    rows = [{"prompt": "11+11=", "probe": "ok"}, {"prompt": "22+22=", "probe": "raise"},
            {"prompt": "33+33=", "probe": "restart"}]
    ok, raised, restarted = agent_episodes("test_refusing_agent", {r["prompt"]: ["[1]", "[2]"] for r in rows},
                                           rows=rows)
    assert (ok.reward, ok.error, raised.stop_reason) == (1.0, None, "error")
    assert [c.get("refused", "answered")[:24] for c in ok.model_calls] == [
        "temperature=0.5 is refus", "model 'gpt-4o' does not ", "answered", "seed=3 is refused: the r"]
    answered = ok.model_calls[2]
    assert {k: answered[k] for k in ("prompt_tokens", "completion_tokens", "finish_reason", "route", "max_tokens",
                                     "stop", "temperature", "tool_calls")} == {
        "prompt_tokens": len(enc("11+11=")), "completion_tokens": len(enc("[1]")), "finish_reason": "stop",
        "route": "completions", "max_tokens": 5, "stop": ["]"], "temperature": 1.0, "tool_calls": []}
    assert [c.get("status") for c in raised.model_calls] == [400, 404, None]
    metrics = episode_metrics([ok, raised, restarted])
    assert (metrics["env/refused_calls"], metrics["env/errors"]) == (7 / 3, 1 / 3)

    ok.environment = raised.environment = "agent"
    _, spans = episode_trace(episode_record(ok, "11+11=", step=8, policy_version=7), "0", "run")
    [root] = [sp for sp in spans if sp.parent_id is None]
    [call] = [sp for sp in spans if sp.span_type == "CHAT_MODEL"]
    refused = [sp for sp in spans if sp.name == "refused call"]
    assert (root.attributes["refused_calls"], root.attributes["policy_version"]) == (3, 7)
    assert (call.inputs, call.outputs) == ({"prompt": "11+11="}, "[1]")
    assert {k: call.attributes[k] for k in ("prompt_tokens", "completion_tokens", "temperature", "top_p",
                                            "policy_version", "max_tokens")} == {
        "prompt_tokens": 6, "completion_tokens": 3, "temperature": 1.0, "top_p": 1.0, "policy_version": 7,
        "max_tokens": 5}
    assert [(sp.span_type, sp.status.status_code, sp.attributes["status"]) for sp in refused] == [
        ("LLM", "ERROR", 400), ("LLM", "ERROR", 404), ("LLM", "ERROR", 400)]
    assert refused[2].status.description.startswith("seed=3 is refused")
    assert refused[1].start_time_ns <= call.start_time_ns <= refused[2].start_time_ns <= root.end_time_ns
    _, spans = episode_trace(episode_record(raised, "22+22=", step=8), "0", "run")
    [root] = [sp for sp in spans if sp.parent_id is None]
    assert root.status.status_code == "ERROR" and "agent raised ValueError: the agent's parser broke" in \
        root.status.description
    restarted.environment = "agent"
    assert [c.get("restart", False) for c in restarted.model_calls if "refused" not in c] == [False, True]
    _, spans = episode_trace(episode_record(restarted, "33+33=", step=8), "0", "run")
    calls = [sp for sp in spans if sp.span_type == "CHAT_MODEL"]
    assert [(sp.inputs["prompt"], sp.outputs, sp.attributes["prompt_tokens"]) for sp in calls] == [
        ("33+33=", "[1]", 6), ("33+33=0", "[2]", 7)]
