"""Protocol chat end to end (issue #30): TRL's own tool loop, through the platform's trainer and pipeline.

The model is a user's tool-calling chat model built here, offline (:func:`tests.own_model.build_tool_calling_model`):
a tiny Qwen2 with TRL's Qwen2.5 chat template, fine-tuned to call the registered ``calculator`` tool. The config is
the one a user writes: ``environment: {name: tool_use, protocol: chat, tools: [calculator]}``.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
    ``tool`` message per call (by ``tool_call_id``), the model called again until it answers."""
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
            result = get_tool(call.function.name)(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return 0.0


def test_a_chat_agent_calls_its_tools_through_chat_completions_on_the_tool_calling_model(tool_caller):
    """An ``openai``-SDK agent on ``/v1/chat/completions`` with ``tools``, the tool-calling model answering greedily
    (evaluation's generate): the model's calls come back as OpenAI ``tool_calls``, the agent runs them and calls again;
    the episode is one sequence whose environment tokens are exactly the template's tool messages, its prompt the
    conversation rendered with the tool's schema, and each response's ids are the episode's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.environments import make_environment, tool_schema
    from grpo.environments.agents import AGENTS
    from grpo.environments.chat import turn_suffix_text
    from grpo.environments.episodes import run_episodes
    from grpo.training.evaluation import episode_generator

    if "test_chat_calculator_agent" not in AGENTS.names():
        AGENTS.register("test_chat_calculator_agent")(_chat_calculator_agent)
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
