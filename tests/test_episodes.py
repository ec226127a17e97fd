"""The episode runner (grpo.environments.episodes): token ids, env mask, budgets, faults, concurrency, determinism.

``generate`` is the runner's input contract, so most tests drive it with a scripted one (each episode writes its
next scripted turn); the tokenizer is the platform's real character-level one, and one test samples with the real
tiny model through the async generator's sampling function.
"""

from __future__ import annotations

import math
import threading

import pytest

from grpo.environments import StepResult, ToolEnvironment, make_environment
from grpo.environments.builtin import CalculatorEnvironment, GuessDigitEnvironment
from grpo.environments.episodes import ENV_LOGPROB, Episode, StepPool, rollout_fields, run_episodes
from grpo.training.tiny_model import build_char_tokenizer

ALPHABET = "".join(sorted(set(CalculatorEnvironment.alphabet + GuessDigitEnvironment.alphabet
                              + "=abcdefghijklmnopqrstuvwxyz:'")))
TOK = build_char_tokenizer(ALPHABET)
EOS = TOK.eos_token_id


def enc(text: str) -> list[int]:
    """Token ids of ``text``; ``<eos>`` is the end-of-sequence token."""
    return TOK(text, add_special_tokens=False)["input_ids"]


class Scripted:
    """A ``generate`` for the runner's contract: each episode (told apart by its prompt) writes its next scripted
    turn. A turn's log-probs depend on the sequence's place in the batch, so a runner that reordered a batch would
    change them. ``calls`` records (batch size, max_new_tokens, stop strings, prompts) per call."""

    def __init__(self, turns: dict[str, list[str]], prompt_len: int) -> None:
        self.turns, self.prompt_len = turns, prompt_len
        self.done = {k: 0 for k in turns}
        self.calls: list[tuple[int, int, tuple[str, ...], list[str]]] = []
        self.returned: dict[str, list[list[int]]] = {k: [] for k in turns}

    def __call__(self, seqs, max_new_tokens, stop_strings):
        keys = [TOK.decode(s[: self.prompt_len]) for s in seqs]
        self.calls.append((len(seqs), max_new_tokens, stop_strings, keys))
        out = []
        for pos, key in enumerate(keys):
            ids = enc(self.turns[key][self.done[key]])
            self.done[key] += 1
            self.returned[key].append(ids)
            out.append((ids, [-(pos + 1) / 10 - j / 1000 for j in range(len(ids))]))
        return out


def run(turns: dict[str, list[str]], envs, rows=None, **kw) -> tuple[list[Episode], Scripted]:
    prompts = list(turns)
    gen = Scripted(turns, len(prompts[0]))
    kw.setdefault("max_turns", 8)
    kw.setdefault("max_completion_length", 64)
    rows = rows if rows is not None else [{"prompt": p} for p in prompts]
    return run_episodes([enc(p) for p in prompts], envs, gen, TOK, rows=rows, **kw), gen


