"""Environments in their own process (#30 §6): the ``openenv`` environment against a real OpenEnv server.

Each test starts ``python -m grpo.environments.openenv_server guess_digit`` (openenv-core's server, the platform's
``guess_digit`` behind it) on a free port, and runs episodes through THE episode runner with a scripted ``generate``
(``tests/test_episodes.py``'s: each episode writes its next scripted turn), so the server is the only moving part.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import string
import subprocess
import sys

import pytest

# Looked up, not imported: openenv.core imports gradio and fastmcp (~3.5 s), which every xdist worker would pay while
# collecting; only the worker running these tests needs them.
if importlib.util.find_spec("openenv") is None:
    pytest.skip("openenv-core (the test and env-server extras) is not installed", allow_module_level=True)

from grpo.app.ui import wait_healthy  # noqa: E402
from grpo.environments import make_environment  # noqa: E402
from grpo.environments.builtin import GuessDigitEnvironment  # noqa: E402
from grpo.environments.episodes import run_episodes  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.servers import free_port, popen_guarded  # noqa: E402
from tests.test_episodes import TOK, Scripted, enc  # noqa: E402

pytestmark = pytest.mark.integration

DIGITS = list(string.digits)
# (prompt, hidden digit, the model's guesses): found in 3, found at once, never found (4 guesses, the game ends it),
# found in 2, a turn without a guess (the model ends: reward 0), found in 4
GAMES = [("g1:", "7", ["5", "8", "7"]), ("g2:", "0", ["0"]), ("g3:", "3", ["5", "1", "2", "4"]),
         ("g4:", "9", ["5", "9"]), ("g5:", "4", ["<eos>"]), ("g6:", "6", ["5", "8", "7", "6"])]


class Server:
    """``grpo.environments.openenv_server`` in its own process group (ended with this process, even by SIGKILL)."""

    def __init__(self, tmp_path, max_concurrent_envs: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"openenv-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")] if p)}
        with self.log.open("ab") as log:
            self.proc = popen_guarded([sys.executable, "-m", "grpo.environments.openenv_server", "guess_digit",
                                       "--port", str(self.port), "--max-concurrent-envs", str(max_concurrent_envs)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"{self.url}/health", self.proc, 180)
        except RuntimeError:
            self.signal(signal.SIGKILL)
            raise RuntimeError(self.log.read_text(errors="replace")[-3000:]) from None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


@pytest.fixture
def serve(tmp_path):
    servers: list[Server] = []

    def start(max_concurrent_envs: int) -> Server:
        servers.append(Server(tmp_path, max_concurrent_envs))
        return servers[-1]

    yield start
    for server in servers:
        server.signal(signal.SIGCONT)
        server.kill()


def remote(url: str, **kw):
    """The served guess_digit, as a config would name it: its text protocol stated in the kwargs."""
    return make_environment("openenv", base_url=url, stop_strings=DIGITS, alphabet=GuessDigitEnvironment.alphabet,
                            default_reward=0.0, **kw)


def play(games, envs, gen=None, **kw):
    gen = gen or Scripted({p: turns for p, _, turns in games}, 3)
    kw.setdefault("step_timeout", 300)
    episodes = run_episodes([enc(p) for p, _, _ in games], envs, gen, TOK,
                            rows=[{"prompt": p, "answer": a} for p, a, _ in games], max_turns=4,
                            max_completion_length=32, **kw)
    return episodes, gen


def outcome(ep):
    return ep.completion_ids, ep.env_mask, ep.turns, ep.stop_reason, ep.reward, ep.error, ep.transcript


def test_episodes_through_an_openenv_server_equal_the_in_process_ones_within_its_session_limit(serve):
    """Six episodes through a server that admits two sessions: each episode's tokens, mask, turns, end and reward are
    those of the same game played in-process; never more than two episodes live (each turn's batch), two at once
    (not one after the other), and every session closed as its episode ends (the server refuses a third)."""
    server = serve(2)
    local, _ = play(GAMES, [GuessDigitEnvironment() for _ in GAMES])
    envs = [remote(server.url, max_concurrent_envs=2, connect_timeout_s=60) for _ in GAMES]
    got, gen = play(GAMES, envs)

    assert [ep.error for ep in got] == [None] * len(GAMES)
    assert [outcome(ep) for ep in got] == [outcome(ep) for ep in local]
    assert [ep.reward for ep in got] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert got[0].completion_ids == enc("5<8>7=") + [TOK.eos_token_id]
    sizes = [size for size, _, _, _ in gen.calls]
    assert max(sizes) == 2 and all(size <= 2 for size in sizes)
    # episodes start in order as others end: g3 joins when g2 (found at once) ends, g6 last
    assert gen.calls[0][3] == ["g1:", "g2:"] and gen.calls[1][3] == ["g1:", "g3:"]
    assert [k for _, _, _, keys in gen.calls for k in keys].count("g6:") == 4


def test_the_server_limit_is_learnt_from_its_refusal(serve):
    """Without max_concurrent_envs the first round opens every session: the server refuses those beyond its limit
    (environment errors, NaN), its refusal says the limit, and the next round stays within it."""
    server = serve(2)
    envs = [remote(server.url) for _ in GAMES[:4]]
    first, _ = play(GAMES[:4], envs)
    refused = [ep for ep in first if ep.error is not None]  # whichever two connected last
    assert len(refused) == 2 and all(math.isnan(ep.reward) and ep.stop_reason == "error" for ep in refused)
    assert all("at capacity" in ep.error for ep in refused)
    assert any("the later episodes are limited to 2" in ep.error for ep in refused)
    assert envs[0].concurrency_limit.value == 2

    second, gen = play(GAMES[:4], envs)
    assert [ep.error for ep in second] == [None] * 4 and [ep.reward for ep in second] == [1.0, 1.0, 0.0, 1.0]
    assert max(size for size, _, _, _ in gen.calls) == 2


def test_a_killed_server_ends_its_episodes_as_environment_errors_and_the_run_goes_on(serve):
    """The server is SIGKILLed between two turns: its live episodes end with NaN and an error naming it, the
    in-process episodes of the same round finish as usual; the next round's episodes on it fail at reset (connection
    refused) at once instead of waiting."""
    server = serve(4)
    games = GAMES[:4]
    envs = [remote(server.url, max_concurrent_envs=4), GuessDigitEnvironment(), remote(server.url),
            GuessDigitEnvironment()]
    scripted = Scripted({p: turns for p, _, turns in games}, 3)

    def generate(seqs, max_new_tokens, stops):
        if len(scripted.calls) == 1:  # after the first turn's steps
            server.kill()
        return scripted(seqs, max_new_tokens, stops)

    got, _ = play(games, envs, gen=generate)
    assert got[1].error is None and got[1].reward == 1.0  # g2, in-process: found at once
    assert got[3].error is None and got[3].reward == 1.0 and got[3].turns == 2  # g4, in-process, found at its 2nd
    for ep, answered in ((got[0], "5<"), (got[2], "5>")):  # g1, g3 on the server: 1st turn answered, 2nd never
        assert ep.stop_reason == "error" and math.isnan(ep.reward) and ep.turns == 2
        assert ep.error.startswith("environment step: ConnectionError: OpenEnv server " + server.url)
        assert ep.completion_ids[:2] == enc(answered)

    again, _ = play(games, envs)
    assert [ep.error is None for ep in again] == [False, True, False, True]
    # the product's own line; the library's reason depends on whatever holds the freed port by now
    assert again[0].error.startswith("environment reset: ConnectionError: OpenEnv server "), again[0].error


def test_a_server_that_stops_answering_times_out_instead_of_hanging(serve):
    """SIGSTOP: the server accepts nothing more. With no step timeout in the runner, the client's own message
    timeout ends the episode (NaN, "no answer"/"timed out"), and the in-process episode beside it finishes."""
    server = serve(2)
    envs = [remote(server.url, max_concurrent_envs=2, connect_timeout_s=5, message_timeout_s=5),
            GuessDigitEnvironment()]
    scripted = Scripted({p: turns for p, _, turns in GAMES[:2]}, 3)

    def generate(seqs, max_new_tokens, stops):
        if len(scripted.calls) == 0:  # after the reset, before the first step
            server.signal(signal.SIGSTOP)
        return scripted(seqs, max_new_tokens, stops)

    got, _ = play(GAMES[:2], envs, gen=generate, step_timeout=None)
    assert got[1].error is None and got[1].reward == 1.0
    assert got[0].stop_reason == "error" and math.isnan(got[0].reward)
    assert "no answer within" in got[0].error or "timed out" in got[0].error.lower() or "Timeout" in got[0].error
