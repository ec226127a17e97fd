"""The embedded default builds offline (HF_HUB_OFFLINE=1) and is cached so reruns skip it."""

from __future__ import annotations

import os

import pytest
import torch

from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.rewards import exact_match
from grpo.training.evaluation import evaluate_policy
from grpo.training.policy import load_policy
from grpo.training.tiny_model import build_char_tokenizer

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`



def test_char_tokenizer_round_trips_and_has_special_tokens():
    tok = build_char_tokenizer("0123456789+=")
    ids = tok("12+34=46", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tok.decode(ids) == "12+34=46"
    assert tok.eos_token_id not in ids and tok.pad_token_id == 0
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == "12+34=46"


def test_a_saved_tiny_tokenizer_loads_as_it_was_built(tmp_path):
    """A cached, shipped or trained tiny policy's tokenizer is the one its warm start trained with. transformers 5's
    AutoTokenizer rebuilt it as Qwen2's from the model's config.json: spaces dropped (``error: off|`` read
    ``error:off|``: the calculator's tool-off reply), one token more than the vocabulary, padding on the right."""
    from grpo.training.tiny_model import build_tiny_qwen2, load_tokenizer_from

    built = build_char_tokenizer("0123456789+=[]|:abcdefghijklmnopqrstuvwxyz ")
    model = build_tiny_qwen2(built, 16, 1, 2, 32, 64, seed=0)
    model.save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)  # a cache entry's layout: config.json (qwen2) beside the tokenizer
    loaded = load_tokenizer_from(tmp_path)
    text = "27+15=[27+15]error: off|42"
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert len(loaded) == len(built) == model.config.vocab_size and loaded.padding_side == "left"


def test_tiny_policy_builds_offline_learns_format_and_is_cached(tmp_path, capfd):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    cfg = load_config(None, ["data.num_train=800", "data.num_eval=100", "model.tiny.hidden_size=64",
                             "model.tiny.num_hidden_layers=2", "model.warm_start.steps=150"])
    data = load_data(cfg)
    first = load_policy(cfg, data, log=lambda *_: None)
    assert not first.cached and len(first.warm_start_losses) == 150
    out = capfd.readouterr().out  # not a terminal: no progress bar, and not the blank line it used to leave
    assert "" not in out.splitlines(), repr(out)
    assert first.warm_start_losses[-1] < first.warm_start_losses[0] * 0.7
    prompts, answers = list(data["eval"]["prompt"]), list(data["eval"]["answer"])
    result = evaluate_policy(first.model, first.tokenizer, prompts, answers, exact_match, max_new_tokens=4, pass_k=4,
                             num_samples_to_keep=len(prompts))
    # accuracy is the fraction of greedy completions that exactly match their answer (checked here, not by the code)
    assert [s["prompt"] for s in result.samples] == prompts and [s["answer"] for s in result.samples] == answers
    hits = [s["completion"].strip() == str(s["answer"]).strip() for s in result.samples]
    assert [s["correct"] for s in result.samples] == hits
    assert result.accuracy == pytest.approx(sum(hits) / len(prompts)) and result.num_prompts == len(prompts) == 100
    assert 0.0 <= result.pass_at_k <= 1.0  # pass@k's arithmetic: tests/test_evaluation.py, with known hits
    completions = [s["completion"] for s in result.samples]
    assert sum(c.isdigit() for c in completions) >= len(completions) // 2  # the warm start taught the format

    second = load_policy(cfg, data, log=lambda *_: None)
    assert second.cached and second.source == first.source
    # Built or reused, the policy names its folder: TRL builds the reference model (beta > 0) from it.
    assert first.model.config._name_or_path == second.model.config._name_or_path == first.source
    for a, b in zip(first.model.state_dict().values(), second.model.state_dict().values()):
        assert torch.equal(a, b)

    changed = load_config(None, ["data.num_train=800", "data.num_eval=100", "model.tiny.hidden_size=64",
                                 "model.tiny.num_hidden_layers=2", "model.warm_start.steps=151"])
    assert load_policy(changed, data, log=lambda *_: None).source != first.source


BUILD_IN_A_FRESH_PROCESS = """
import sys, torch
from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.training.policy import load_policy
torch.manual_seed(12345)  # a global RNG state unlike the test process's: the build must not read it
cfg = load_config(sys.argv[1], sys.argv[2:])
load_policy(cfg, load_data(cfg), log=lambda *_: None)
"""


def test_the_cached_policy_is_the_same_bytes_whoever_builds_it(tmp_path, monkeypatch):
    """#28: the warm-started tiny policy in the cache does not depend on the process that built it: here with one
    intra-op thread and the test process's RNG state, and in a fresh process with two threads and another RNG
    state. A suite whose shared cache was built by whichever test came first must train the same runs."""
    import subprocess
    import sys

    from tests.conftest import MICRO

    overrides = ["model.warm_start.steps=20"]
    cfg = load_config(MICRO, overrides)
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "here"))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.rand(7)  # the global RNG moved on, as after any earlier test
        built = load_policy(cfg, load_data(cfg), log=lambda *_: None)
    finally:
        torch.set_num_threads(before)
    assert not built.cached
    env = {**os.environ, "GRPO_CACHE_DIR": str(tmp_path / "there"), "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, "-c", BUILD_IN_A_FRESH_PROCESS, str(MICRO), *overrides], env=env, check=True,
                   timeout=600)
    here, there = (next(p for p in (tmp_path / d).glob("tiny-*") if p.is_dir()) for d in ("here", "there"))
    assert here.name == there.name  # the same cache key
    for name in ("model.safetensors", "done.json", "config.json"):
        assert (here / name).read_bytes() == (there / name).read_bytes(), name


LOAD_AND_SAY = """
import sys
from grpo.config import load_config
from grpo.pipeline.data import load_data
from grpo.training.policy import load_policy
cfg = load_config(sys.argv[1], sys.argv[2:])
print("cached" if load_policy(cfg, load_data(cfg), log=print).cached else "built")
"""


def _waiting_on(lock_file) -> bool:
    """Whether a process waits for the flock on ``lock_file`` (a blocked waiter is a ``->`` line of /proc/locks)."""
    inode = f":{os.stat(lock_file).st_ino} "
    return any("->" in line and "FLOCK" in line and inode in line for line in open("/proc/locks"))


def test_a_second_process_needing_the_model_being_built_waits_for_it_and_loads_it(tmp_path, monkeypatch):
    """The tiny model is built under its cache entry's lock: a process that needs the entry while another builds it
    waits (forced here: the test holds the lock and checks the second process is blocked on it, not timed), then
    loads what the builder wrote instead of building it again. Parallel test workers, sweep trials and ranks so
    build each warm start once."""
    import shutil
    import subprocess
    import sys
    import time

    from grpo.paths import locked
    from grpo.training.policy import policy_alphabet, tiny_cache_key
    from tests.conftest import MICRO

    overrides = ["model.warm_start.steps=5"]
    cfg = load_config(MICRO, overrides)
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "elsewhere"))
    data = load_data(cfg)
    built = load_policy(cfg, data, log=lambda *_: None)  # what the other builder will have written
    entry = tmp_path / "shared" / f"tiny-{tiny_cache_key(cfg, policy_alphabet(data, cfg))}"
    env = {**os.environ, "GRPO_CACHE_DIR": str(entry.parent)}
    with locked(entry):  # a builder is at work on the entry
        second = subprocess.Popen([sys.executable, "-c", LOAD_AND_SAY, str(MICRO), *overrides], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while not _waiting_on(entry.with_name(entry.name + ".lock")):
            assert second.poll() is None, f"the second process did not wait for the builder: {second.stdout.read()}"
            assert time.monotonic() < deadline
            time.sleep(0.2)
        shutil.copytree(built.source, entry)  # the builder finishes
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out
    assert out.splitlines()[-1] == "cached" and f"reusing cached tiny model {entry}" in out, out