def test_completion_ids_are_the_generated_and_injected_ids_with_an_exact_env_mask():
    """[27+15] -> 42| -> 42<eos>: the model's ids as generate returned them, the observation's as tokenised alone."""
    turns = {"27+15=": ["[27+15]", "42<eos>"], "38+19=": ["57<eos>"]}
    rows = [{"prompt": "27+15=", "answer": "42"}, {"prompt": "38+19=", "answer": "57"}]
    (tool_ep, direct_ep), gen = run(turns, [CalculatorEnvironment(), CalculatorEnvironment()], rows)

    assert tool_ep.prompt_ids == enc("27+15=")
    assert tool_ep.completion_ids == gen.returned["27+15="][0] + enc("42|") + gen.returned["27+15="][1]
    assert tool_ep.completion_ids == enc("[27+15]") + enc("42|") + enc("42") + [EOS]
    assert tool_ep.env_mask == [1] * 7 + [0] * 3 + [1] * 3
    # the model's log-probs as generate returned them (first in its batch both turns), 0.0 for environment tokens
    first = [-0.1 - j / 1000 for j in range(7)]
    assert tool_ep.logprobs == first + [ENV_LOGPROB] * 3 + first[:3]
    assert (tool_ep.turns, tool_ep.stop_reason, tool_ep.reward, tool_ep.error) == (2, "eos", 1.0, None)
    assert tool_ep.tool_calls == {"calculator": 1} and tool_ep.tool_failures == {} and tool_ep.env_tokens == 3
    assert tool_ep.transcript == [("model", "[27+15]"), ("env", "42|"), ("model", "42")]

    assert direct_ep.completion_ids == enc("57") + [EOS] and direct_ep.env_mask == [1, 1, 1]
    assert direct_ep.logprobs == [-0.2, -0.201, -0.202]  # second in the first turn's batch
    assert (direct_ep.turns, direct_ep.reward, direct_ep.tool_calls) == (1, 1.0, {})

    out = rollout_fields([tool_ep, direct_ep])
    assert out["completion_ids"][0] == tool_ep.completion_ids and out["env_mask"][1] == [1, 1, 1]
    assert out["env_reward"] == [1.0, 1.0] and out["logprobs"][0] == tool_ep.logprobs


def test_all_live_episodes_generate_together_each_turn():
    """One generate call per turn holding every live episode, in episode order; finished ones drop out."""
    turns = {"11+11=": ["22<eos>"], "12+12=": ["[12+12]", "[1+1]", "24<eos>"], "13+13=": ["[13+13]", "26<eos>"]}
    _, gen = run(turns, [CalculatorEnvironment() for _ in turns])
    assert [(size, keys) for size, _, _, keys in gen.calls] == [
        (3, ["11+11=", "12+12=", "13+13="]), (2, ["12+12=", "13+13="]), (1, ["12+12="])]
    assert all(stops == ("]",) for _, _, stops, _ in gen.calls)


def test_a_turn_is_cut_at_its_first_stop_string_and_eos_even_if_generate_runs_on():
    """A backend that ignores stop strings (or pads after them) still yields the turn up to the stop string."""
    turns = {"27+15=": ["[27+15]99]<eos>", "42<eos>77"]}
    (ep,), gen = run(turns, [CalculatorEnvironment()], [{"answer": "42"}])
    assert ep.completion_ids == enc("[27+15]") + enc("42|") + enc("42<eos>")
    assert ep.logprobs[:7] == [-0.1 - j / 1000 for j in range(7)]  # the kept ids' own log-probs


def test_the_turn_limit_truncates_without_appending_the_last_observation():
    turns = {"guess:": ["5", "2", "3"]}
    (ep,), _ = run(turns, [GuessDigitEnvironment()], [{"prompt": "guess:", "answer": "7"}], max_turns=2)
    assert ep.completion_ids == enc("5<2")  # 5 is below 7, then 2: its "<" is not appended
    assert ep.env_mask == [1, 0, 1]
    assert (ep.stop_reason, ep.truncated, ep.turns, ep.reward) == ("max_turns", True, 2, 0.0)


def test_the_token_budget_covers_model_and_environment_tokens():
    # the model runs on without a stop string: cut at the budget, and generate was asked for no more than it
    (ep,), gen = run({"27+15=": ["1234567890"]}, [CalculatorEnvironment()], [{"answer": "42"}],
                     max_completion_length=6)
    assert ep.completion_ids == enc("123456") and (ep.stop_reason, ep.truncated) == ("max_tokens", True)
    assert gen.calls[0][1] == [6] and ep.reward == 0.0  # the calculator's default reward: unanswered is wrong

    # the next turn gets what is left after the model's and the environment's tokens
    (ep,), gen = run({"27+15=": ["[27+15]", "4200000"]}, [CalculatorEnvironment()], [{"answer": "42"}],
                     max_completion_length=12)
    assert [c[1] for c in gen.calls] == [[12], [2]]

    # each episode of a turn's batch is given its own budget, so generate can stop it there
    _, gen = run({"27+15=": ["[27+15]", "42<eos>"], "38+19=": ["[1+1]", "57<eos>"]},
                 [CalculatorEnvironment(), CalculatorEnvironment()], max_completion_length=20)
    assert [c[1] for c in gen.calls] == [[20, 20], [20 - 7 - 3, 20 - 5 - 2]]
    assert ep.completion_ids == enc("[27+15]42|42") and ep.env_mask == [1] * 7 + [0] * 3 + [1] * 2
    assert ep.stop_reason == "max_tokens"

    # an observation that does not fit whole is dropped, as TRL rolls back a tool result that would overflow
    (ep,), _ = run({"27+15=": ["[27+15]"]}, [CalculatorEnvironment()], [{"answer": "42"}], max_completion_length=9)
    assert ep.completion_ids == enc("[27+15]") and ep.env_mask == [1] * 7 and ep.stop_reason == "max_tokens"
    assert ep.tool_calls == {"calculator": 1}


