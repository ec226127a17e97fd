"""Protocol chat end to end (issue #30): TRL's own tool loop, through the platform's trainer and pipeline.

The model is a user's tool-calling chat model built here, offline (:func:`tests.own_model.build_tool_calling_model`):
a tiny Qwen2 with TRL's Qwen2.5 chat template, fine-tuned to call the registered ``calculator`` tool. The config is
the one a user writes: ``environment: {name: tool_use, protocol: chat, tools: [calculator]}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
import torch
import yaml

from grpo.environments import get_tool
from grpo.environments.chat import tool_suffix_text
from tests.conftest import MICRO, REPO
from tests.own_model import build_tool_calling_model, write_tool_dataset
from tests.trainers import logp_gradient, micro_trainer

pytestmark = pytest.mark.integration

CHAT = {"environment.name": "tool_use", "environment.protocol": "chat", "environment.tools": "[calculator]",
        "environment.max_tool_calling_iterations": 2, "model.warm_start.steps": 0, "data.prompt_format": "chat",
        "grpo.max_completion_length": 96, "grpo.reward_funcs": "[exact_match]",
        "grpo.temperature": 0.3}  # the tiny model writes well-formed calls when sampled cool


@pytest.fixture(scope="module")
def tool_caller(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-caller")
    return build_tool_calling_model(root / "model"), write_tool_dataset(root / "problems.jsonl")


@pytest.fixture(scope="module")
def chat_batch(tool_caller, tmp_path_factory):
    """The platform's trainer on the tool-calling model and one scored generation batch (2 prompts x 4)."""
    model_dir, data_file = tool_caller
    trainer = micro_trainer(tmp_path_factory.mktemp("chat"), {
        **CHAT, "model.name_or_path": model_dir, "data.source": data_file, "grpo.per_device_train_batch_size": 8,
        "grpo.num_generations": 4})
    torch.manual_seed(0)
    rows = [dict(trainer.train_dataset[i]) for i in range(2) for _ in range(4)]
    return trainer, rows, trainer.assemble_generation_batch(rows)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of zeros."""
    spans, start = [], None
    for j, m in enumerate([*mask, 1]):
        if m == 0 and start is None:
            start = j
        elif m == 1 and start is not None:
            spans.append((start, j))
            start = None
    return spans


def test_trls_tool_loop_calls_the_tool_and_masks_its_answer_as_injected(chat_batch):
    """The model's tool calls ran: each tool-masked span is exactly the ids of the chat template's tool message for
    the calculator's answer to that call (never re-tokenised with the model's tokens around it), and TRL logged its
    tool metrics."""
    trainer, rows, batch = chat_batch
    tok = trainer.processing_class
    calc = get_tool("calculator")
    calls = 0
    for i in range(len(rows)):
        n = int(batch["completion_mask"][i].sum())
        ids, mask = batch["completion_ids"][i, :n].tolist(), batch["tool_mask"][i, :n].tolist()
        before = 0
        for start, end in _spans(mask):
            turn = tok.decode(ids[before:start], skip_special_tokens=True)
            expression = json.loads(turn.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]["expression"]
            expected = tool_suffix_text(tok, [{"role": "tool", "name": "calculator", "content": calc(expression)}])
            assert ids[start:end] == tok(expected, add_special_tokens=False)["input_ids"]
            calls, before = calls + 1, end
    assert calls >= len(rows) // 2, f"{calls} tool calls in {len(rows)} episodes: the model did not call the tool"
    logged = trainer._metrics["train"]
    assert logged["tools/call_frequency"][-1] == pytest.approx(calls / len(rows))  # TRL's own count
    assert logged["env/tools/calculator/calls"][-1] == pytest.approx(calls / len(rows))  # the platform's, per tool
    assert logged["env/tools/calculator/failures"][-1] == 0 and logged["env/tools/calculator/latency_s"][-1] > 0


def test_tool_answers_carry_exactly_zero_gradient(chat_batch):
    trainer, _, batch = chat_batch
    batch = dict(batch)
    batch["advantages"] = torch.linspace(-1, 1, batch["advantages"].numel())
    tool = (batch["completion_mask"] * (1 - batch["tool_mask"])).bool()
    assert tool.any()
    grad = logp_gradient(trainer, batch)
    assert grad[tool].abs().max() == 0
    assert grad[~tool & batch["completion_mask"].bool()].abs().max() > 0
    assert batch["num_items_in_batch"] == (batch["completion_mask"] * batch["tool_mask"]).sum()


def test_rewards_read_the_models_last_message_not_the_tools(chat_batch):
    """exact_match scores the assistant's final message; a completion ending on a tool message (cut off after the
    call) is scored on the call, never on the tool's answer."""
    from grpo.rewards import exact_match

    trainer, rows, _ = chat_batch
    answer = rows[0]["answer"]
    cut = [{"role": "assistant", "content": "", "tool_calls": [{}]}, {"role": "tool", "content": answer}]
    done = [*cut, {"role": "assistant", "content": answer}]
    assert exact_match([cut, done], [answer, answer]) == [0.0, 1.0]


