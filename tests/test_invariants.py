"""The invariant matrix (issue #10) and its regression probes; see tests/invariant_matrix.py for what runs.

Two launches serve every test here: the pairwise design plus the probes under ``torchrun --nproc_per_node 2``
(gloo) and the pairwise design in one process. Each writes one JSON line per run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import config_from_dict
from grpo.errors import ConfigError
from tests.invariant_matrix import (
    BASE,
    ENV_PROBES,
    KNOWN_GAPS,
    OPTIONS,
    PROBES,
    REFUSED,
    config_dict,
    design,
    name_of,
    steps_for,
)
from tests.pairwise import all_pairs, pairs_of
from tests.servers import free_port

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`


MATRIX = Path(__file__).with_name("invariant_matrix.py")
COLLECTIVE_TIMEOUT_S = 60
REL = 1e-5


def _launch(tmp: Path, nproc: int, only: str, port: int) -> dict[str, dict]:
    out = tmp / f"report-{nproc}.jsonl"
    script = [str(MATRIX), "--out", str(out), "--only", only, "--timeout", str(COLLECTIVE_TIMEOUT_S)]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(port), *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(MATRIX.parent.parent)}
    result = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
    records = {}
    if out.is_file():
        records = {r["name"]: r for r in map(json.loads, out.read_text().splitlines())}
    records["__stderr__"] = {"rc": result.returncode, "tail": result.stderr[-3000:]}
    return records


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, dict]:
    return _launch(tmp_path_factory.mktemp("matrix2"), 2, ",".join([*PROBES, "pairwise"]), free_port())


# The async producer's start-up dominates a run (about 10-25 s against 1-2 s): one process runs the rows and environment
# probes without it by default, all of them with GRPO_MATRIX_FULL=1; the two-process launch always runs every row.
FULL = os.environ.get("GRPO_MATRIX_FULL") == "1"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, dict]:
    env_probes = [name for name in ENV_PROBES if FULL or not PROBES[name]["async"]]
    return _launch(tmp_path_factory.mktemp("matrix1"), 1, ",".join(["pairwise" if FULL else "pairwise-sync",
                                                                     *env_probes]), 0)


def _record(report: dict[str, dict], name: str) -> dict:
    assert name in report, f"{name} never reported (the launch died earlier): {report['__stderr__']}"
    record = report[name]
    assert "error" not in record, f"{name}: {record['error']}"
    return record


# ---------------------------------------------------------------------------------------------- the design


def test_design_covers_every_pair_the_config_accepts():
    rows, impossible = design()
    covered = set().union(*(pairs_of(r, list(OPTIONS)) for r in rows))
    assert covered | impossible == all_pairs(OPTIONS)
    assert not covered & impossible
    assert len(rows) <= 30, "the design grew: keep the default suite fast"
    for row in rows:  # every row is a config the loader accepts
        config_from_dict(config_dict(row, 2, steps_for(row), COLLECTIVE_TIMEOUT_S))


def test_pairs_left_out_are_refused_at_load_or_named_gaps():
    _, impossible = design()
    for (a, va), (b, vb) in sorted(impossible, key=repr):
        row = {**BASE, a: va, b: vb}
        gaps = [reason for reason, rule in KNOWN_GAPS.items() if rule(row)]
        refusals = [pattern for rule, pattern in REFUSED.values() if rule(row)]
        assert gaps or refusals, f"{a}={va} x {b}={vb} is untested without a reason"
        if refusals:
            with pytest.raises(ConfigError, match="|".join(refusals)):
                config_from_dict(config_dict(row, 2, 2, COLLECTIVE_TIMEOUT_S))


# ---------------------------------------------------------------------------------------------- regression probes


def test_replay_when_ranks_disagree_does_not_hang(two_processes):
    """Issue #10 item 1: only rank 1 replaces a group in round 2; both ranks must still finish."""
    record = _record(two_processes, "item1_replay_ranks_disagree")
    assert record["steps"] == steps_for(PROBES["item1_replay_ranks_disagree"]) and record["replaced"] > 0


def test_skip_on_last_micro_step_keeps_ranks_in_sync(two_processes):
    """Issue #10 item 2: with gradient accumulation 2, the window's last micro-step is skipped on all ranks; the first
    micro-step's gradients must still be averaged across ranks."""
    record = _record(two_processes, "item2_skip_last_micro_step")
    assert record["skipped"] > 0
    assert all(len(set(h)) == 1 for h in record["hashes"]), record["hashes"]
    assert record["neutral_rel"] < REL


def test_chunked_backward_synchronises_once_per_optimizer_step(two_processes):
    """Issue #10 item 8: chunks pay one gradient all-reduce per optimizer step, like an unchunked step."""
    plain = _record(two_processes, name_of(BASE))
    record = _record(two_processes, "item8_chunks_sync_once")
    assert record["allreduces"] == [plain["allreduces"][0]] * record["steps"]
    assert record["neutral_rel"] < REL