def test_an_environment_that_ends_the_episode_closes_it_with_its_observation_and_eos():
    """guess_digit's "=" and an end-of-sequence token are environment tokens: TRL reads the episode as finished."""
    (ep,), _ = run({"guess:": ["5", "2", "3"]}, [GuessDigitEnvironment()], [{"prompt": "guess:", "answer": "3"}])
    assert ep.completion_ids == enc("5>2<3=") + [EOS]
    assert ep.env_mask == [1, 0, 1, 0, 1, 0, 0]
    assert ep.logprobs[-2:] == [ENV_LOGPROB, ENV_LOGPROB]
    assert (ep.stop_reason, ep.truncated, ep.turns, ep.reward) == ("done", False, 3, 1.0)
    assert ep.transcript[-1] == ("env", "=")

    # four wrong guesses: done by the environment's own rule, reward 0
    (ep,), _ = run({"guess:": ["0", "1", "2", "4"]}, [GuessDigitEnvironment()], [{"answer": "3"}])
    assert (ep.stop_reason, ep.turns, ep.reward) == ("done", 4, 0.0) and ep.completion_ids[-1] == EOS


class Flaky(ToolEnvironment):
    """Tools that fail in every way a tool can."""

    def __init__(self):
        def add(a: int, b: int) -> int:
            """Add.

            Args:
                a: first
                b: second
            """
            return a + b

        def boom(x: str) -> str:
            """Raise.

            Args:
                x: anything
            """
            raise ValueError("kaput")

        super().__init__([add, boom])


def test_tool_failures_and_unknown_tools_are_counted_and_answered_with_their_error():
    turns = {"q:": ["[boom(1)]", "[nope(2)]", "no]", "[add(2, 3)]", "5<eos>"]}
    (ep,), _ = run(turns, [Flaky()], max_completion_length=128)
    assert ep.transcript == [
        ("model", "[boom(1)]"), ("env", "error: kaput|"), ("model", "[nope(2)]"), ("env", "error: unknown tool nope|"),
        ("model", "no]"), ("env", "error: no [|"), ("model", "[add(2, 3)]"), ("env", "5|"), ("model", "5")]
    assert ep.tool_calls == {"boom": 1, "add": 1} and ep.tool_failures == {"boom": 1}
    assert ep.unknown_tool_calls == 2 and ep.stop_reason == "eos" and ep.error is None
    assert ep.reward is None  # a tool environment without a score: reward functions judge it


class Broken:
    """A duck-typed environment (no base class) failing as told, at its second step."""

    stop_strings = ("]",)

    def __init__(self, how: str, release: threading.Event | None = None):
        self.how, self.release, self.steps = how, release, 0

    def reset(self, **row):
        if self.how == "reset":
            raise RuntimeError("no reset")
        return None

    def step(self, action):
        self.steps += 1
        if self.steps < 2:
            return "ok|", False, 0.5
        if self.how == "raise":
            raise RuntimeError("env crashed")
        if self.how == "hang":
            self.release.wait()  # until the test ends: only the timeout gets the episode out
        if self.how == "garbage":
            return "not a step result"
        if self.how == "untokenisable":
            return StepResult("ÿ", False, None)
        return StepResult("fine|", False, 1.0)