def test_grpo_run_trains_and_evaluates_through_the_tool_loop(tool_caller, tmp_path, prefect_server):
    """`grpo run` with protocol chat: prep, plan (prompt lengths with the tool's schema), evaluation through the same
    tool loop before and after, and training through TRL's; the summary has the episodes' figures."""
    model_dir, data_file = tool_caller
    settings = {**CHAT, "model.name_or_path": str(model_dir), "data.source": str(data_file), "grpo.max_steps": 2,
                "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4, "grpo.logging_steps": 1,
                "evaluation.num_prompts": 8, "evaluation.pass_k": 0, "output_dir": str(tmp_path / "runs")}
    args = [f"{k}={v}" for k, v in settings.items()]
    proc = subprocess.run([sys.executable, "-m", "grpo", "run", "--config", str(MICRO), "--run-name", "chat",
                           *[a for kv in args for a in ("--set", kv)]], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=prefect_server.env(HF_HUB_OFFLINE="1"))  # the session's Prefect server
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "chat"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    before = json.loads((run / "eval_before.json").read_text())
    assert before["env"]["tool_call_rate"] > 0.5 and before["env"]["turns_mean"] > 1.5, before["env"]
    assert "<tool_response>" in before["samples"][0]["completion"]
    metrics = [json.loads(line)["metrics"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(m.get("tools/call_frequency", 0) > 0 for m in metrics), metrics
    assert yaml.safe_load((run / "config.yaml").read_text())["environment"]["protocol"] == "chat"


def test_evaluation_runs_trls_loop_through_the_episode_runner_with_tool_faults():
    """ChatToolLoop in THE episode runner, with scripted model turns: a call that raises answers its error text and
    counts as a failure, an unknown tool is counted apart, the end-of-turn token ends a turn (not the episode) while
    tools are called, the tool messages are the template's own tokens, and the last message is scored."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo.environments.builtin import ToolUseEnvironment
    from grpo.environments.episodes import run_episodes
    from grpo.training.chat_loop import ChatToolLoop
    from tests.own_model import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = qwen2_5_chat_template
    eos = tok.eos_token_id
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*"}}\n</tool_call>',
             '<tool_call>\n{"name": "abacus", "arguments": {}}\n</tool_call>',
             '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n</tool_call>', "7"]
    script = iter(turns)

    def generate(seqs, max_new_tokens, stops):
        return [(tok(next(script), add_special_tokens=False)["input_ids"] + [eos], None) for _ in seqs]

    loop = ChatToolLoop(tok, ToolUseEnvironment(), [get_tool("calculator")],
                        score=lambda answer, row: float(answer.strip() == row["answer"]))
    [ep] = run_episodes([tok("Q", add_special_tokens=False)["input_ids"]], [loop], generate, tok,
                        rows=[{"answer": "7"}], max_turns=5, max_completion_length=400)
    assert (ep.turns, ep.stop_reason, ep.reward, ep.error) == (4, "eos", 1.0, None)
    assert [(name, status) for _, name, status, _ in ep.tool_trace] == [
        ("calculator", "error"), ("abacus", "unknown"), ("calculator", "ok")]
    assert ep.tool_failures == {"calculator": 1} and ep.unknown_tool_calls == 1
    env_ids = [t for t, m in zip(ep.completion_ids, ep.env_mask) if m == 0]
    answers = [tool_suffix_text(tok, [{"role": "tool", "name": n, "content": c}]) for n, c in [
        ("calculator", "{'error': 'bad expression'}"), ("abacus", "{'error': 'Tool abacus not found'}"),
        ("calculator", "7")]]
    assert env_ids == [t for a in answers for t in tok(a, add_special_tokens=False)["input_ids"]]
    assert "<tool_response>\n7\n</tool_response>" in answers[2]


def test_the_plan_and_the_warm_start_see_the_prompt_with_the_tools_schema(tool_caller, tmp_path):
    """TRL renders every prompt of the tool loop with the tools' schemas (~230 tokens here): the plan counts those
    tokens and the warm start demonstrates after them, as for any other prompt they see what training sees."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from grpo.config import load_config
    from grpo.pipeline.prep import load_prepared
    from grpo.pipeline.stages import cached_plan, cached_prep
    from grpo.training.policy import warm_start_pairs
    from tests.conftest import micro_overrides

    model_dir, data_file = tool_caller
    cfg = load_config(MICRO, micro_overrides(tmp_path, **CHAT, **{"model.name_or_path": model_dir,
                                                                   "data.source": data_file}))
    prep = cached_prep(cfg)
    data = load_prepared(prep["data_dir"])
    plan = cached_plan(cfg, prep["data_dir"], prep["content_hash"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    with_tools = [len(tok.apply_chat_template(p, tools=[get_tool("calculator")], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)) for p in data["train"]["prompt"]]
    rows = pq.read_table(plan["plan_path"], columns=["prompt_index", "prompt_tokens"]).to_pylist()
    assert [r["prompt_tokens"] for r in rows] == [with_tools[r["prompt_index"]] for r in rows]
    assert min(with_tools) > 200
    prompts, _ = warm_start_pairs(data, cfg, tok)
    assert '"name": "calculator"' in prompts[0] and prompts[0].endswith("<|im_start|>assistant\n")


def test_the_tool_ledger_records_environment_methods_as_trl_reads_them():
    """TRL lists an environment's methods on its class and takes them from the instance: the ledger's instance
    attributes are what it calls, with the schema of the method they wrap; a raising call still raises and counts."""
    import inspect

    from transformers.utils import get_json_schema

    from grpo.environments.chat import ToolLedger

    class Shelf:
        def reset(self, **row):
            return None

        def lookup(self, key: str) -> str:
            """Look a key up.

            Args:
                key: the key
            """
            return {"a": "1"}[key]

    ledger = ToolLedger()
    env = ledger.instrumented(Shelf)()
    methods = {name: getattr(env, name) for name, _ in inspect.getmembers(type(env), inspect.isfunction)
               if name != "reset"}
    assert get_json_schema(methods["lookup"]) == get_json_schema(Shelf().lookup)
    assert methods["lookup"](key="a") == "1"
    with pytest.raises(KeyError):
        methods["lookup"](key="b")
    m = ledger.metrics(episodes=4)
    assert (m["env/tools/lookup/calls"], m["env/tools/lookup/failures"]) == (0.5, 0.25)
    assert m["env/tools/lookup/latency_s"] >= 0 and ledger.metrics(episodes=4)["env/tools/lookup/calls"] == 0


CHAT_RESPONSES: list[dict] = []


def _chat_calculator_agent(client, row: dict) -> float:
    """A chat agent as people write them: ``tools`` in the request, the SDK's message appended as it came back, a
    ``tool`` message per call (by ``tool_call_id``; a call that fails answers its error), the model called again until
    it answers."""
    from grpo.environments import tool_schema

    messages, tools = list(row["prompt"]), [tool_schema("calculator")]
    for _ in range(3):
        out = client.chat.completions.create(model="policy", messages=messages, tools=tools, logprobs=True)
        CHAT_RESPONSES.append(out.model_dump())
        message = out.choices[0].message
        if not message.tool_calls:
            return float((message.content or "").strip() == row["answer"])
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                result = get_tool(call.function.name)(**json.loads(call.function.arguments))
            except Exception as err:  # noqa: BLE001 - a bad call's error goes back to the model, as agents do
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return 0.0


def _register_chat_agent() -> None:
    """Registered by the tests that run it (not at import: the registry lists it to every test of the process)."""
    from grpo.environments.agents import AGENTS

    if "test_chat_calculator_agent" not in AGENTS.names():
        AGENTS.register("test_chat_calculator_agent")(_chat_calculator_agent)


def _summarising_chat_agent(client, row: dict) -> float:
    """A chat agent that rewrites its history: its second call's conversation is a summary of the first answer, not
    the first conversation and its answer."""
    first = client.chat.completions.create(model="policy", messages=list(row["prompt"]), logprobs=True)
    said = first.choices[0].message.content or ""
    again = [{"role": "user", "content": f"You said {said!r}. Say it again."}]
    second = client.chat.completions.create(model="policy", messages=again, logprobs=True)
    CHAT_RESPONSES.extend([first.model_dump(), second.model_dump(), {"again": again}])
    return 1.0


def test_a_chat_agent_that_rewrites_its_conversation_trains_each_conversation_as_a_sample(tool_caller):
    """A chat call whose messages are not the previous call's messages and its answer starts the episode's next
    sample: the first conversation and its answer as the endpoint returned them, then the new conversation rendered
    whole with the chat template and its answer (the episode's row)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.training.chat_loop  # noqa: F401 - the endpoint's chat parser, as every rollout path sets it
    from grpo.environments import make_environment
    from grpo.environments.agents import AGENTS
    from grpo.environments.episodes import run_episodes
    from grpo.training.evaluation import episode_generator

    if "test_summarising_chat_agent" not in AGENTS.names():
        AGENTS.register("test_summarising_chat_agent")(_summarising_chat_agent)
    model_dir, data_file = tool_caller
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    row = json.loads(data_file.read_text().splitlines()[0])
    CHAT_RESPONSES.clear()
    [ep] = run_episodes([[0]], [make_environment("agent", agent="test_summarising_chat_agent")],
                        episode_generator(model, tok, do_sample=False), tok, rows=[row], max_turns=4,
                        max_completion_length=160, step_timeout=60.0)
    first, second, again = CHAT_RESPONSES
    assert (ep.error, ep.reward, ep.turns, len(ep.samples)) == (None, 1.0, 2, 1)

    def rendered(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]

    [sample] = ep.samples
    assert sample.prompt_ids == first["prompt_token_ids"] == rendered(row["prompt"])
    assert sample.completion_ids == first["choices"][0]["token_ids"] and sample.env_mask == [1] * len(
        sample.completion_ids)
    assert ep.prompt_ids == second["prompt_token_ids"] == rendered(again["again"])
    answer = second["choices"][0]["token_ids"]
    assert ep.completion_ids[:len(answer)] == answer and ep.env_mask[:len(answer)] == [1] * len(answer)


def test_a_chat_agent_calls_its_tools_through_chat_completions_on_the_tool_calling_model(tool_caller):
    """An ``openai``-SDK agent on ``/v1/chat/completions`` with ``tools``, the tool-calling model answering greedily
    (evaluation's generate): the model's calls come back as OpenAI ``tool_calls``, the agent runs them and calls again;
    the episode is one sequence whose environment tokens are exactly the template's tool messages, its prompt the
    conversation rendered with the tool's schema, and each response's ids are the episode's. The model's tool calls
    are the episode's tool calls: the tool metrics and evaluation's ``tool_call_rate`` count them, and its trace shows
    them under the calls that made them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.training.chat_loop  # noqa: F401 - the endpoint's chat parser, as every rollout path sets it
    from grpo.environments import make_environment, tool_schema
    from grpo.environments.chat import turn_suffix_text
    from grpo.environments.episodes import run_episodes
    from grpo.training.evaluation import episode_generator

    _register_chat_agent()
    model_dir, data_file = tool_caller
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in data_file.read_text().splitlines()[:4]]
    CHAT_RESPONSES.clear()
    eps = run_episodes([[0]] * len(rows), [make_environment("agent", agent="test_chat_calculator_agent")
                                           for _ in rows], episode_generator(model, tok, do_sample=False), tok,
                       rows=rows, max_turns=4, max_completion_length=160, step_timeout=60.0)
    assert all(ep.error is None for ep in eps), [ep.error for ep in eps]
    called = [ep for ep in eps if ep.turns > 1]  # the model called the tool, read its answer and answered
    assert called and all(ep.stop_reason == "eos" and ep.reward in (0.0, 1.0) for ep in called), [
        (ep.turns, ep.reward, ep.transcript) for ep in eps]
    for ep, row in zip(eps, rows):
        rendered = tok.apply_chat_template(row["prompt"], tools=[tool_schema("calculator")],
                                           add_generation_prompt=True, tokenize=False)
        assert ep.prompt_ids == tok(rendered, add_special_tokens=False)["input_ids"]
    ep = called[0]
    spans = _spans(ep.env_mask)
    env_texts = [tok.decode(ep.completion_ids[a:b]) for a, b in spans]
    tool_calls = [c for r in CHAT_RESPONSES for c in r["choices"][0]["message"]["tool_calls"] or []]
    assert tool_calls and all(c["type"] == "function" and c["function"]["name"] == "calculator" for c in tool_calls)
    results = [str(get_tool("calculator")(**json.loads(c["function"]["arguments"]))) for c in tool_calls]
    suffixes = {turn_suffix_text(tok, [{"role": "tool", "content": r}]) for r in results}
    assert env_texts and set(env_texts[: ep.turns - 1]) <= suffixes, (env_texts, suffixes)
    # every response's ids are a run of the episode's model tokens, its prompt ids the sequence before it
    sequence = ep.prompt_ids + ep.completion_ids
    mine = [r for r in CHAT_RESPONSES if r["prompt_token_ids"][: len(ep.prompt_ids)] == ep.prompt_ids]
    assert len(mine) == ep.turns
    for r in mine:
        start = len(r["prompt_token_ids"])
        assert sequence[:start] == r["prompt_token_ids"]
        assert sequence[start: start + len(r["choices"][0]["token_ids"])] == r["choices"][0]["token_ids"]
        assert r["choices"][0]["logprobs"] is None  # evaluation's generate records none (training's does)

    from grpo.environments.metrics import episode_metrics
    from grpo.tracking.traces import episode_trace
    from grpo.training.episodes import episode_record
    from grpo.training.evaluation import episode_figures

    for e in eps:  # each call's OpenAI tool_calls, as the endpoint recorded them, are the episode's tool calls
        names = [name for call in e.model_calls for name in call["tool_calls"]]
        assert e.tool_calls == ({"calculator": len(names)} if names else {}) and e.unknown_tool_calls == 0
        assert [c["route"] for c in e.model_calls] == ["chat/completions"] * e.turns
    calls = sum(e.tool_calls.get("calculator", 0) for e in eps)
    metrics = episode_metrics(eps)
    assert metrics["env/tools/calculator/calls"] == calls / len(eps) > 0 and metrics["env/tools/failure_frequency"] == 0
    assert metrics["env/tools/calculator/latency_s"] >= 0 and metrics["env/refused_calls"] == 0
    assert episode_figures(eps)["tool_call_rate"] == sum(bool(e.tool_calls) for e in eps) / len(eps) > 0
    ep.environment = "agent"
    _, trace = episode_trace(episode_record(ep, tok.decode(ep.prompt_ids, skip_special_tokens=True), 1), "0", "run")
    turns = {sp.span_id: sp for sp in trace if sp.span_type == "CHAT_MODEL"}
    tools = [sp for sp in trace if sp.span_type == "TOOL"]
    assert [sp.attributes["tool_calls"] for sp in turns.values()] == [c["tool_calls"] for c in ep.model_calls]
    assert tools and all(sp.name == "calculator" and sp.attributes["status"] == "ok" for sp in tools)
    assert all(turns[sp.parent_id].attributes["tool_calls"] for sp in tools)


def test_serve_model_answers_chat_completions_with_tools(tool_caller, tmp_path):
    """``grpo serve-model`` (the real CLI process) on the tool-calling chat model, called through the ``openai``
    SDK on ``/v1/chat/completions`` with ``tools``: the model's call comes back as OpenAI ``tool_calls`` (finish
    reason ``tool_calls``) with vLLM's ``prompt_token_ids`` (the conversation rendered with the tool's schema) and
    ``token_ids``; the SDK's assistant message and a ``tool`` message sent back are rendered as the template's turns."""
    from transformers import AutoTokenizer

    from grpo.environments import tool_schema
    from tests.servers import free_port, interrupt

    model_dir, data_file = tool_caller
    tok = AutoTokenizer.from_pretrained(model_dir)
    row = json.loads(data_file.read_text().splitlines()[0])
    tools = [tool_schema("calculator")]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grpo.app.cli", "serve-model", str(model_dir), "--port", str(port),
                             "--model-name", "caller"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        line = proc.stdout.readline()  # hang bound: the test's own
        assert line == f"serving caller at http://127.0.0.1:{port}/v1 (Ctrl-C stops)\n", (line, proc.poll())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        out = client.chat.completions.create(model="caller", messages=row["prompt"], tools=tools, temperature=0,
                                             max_tokens=64, logprobs=True)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        [call] = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.type == "function" and call.function.name == "calculator" and set(arguments) == {"expression"}
        rendered = tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=False)
        assert out.model_extra["prompt_token_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
        ids = choice.model_extra["token_ids"]
        assert "<tool_call>" in tok.decode(ids) and ids[-1] == tok.eos_token_id
        assert len(choice.logprobs.content) == len(ids) and all(t.logprob <= 0 for t in choice.logprobs.content)
        assert out.usage.prompt_tokens == len(out.model_extra["prompt_token_ids"]) and out.usage.completion_tokens \
            == len(ids)

        answer = str(get_tool("calculator")(**arguments))
        messages = [*row["prompt"], choice.message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": answer}]
        final = client.chat.completions.create(model="caller", messages=messages, tools=tools, temperature=0,
                                               max_tokens=32)
        expected = tok.apply_chat_template([*row["prompt"], {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
            {"role": "tool", "content": answer}], tools=tools, add_generation_prompt=True, tokenize=False)
        assert final.model_extra["prompt_token_ids"] == tok(expected, add_special_tokens=False)["input_ids"]
        assert final.choices[0].model_extra["token_ids"] and final.choices[0].finish_reason in ("stop", "tool_calls")
    finally:
        interrupt(proc, timeout=60)
    out_text, err = proc.communicate()
    assert proc.returncode == 0 and out_text.strip().splitlines() == ["stopped"], err
    assert "Traceback" not in err, err


def test_a_chat_agent_with_tools_trains_and_its_calls_are_traced(tool_caller, tmp_path, mlflow_server):
    """Two optimizer steps of the chat agent above on the tool-calling model (``environment.agent``, the sync
    trainer with its endpoint in this process): the logged tool metrics are the model's calls, and the run's MLflow
    traces (a real server) show each model call as a chat-model span with its prompt, token counts, sampling
    parameters and policy version, each tool call as a tool span under the call that made it."""
    from mlflow import MlflowClient

    from grpo.tracking.tracker import MlflowCallback, MlflowTracker

    _register_chat_agent()
    model_dir, data_file = tool_caller
    trainer = micro_trainer(tmp_path, {
        "model.name_or_path": model_dir, "data.source": data_file, "data.prompt_format": "chat",
        "environment.agent": "test_chat_calculator_agent", "model.warm_start.steps": 0, "grpo.temperature": 0.3,
        "grpo.reward_funcs": "[env_reward]", "grpo.max_completion_length": 96, "grpo.per_device_train_batch_size": 4,
        "grpo.num_generations": 4, "grpo.max_steps": 2, "grpo.logging_steps": 1, "grpo.save_steps": 100,
        "environment.trace_episodes_per_log": 2})
    tracker = MlflowTracker(mlflow_server.uri, tmp_path / "spool", flush_interval=0.2, max_backoff=1.0,
                            http_timeout=5.0)
    run_id = tracker.start("chat-agent", "grpo-chat-agent-test")
    trainer.add_callback(MlflowCallback(tracker))
    trainer.train()
    tracker.close(timeout=30)
    logged = [entry for entry in trainer.state.log_history if "env/turns/mean" in entry]
    assert len(logged) == 2 and all(entry["env/errors"] == 0 for entry in logged), logged
    assert all(entry["env/tools/calculator/calls"] > 0 and entry["env/tools/call_frequency"] > 0 for entry in logged)
    assert all(entry["env/refused_calls"] == 0 and entry["env/turns/mean"] > 1 for entry in logged), logged

    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_run(run_id).info.experiment_id
    traces = client.search_traces(locations=[experiment], run_id=run_id, max_results=10)
    assert len(traces) == 4  # 2 a logging interval
    tool_spans = 0
    for trace in traces:
        spans = trace.data.spans
        [root] = [s for s in spans if s.parent_id is None]
        calls = [s for s in spans if s.span_type == "CHAT_MODEL"]
        assert root.name == "agent" and root.attributes["refused_calls"] == 0 and len(calls) == root.attributes["turns"]
        for call in calls:
            assert call.parent_id == root.span_id and call.inputs["prompt"].startswith(root.inputs["prompt"])
            assert call.attributes["route"] == "chat/completions" and call.attributes["temperature"] == 0.3
            assert call.attributes["prompt_tokens"] > 200 and call.attributes["completion_tokens"] > 0
            assert call.attributes["policy_version"] == root.attributes["step"] - 1  # the sync trainer's weights
        for tool in (s for s in spans if s.span_type == "TOOL"):
            [call] = [c for c in calls if c.span_id == tool.parent_id]
            assert tool.name == "calculator" and "calculator" in call.attributes["tool_calls"]
            tool_spans += 1
    assert tool_spans > 0