def test_compaction_when_a_rank_has_no_signal_keeps_ranks_in_sync(two_processes):
    """Issue #13.1: compaction leaves a rank only zero-advantage rows (round 1 on both ranks, the window's last
    micro-step; round 2 on rank 1 only); every rank still computes and synchronises, and the first step equals the
    uncompacted, unchunked one."""
    record = _record(two_processes, "compact_rank_without_signal")
    assert record["compacted"] > 0
    assert all(len(set(h)) == 1 for h in record["hashes"]), record["hashes"]
    assert record["neutral_rel"] < REL


def test_lora_under_ddp_keeps_ranks_identical_with_the_async_generator(two_processes):
    """model.lora on 2 gloo processes: TRL's peft model under DDP with adapter syncs to each rank's generator, the KL
    term against the base with the adapter disabled, chunks and the shared-prompt forward (the backbone inside peft
    and DDP): every rank holds the same weights after every step, one gradient synchronisation per step, and chunks
    and the shared-prompt forward leave the LoRA step unchanged."""
    plain = _record(two_processes, name_of(BASE))
    record = _record(two_processes, "lora_async_kl_chunks")
    assert record["steps"] == steps_for(PROBES["lora_async_kl_chunks"])
    assert all(len(set(h)) == 1 for h in record["hashes"]), record["hashes"]
    assert len({h[0] for h in record["hashes"]}) == record["steps"]  # the weights moved every step
    assert record["allreduces"] == [plain["allreduces"][0]] * record["steps"]
    assert record["neutral"] == ["chunks", "shared_prompt"] and record["neutral_rel"] < REL


@pytest.mark.parametrize("launch", ["one_process", "two_processes"])
def test_environment_episodes_keep_ranks_identical_and_neutral_features_neutral(launch, request):
    """Multi-turn episodes (#30), sync and from the async generator with IS correction: every rank holds the same
    weights after every step, one gradient synchronisation per step, and chunks, compaction, the shared-prompt
    forward (and on 2 processes balancing and the zero-advantage skip) leave the step with environment tokens
    unchanged."""
    report = request.getfixturevalue(launch)
    names = [name for name in ENV_PROBES if launch == "two_processes" or FULL or not PROBES[name]["async"]]
    for name in names:
        record = _record(report, name)
        assert record["steps"] == steps_for(PROBES[name])
        assert all(len(set(h)) == 1 for h in record["hashes"]), record["hashes"]
        assert len({h[0] for h in record["hashes"]}) >= 2  # the weights moved (the skip probe skips a flat round)
        assert record["env_tokens"] > 0, "no environment token: the probe tested single-turn completions"
        assert record.get("neutral") and record["neutral_rel"] < REL, record
    if launch == "two_processes":
        async_probe = _record(report, "env_async_is_chunks")
        assert async_probe["async_rounds"] > 0 and async_probe["is_ratio_logged"] > 0  # episodes from the generator
        assert "balancing" in _record(report, "env_ga1_balancing_skip")["neutral"]
        assert _record(report, "env_failing_on_one_rank")["env_errors"] > 0  # failed on rank 1, and nothing hung


# ---------------------------------------------------------------------------------------------- the matrix


def _check_matrix(report: dict[str, dict], names: list[str]) -> None:
    plain = _record(report, name_of(BASE))
    buckets = plain["allreduces"][0]
    failures = []
    for name in names:
        if name not in report:
            failures.append(f"{name}: never reported ({report['__stderr__']['tail'][-500:]})")
            continue
        r = report[name]
        row = r["row"]
        if "error" in r:
            failures.append(f"{name}: {r['error'][:300]}")
            continue
        if r["steps"] != steps_for(row):
            failures.append(f"{name}: {r['steps']} steps")
        if any(len(set(h)) != 1 for h in r["hashes"]):
            failures.append(f"{name}: ranks differ {r['hashes']}")
        if r["world"] > 1 and (buckets == 0 or any(n != buckets for n in r["allreduces"])):
            failures.append(f"{name}: all-reduces per step {r['allreduces']} (expected {buckets})")
        if r.get("neutral") and not r["neutral_rel"] < REL:
            failures.append(f"{name}: {r['neutral']} changed the step by {r['neutral_rel']:.2e} relative")
    assert not failures, "\n".join(failures)


def test_matrix_two_processes(two_processes):
    _check_matrix(two_processes, [*PROBES, *(name_of(r) for r in design()[0])])


def test_matrix_one_process(one_process):
    _check_matrix(one_process, [name_of(r) for r in design()[0] if FULL or not r["async"]])