@pytest.mark.parametrize("how, error", [
    ("raise", "environment step: RuntimeError: env crashed"),
    ("hang", "environment step: timed out after 2 s"),
    ("reset", "environment reset: RuntimeError: no reset"),
    ("garbage", "environment step returned str, expected StepResult"),
    ("untokenisable", "observation 'ÿ' cannot be tokenised"),
])
def test_an_environment_fault_ends_only_its_episode_with_a_nan_reward(how, error):
    release = threading.Event()
    turns = {"a:": ["x]", "y]", "z<eos>"], "b:": ["x]", "y]", "z<eos>"]}
    try:
        (bad, good), _ = run(turns, [Broken(how, release), Broken("fine")], step_timeout=2)
    finally:
        release.set()
    assert bad.stop_reason == "error" and math.isnan(bad.reward) and error in bad.error
    assert len(bad.completion_ids) == len(bad.env_mask) == len(bad.logprobs)
    # its reward 0.5 + 1.0 + 1.0: the final turn (ended by EOS) is stepped too, so an environment can score it
    assert (good.stop_reason, good.error, good.reward, good.turns) == ("eos", None, 2.5, 3)


class SlowTool(ToolEnvironment):
    """A tool that blocks until ``parties`` calls are in flight at once (a barrier), counting the peak."""

    def __init__(self, barrier: threading.Barrier, stats: dict, lock: threading.Lock):
        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: the key
            """
            with lock:
                stats["now"] += 1
                stats["peak"] = max(stats["peak"], stats["now"])
            try:
                barrier.wait(timeout=120)  # raises BrokenBarrierError unless its parties are in flight together
            finally:
                with lock:
                    stats["now"] -= 1
            return "v"

        super().__init__([lookup])


@pytest.mark.parametrize("episodes, max_workers", [(8, 8), (9, 3)])
def test_environment_steps_run_concurrently_and_bounded(episodes, max_workers):
    """Every live episode's blocking step is in flight at once (a slow tool costs one latency per turn), never more
    than max_workers: the barrier only opens with max_workers steps waiting, and the peak is counted."""
    barrier, stats, lock = threading.Barrier(max_workers), {"now": 0, "peak": 0}, threading.Lock()
    turns = {f"p{i}:": ["[k]", "[k]", "v<eos>"] for i in range(episodes)}
    eps, gen = run(turns, [SlowTool(barrier, stats, lock) for _ in range(episodes)], max_workers=max_workers,
                   step_timeout=None)
    assert all(ep.error is None and ep.tool_failures == {} and ep.tool_calls == {"lookup": 2} for ep in eps)
    assert stats["peak"] == max_workers
    assert [size for size, *_ in gen.calls] == [episodes] * 3


class Ordered(ToolEnvironment):
    """A tool whose call waits for other episodes' calls to finish first, to force the completion order."""

    def __init__(self, wait_for: list[threading.Event], done: threading.Event):
        def echo(x: str) -> str:
            """Echo.

            Args:
                x: text
            """
            for event in wait_for:
                assert event.wait(timeout=120)
            done.set()
            return x

        super().__init__([echo])
        self.done = done


def test_results_do_not_depend_on_which_step_finishes_first():
    prompts = [f"p{i}:" for i in range(3)]
    turns = {p: ["[1]", "[2]", f"{i}<eos>"] for i, p in enumerate(prompts)}

    def episodes_finishing(order: list[int]):
        done = [threading.Event() for _ in prompts]
        # each episode's calls wait for those of the episodes before it in ``order`` (events stay set: the first
        # turn forces the order, later turns keep it)
        envs = [Ordered([done[j] for j in order[: order.index(i)]], done[i]) for i in range(len(prompts))]
        return run({p: list(t) for p, t in turns.items()}, envs)

    forward, gen_f = episodes_finishing([0, 1, 2])
    backward, gen_b = episodes_finishing([2, 1, 0])
    assert forward == backward
    assert gen_f.calls == gen_b.calls
    assert [ep.completion_ids for ep in forward] == [enc(f"[1]1|[2]2|{i}<eos>") for i in range(3)]


