"""``grpo serve-model`` (#47): a saved model behind the agent endpoint's OpenAI-compatible API for eval harnesses,
queried with the real ``openai`` package from the real CLI process. The model is a shipped tiny policy (the default
preset's warm start, addition: ``12+34=`` -> ``46``) copied to a run's ``model`` folder; nothing trains."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import openai
import pytest

from grpo.training.policy import shipped_policies
from tests.servers import free_port, interrupt

ADDITION = "tiny-a2145e1e571b4814"  # the default tiny preset's model: digits, '+', '='


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_serve_model_answers_openai_clients_and_stops_on_ctrl_c(tmp_path):
    folder = tmp_path / "runs" / "addtiny" / "model"
    shutil.copytree(str(shipped_policies().joinpath(ADDITION)), folder)

    bad = _cli("serve-model", "runs/nothing/model", "--port", str(free_port()), cwd=tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: model folder runs/nothing/model: no such folder (give a run's model folder, e.g. runs/NAME/model)"]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "grpo.app.cli", "serve-model", "runs/addtiny/model", "--port",
                             str(port), "--max-batch", "4"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()  # hang bound: the client's timeout below, the test's own
        assert line == f"serving addtiny at http://127.0.0.1:{port}/v1 (Ctrl-C stops)\n", (line, proc.poll())

        taken = _cli("serve-model", "runs/addtiny/model", "--port", str(port), cwd=tmp_path)
        assert taken.returncode == 2
        assert taken.stderr.strip().splitlines() == [
            f"error: port {port} already in use on 127.0.0.1; pick a free one, e.g. grpo serve-model "
            f"runs/addtiny/model --port {port + 1}"]

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120, max_retries=0)
        assert [m.id for m in client.models.list()] == ["addtiny"]

        greedy = [client.completions.create(model="addtiny", prompt="12+34=", temperature=0, max_tokens=8,
                                            logprobs=1) for _ in range(2)]
        first = greedy[0].choices[0]
        assert first.text == greedy[1].choices[0].text and first.text, first  # greedy: deterministic
        assert first.model_extra["prompt_token_ids"] == [5, 6, 3, 7, 8, 14]  # vLLM's fields: exact tokens
        ids = first.model_extra["token_ids"]
        assert ids and len(first.logprobs.token_logprobs) == len(ids)
        assert first.finish_reason == "stop"  # the model wrote its end-of-sequence token within 8

        stop = first.text[-1]
        cut = client.completions.create(model="addtiny", prompt="12+34=", temperature=0, max_tokens=8, stop=[stop])
        assert cut.choices[0].text == first.text[:first.text.index(stop)]  # OpenAI's: text ends before the stop
        assert cut.choices[0].finish_reason == "stop"
        # sampling stopped at the stop string's token (TurnStop), not at the end of sequence: the tokens through it
        assert cut.choices[0].model_extra["token_ids"] == ids[:len(first.text)]
        short = client.completions.create(model="addtiny", prompt="12+34=", temperature=0, max_tokens=1)
        assert short.choices[0].finish_reason == "length" and len(short.choices[0].model_extra["token_ids"]) == 1

        with pytest.raises(openai.BadRequestError, match="n=2 is not served"):
            client.completions.create(model="addtiny", prompt="1+1=", n=2)

        answers: dict[int, object] = {}

        def ask(i: int) -> None:
            answers[i] = client.completions.create(model="addtiny", prompt=f"{i}+{i}=", temperature=0.7,
                                                   seed=i if i % 2 else None, max_tokens=6, stop=["9"],
                                                   extra_body={"top_k": 5})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(10)]  # more than --max-batch: they wait
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(answers) == list(range(10))
        assert all(a.model == "addtiny" and "9" not in a.choices[0].text for a in answers.values())
    finally:
        interrupt(proc, timeout=60)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip().splitlines() == ["stopped"]
    assert "Traceback" not in err and "Loading weights" not in err, err