def test_the_step_pool_abandons_a_hung_call_and_keeps_its_size():
    release = threading.Event()
    pool = StepPool(max_workers=1)
    try:
        first = pool.run([release.wait, lambda: 1], timeout=2)
        # the hung call's thread was replaced: the pool still answers with its one worker
        second = pool.run([lambda: 2, lambda: 3], timeout=2)
    finally:
        release.set()
        pool.close()
    assert [c.error for c in first] == ["timed out after 2 s", None] and first[1].value == 1
    assert [c.value for c in second] == [2, 3]


def test_the_real_tiny_model_generates_the_episodes_tokens():
    """The async CPU generator's sampling function as ``generate`` (no stop strings of its own: the runner cuts the
    turns): model ids are the sampled ones, observations their own tokenisation, and the recorded log-probs are
    the model's own for those tokens."""
    import torch

    from grpo.training.async_producer import sample_round
    from grpo.training.tiny_model import build_tiny_qwen2

    model = build_tiny_qwen2(TOK, 32, 1, 2, 64, 128, seed=0).eval()
    sampled: list[list[int]] = []

    def generate(seqs, max_new_tokens, stop_strings):
        gen = {"eos_token_ids": [EOS], "pad_token_id": TOK.pad_token_id, "max_new_tokens": max(max_new_tokens),
               "temperature": 1.0, "top_p": 1.0, "top_k": 0, "shared_prompt": False}
        ids, logprobs = sample_round(model, seqs, gen)
        sampled.extend(ids)
        return list(zip(ids, logprobs))

    torch.manual_seed(0)
    prompts = ["27+15=", "38+19=", "27+15=", "38+19="] * 2
    rows = [{"prompt": p, "answer": str(int(p[:2]) + int(p[3:5]))} for p in prompts]
    eps = run_episodes([enc(p) for p in prompts], [make_environment("calculator") for _ in prompts], generate, TOK,
                       rows=rows, max_turns=4, max_completion_length=40)
    assert any(ep.turns > 1 for ep in eps) and any(ep.env_tokens for ep in eps)  # the loop really ran turns
    for ep in eps:
        assert len(ep.completion_ids) == len(ep.env_mask) == len(ep.logprobs) <= 40
        runs, start = [], 0  # the completion's runs of model / environment tokens
        for j in range(1, len(ep.env_mask) + 1):
            if j == len(ep.env_mask) or ep.env_mask[j] != ep.env_mask[start]:
                runs.append((ep.env_mask[start], ep.completion_ids[start:j]))
                start = j
        observations = [text for source, text in ep.transcript if source == "env"]
        assert [ids for m, ids in runs if m == 0] == [enc(text) for text in observations]
        assert sum(m for m, _ in runs) == ep.turns  # a model turn is a run: each ended in a tool call or the episode
        for m, ids in runs:
            assert m == 0 or any(s[: len(ids)] == ids for s in sampled)  # a sampled turn, cut at its stop string
        # the model's log-prob of each of its tokens, from one forward pass over prompt + completion
        ids = torch.tensor([ep.prompt_ids + ep.completion_ids])
        with torch.no_grad():
            logps = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        own = logps[len(ep.prompt_ids) - 1:].gather(-1, ids[0, len(ep.prompt_ids):, None]).squeeze(-1)
        for j, (m, lp) in enumerate(zip(ep.env_mask, ep.logprobs)):
            assert lp == pytest.approx(own[j].item(), abs=1e-4) if m else lp == ENV_LOGPROB


@pytest.mark.parametrize("options", [{"shared_prompt": False}, {"shared_prompt": True, "top_k": 5, "top_p": 0.9}])
def test_each_turn_stops_at_its_stop_string_and_the_episodes_are_those_of_full_budget_generation(options):
    """The sampling function of the sync trainer and the CPU generator (``sampling_generate``), on guess_digit with a
    budget of 48 tokens where a turn is a few: each row of a turn's batch stops at its digit or its budget (no token
    generated is cut), while the same seed sampled as before (no stop strings, every row of a turn to the batch's
    largest budget left, the runner cutting it) gives the very same episodes, token ids and log-probs, though it
    generates many times more. A batch that stops early draws fewer random numbers: without the per-turn random
    state that would move every later turn's samples."""
    import torch

    from grpo.training.async_producer import sampling_generate
    from grpo.training.tiny_model import build_tiny_qwen2

    model = build_tiny_qwen2(TOK, 32, 1, 2, 64, 256, seed=0).eval()
    gen = {"eos_token_ids": [EOS], "pad_token_id": TOK.pad_token_id, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
           **options}
    generate = sampling_generate(model, gen, TOK)
    prompts = [p for p in ("27+15=", "38+19=") for _ in range(4)]  # GRPO groups: repeated prompts

    def round_of(fn) -> list[Episode]:
        torch.manual_seed(0)
        return run_episodes([enc(p) for p in prompts], [GuessDigitEnvironment() for _ in prompts], fn, TOK,
                            rows=[{"prompt": p} for p in prompts], max_turns=4, max_completion_length=48)

    stopped = round_of(generate)
    full = round_of(lambda seqs, budgets, stops: generate(seqs, [max(budgets)] * len(seqs), ()))

    def generated_over_kept(eps: list[Episode]) -> float:
        return sum(ep.generated_tokens for ep in eps) / sum(ep.model_tokens for ep in eps)

    assert any(ep.turns > 2 for ep in stopped) and any(ep.stop_reason == "done" for ep in stopped)
    # not one token past a turn's end: its stop string, EOS or (an episode with fewer tokens left than the batch's
    # longest budget) its own budget
    assert generated_over_kept(stopped) == 1.0, generated_over_kept(stopped)
    assert generated_over_kept(full) > 2, generated_over_kept(full)  # the turns really ran on without stopping
    assert stopped == full  # token ids, masks, turns, rewards, transcripts
    assert [ep.logprobs for ep in stopped] == [ep.logprobs for ep in full]  # exactly: the same samples


def test_a_rounds_first_turn_samples_as_before_stopping_and_the_random_stream_after_it_is_the_seeds():
    """What stopping changes in the random stream and what it does not: one-turn episodes are exactly those of the
    sampler before per-row stopping (``sample_round`` on the global stream, the runner cutting the turn), and the
    state a turn leaves does not depend on where its batch stopped."""
    import torch

    from grpo.training.async_producer import sample_round, sampling_generate
    from grpo.training.tiny_model import build_tiny_qwen2

    model = build_tiny_qwen2(TOK, 32, 1, 2, 64, 256, seed=0).eval()
    gen = {"eos_token_ids": [EOS], "pad_token_id": TOK.pad_token_id, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
           "shared_prompt": False}
    prompts = ["27+15=", "38+19=", "4+4=", "9+1="] * 2
    states = []

    def before(seqs, max_new_tokens, stops):
        return list(zip(*sample_round(model, seqs, {**gen, "max_new_tokens": max(max_new_tokens)})))

    def one_turn(fn) -> list[Episode]:
        torch.manual_seed(0)
        eps = run_episodes([enc(p) for p in prompts], [GuessDigitEnvironment() for _ in prompts], fn, TOK,
                           rows=[{"prompt": p} for p in prompts], max_turns=1, max_completion_length=64)
        states.append(torch.random.get_rng_state())
        return eps

    generate = sampling_generate(model, gen, TOK)
    assert one_turn(generate) == one_turn(before)
    one_turn(lambda seqs, budgets, stops: generate(seqs, [max(budgets)] * len(seqs), ()))
    assert torch.equal(states[0], states[2]) and not torch.equal(states[0], states[1])
