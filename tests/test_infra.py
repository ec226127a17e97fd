"""infra/: deployment files parse and agree with the code; against a real `prefect server start` on 127.0.0.1 the
work pools and deployments are created with their schedule, a real process worker runs the pipeline deployment,
and `grpo serve` serves the flows (and refuses without a server).

One Prefect server (own PREFECT_HOME in a temp dir) is shared by the module's server tests; every process they start
is stopped by them.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.browser import (
    SCREENSHOTS,
    SECTION_TITLES,
    chromium_page,
    form_property,
    open_section,
    open_select,
    park,
    require_chromium,
    submit,
)
from tests.conftest import MICRO, REPO
from tests.servers import BIN, free_port, interrupt

INFRA = REPO / "infra"
POOLS = INFRA / "work-pools"
DEPLOYMENT_PRESETS = {"default": "tiny", "gpu": "qwen2.5-0.5b-gsm8k", "nightly": "tiny"}


def prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def deployments_by_name() -> dict[str, dict]:
    return {d["name"]: d for d in prefect_yaml()["deployments"]}


def flow_params(entrypoint: str) -> list[str]:
    """Parameter names of the flow function at ``path:function``, read without importing it (torch is slow)."""
    path, func = entrypoint.split(":")
    tree = ast.parse((REPO / path).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func)
    return [a.arg for a in fn.args.args + fn.args.kwonlyargs]


# ---------------------------------------------------------------- files


def test_prefect_yaml_deployments_point_at_real_flows_pools_and_presets():
    from prefect.cli.deploy._models import PrefectYamlModel

    from grpo.app.serve import SWEEP_PARAMETERS
    from grpo.config import load_config, presets
    from grpo.pipeline.sweep_space import validate_space

    data = prefect_yaml()
    model = PrefectYamlModel.model_validate(data)  # the model `prefect deploy` loads the file with
    assert [d.name for d in model.deployments] == ["default", "gpu", "nightly"]
    deployments = deployments_by_name()
    for name, d in deployments.items():
        assert d["entrypoint"] and d["work_pool"]["name"] and isinstance(d["parameters"], dict), name
        assert (POOLS / f"{d['work_pool']['name']}.json").is_file(), name
        assert set(d["parameters"]) <= set(flow_params(d["entrypoint"])), name
        # a deployment names a preset shipped in the package (no copy of its fields), and the preset loads
        assert "config" not in d["parameters"] and d["parameters"]["preset"] == DEPLOYMENT_PRESETS[name], name
        assert d["parameters"]["preset"] in presets(), name
        load_config(d["parameters"]["preset"], ["grpo.use_vllm=false"])  # CPU machines never install vllm

    default, gpu, nightly = deployments["default"], deployments["gpu"], deployments["nightly"]
    assert default["entrypoint"] == gpu["entrypoint"] == "flows/pipeline.py:grpo_pipeline"
    assert (default["work_pool"]["name"], gpu["work_pool"]["name"]) == ("cpu-pool", "gpu-pool")

    assert nightly["entrypoint"] == "flows/sweep.py:grpo_sweep"
    assert {"preset", "config", "space", "max_concurrency", "metric", "direction"} <= set(
        flow_params(nightly["entrypoint"]))
    assert {k: v for k, v in nightly["parameters"].items() if k != "preset"} == SWEEP_PARAMETERS  # = grpo serve's
    assert validate_space(load_config("tiny"), nightly["parameters"]["space"]).n_trials == 3
    [schedule] = model.deployments[2].schedules
    assert schedule.cron == "0 2 * * *" and schedule.timezone == "UTC"

    # flow runs start in the repository: the deploying checkout (build step output), or $GRPO_HOME on GPU hosts
    assert data["build"][0]["prefect.deployments.steps.run_shell_script"]["id"] == "repo"
    assert data["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ repo.stdout }}"}}]
    assert gpu["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $GRPO_HOME }}"}}]


def test_work_pool_templates_declare_every_variable_they_use():
    from prefect.utilities.templating import apply_values, find_placeholders
    from prefect.workers.process import ProcessWorker

    process_keys = set(ProcessWorker.get_default_base_job_template()["job_configuration"])
    for name in ("cpu-pool", "gpu-pool", "k8s-gpu-job-template"):
        template = json.loads((POOLS / f"{name}.json").read_text())
        assert set(template) == {"job_configuration", "variables"}, name
        declared = set(template["variables"]["properties"])
        used = {p.name for p in find_placeholders(template["job_configuration"])}
        assert used <= declared, (name, used - declared)
        for var, schema in template["variables"]["properties"].items():
            assert schema.get("title") and schema.get("description"), (name, var)  # the pool's UI form
        if name != "k8s-gpu-job-template":
            assert set(template["job_configuration"]) == process_keys, name

    gpu = json.loads((POOLS / "gpu-pool.json").read_text())
    assert gpu["job_configuration"]["env"]["CUDA_VISIBLE_DEVICES"] == "{{ cuda_visible_devices }}"
    assert json.loads((POOLS / "cpu-pool.json").read_text())["job_configuration"]["env"]["CUDA_VISIBLE_DEVICES"] == ""

    k8s = json.loads((POOLS / "k8s-gpu-job-template.json").read_text())
    defaults = {k: v.get("default") for k, v in k8s["variables"]["properties"].items()}
    job = apply_values(k8s["job_configuration"], defaults)["job_manifest"]
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["env"]["GRPO_HOME"] == container["workingDir"] == "/opt/grpo"
    gpu_dockerfile = (INFRA / "docker" / "Dockerfile.gpu").read_text()
    assert f"-t {container['image']} ." in gpu_dockerfile  # the image the Dockerfile's build command tags


def test_dockerfiles_copy_existing_sources_install_the_lock_and_start_workers():
    """Read as text (no Docker engine here): what each Dockerfile copies exists, it installs through the lock, and its
    command starts a worker on its pool."""
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^gpu = \[.*"vllm', pyproject, re.M)
    for name, base, pool in (("Dockerfile.cpu", "FROM python:3.11", "cpu-pool"),
                             ("Dockerfile.gpu", "ARG CUDA_IMAGE=nvidia/cuda:", "gpu-pool")):
        text = (INFRA / "docker" / name).read_text()
        assert base in text, name
        for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
            for part in src.split():
                assert (REPO / part).exists(), (name, part)
        cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
        assert cmd[:3] == ["prefect", "worker", "start"] and cmd[cmd.index("--pool") + 1] == pool, name
        assert "ENV" in text and "GRPO_HOME=/opt/grpo" in text and "WORKDIR /opt/grpo" in text, name
    gpu = (INFRA / "docker" / "Dockerfile.gpu").read_text()
    assert "LOCK=constraints-gpu.txt EXTRAS=gpu TORCH= infra/install.sh" in gpu and "torch.version.cuda" in gpu
    cpu = (INFRA / "docker" / "Dockerfile.cpu").read_text()
    assert "infra/install.sh" in cpu and "torch.version.cuda is None" in cpu


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return [shutil.which("docker-compose")] if shutil.which("docker-compose") else None


def test_compose_file_is_valid_and_complete(tmp_path):
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"prefect-server", "prefect-db", "mlflow", "mlflow-db", "minio", "cpu-worker", "deploy"} <= set(services)
    declared_volumes = set(compose["volumes"])
    for name, service in services.items():
        assert "image" in service or "build" in service, name
        if "build" in service:
            assert (INFRA / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
        for dep in service.get("depends_on", {}):
            assert dep in services, (name, dep)
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in declared_volumes, (name, volume)
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)  # nothing published beyond the machine by default
    assert "postgresql+asyncpg://" in services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert any(a.startswith("--artifacts-destination=s3://") for a in services["mlflow"]["command"])
    assert services["cpu-worker"]["environment"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"

    # The Compose Specification's own JSON schema (tests/data/compose-spec.json, vendored): what `docker compose
    # config` checks first, without a Docker CLI.
    errors = compose_schema_errors(compose)
    assert not errors, errors
    broken = {**compose, "services": {**services, "mlflow": {**services["mlflow"], "restart": ["always"],
                                                             "healthcheck": {"interval": 5}}}}
    assert len(compose_schema_errors(broken)) == 2  # the schema does catch a wrong type and a wrong field


def compose_schema_errors(compose: dict) -> list[str]:
    import jsonschema

    schema = json.loads((REPO / "tests" / "data" / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]


def test_compose_file_resolves_with_the_compose_cli(tmp_path):
    """`docker compose config` where a Compose CLI exists (none on this machine: the schema test above runs here)."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI (the Compose schema check runs in test_compose_file_is_valid_and_complete)")
    path = INFRA / "compose.yaml"
    if cli[-1].endswith("docker-compose"):  # Compose v1 predates the top-level `name` of the Compose spec
        path = tmp_path / "compose.yaml"
        path.write_text(re.sub(r"^name: .*\n", "", (INFRA / "compose.yaml").read_text(), flags=re.M))
        cli = [*cli, "--project-directory", str(INFRA)]
    result = subprocess.run([*cli, "-f", str(path), "config"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr  # `config` resolves and validates; it needs no Docker engine
    resolved = yaml.safe_load(result.stdout)
    assert resolved["services"]["cpu-worker"]["build"]["context"] == str(REPO)


def test_accelerate_configs_load_as_accelerate_launch_reads_them():
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    parser = launch_command_parser()
    envs = {}
    for name in ("ddp", "fsdp"):
        path = str(INFRA / "accelerate" / f"{name}.yaml")
        config = load_config_from_file(path)
        assert config.num_processes == 2 and config.mixed_precision == "bf16" and not config.use_cpu
        args, _, _ = _validate_launch_command(parser.parse_args(["--config_file", path, "-m", "grpo.app.cli", "run"]))
        envs[name] = prepare_multi_gpu_env(args)
    assert "ACCELERATE_USE_FSDP" not in envs["ddp"] and envs["ddp"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    fsdp = envs["fsdp"]
    assert fsdp["ACCELERATE_USE_FSDP"] == "true" and fsdp["FSDP_VERSION"] == "2"
    assert fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"] == Qwen2DecoderLayer.__name__


# ---------------------------------------------------------------- a real Prefect server


@pytest.fixture(scope="module")
def deployed(prefect_server):
    """The documented commands: work pools from infra/work-pools/, then `grpo deploy` of infra/prefect.yaml."""
    s = prefect_server
    pools = s.run("sh", "-c", " && ".join([
        f"{BIN}/prefect work-pool create cpu-pool --type process --base-job-template "
        "infra/work-pools/cpu-pool.json --overwrite",
        f"{BIN}/prefect work-pool create gpu-pool --type process --base-job-template "
        "infra/work-pools/gpu-pool.json --overwrite",
        f"{BIN}/prefect work-pool set-concurrency-limit gpu-pool 1"]))
    assert pools.returncode == 0, pools.stdout + pools.stderr
    result = s.run(str(BIN / "grpo"), "deploy")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.integration
def test_deploy_creates_pools_and_deployments_with_schedule(prefect_server, deployed):
    from flows.run_form import collapsed_sections

    s = prefect_server
    for name in ("default", "gpu", "nightly"):
        assert "successfully created" in deployed.stdout and f"Deploying {name}" in deployed.stdout

    cpu_pool, gpu_pool = s.get("work_pools/cpu-pool"), s.get("work_pools/gpu-pool")
    assert cpu_pool["type"] == gpu_pool["type"] == "process"
    assert gpu_pool["concurrency_limit"] == 1
    assert "cuda_visible_devices" in gpu_pool["base_job_template"]["variables"]["properties"]
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.utilities.asyncutils import run_coro_as_sync
    from prefect.workers.process import ProcessJobConfiguration

    with temporary_settings({PREFECT_API_URL: s.url}):  # how a process worker renders a flow run's job
        def job_env(values: dict) -> dict:
            return run_coro_as_sync(ProcessJobConfiguration.from_template_and_values(
                gpu_pool["base_job_template"], values)).env

        assert "CUDA_VISIBLE_DEVICES" not in job_env({})  # inherits the worker's: one worker per GPU
        assert job_env({"cuda_visible_devices": "0,1"})["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert job_env({"env": {"CUDA_VISIBLE_DEVICES": "1"}})["CUDA_VISIBLE_DEVICES"] == "1"
    k8s = json.loads((POOLS / "k8s-gpu-job-template.json").read_text())  # the server validates the template
    created = s.post("work_pools/", {"name": "k8s-gpu", "type": "kubernetes", "base_job_template": k8s})
    assert created.status_code == 201, created.text

    default = s.get("deployments/name/grpo-pipeline/default")
    assert default["work_pool_name"] == "cpu-pool" and default["entrypoint"] == "flows/pipeline.py:grpo_pipeline"
    assert default["parameters"] == {"preset": "tiny", "resume": False, **collapsed_sections()}
    assert default["schedules"] == []
    assert default["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    schema = default["parameter_openapi_schema"]
    # `prefect deploy` built the run form of flows/run_form.py: preset first, sections with every field described
    props = schema["properties"]
    assert min(props, key=lambda k: props[k]["position"]) == "preset"
    assert (props["preset"]["enum"] == ["qwen2.5-0.5b-gsm8k", "tiny", "tiny-calculator", "tiny-calculator-agent",
                                        "tiny-guess-digit", None]
            and props["preset"]["title"] == "Preset")
    grpo_fields = props["grpo_settings"]["properties"]
    assert grpo_fields["loss_type"]["enum"][:3] == ["grpo", "dr_grpo", "dapo"]
    assert {"exact_match", "last_number_match"} <= set(grpo_fields["reward_funcs"]["items"]["enum"])
    assert grpo_fields["lr_scheduler_type"]["enum"][0] == "constant"
    assert props["async_settings"]["properties"]["vllm_importance_sampling_mode"]["enum"] == [
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]

    def leaves(properties: dict) -> list[tuple[str, dict]]:
        return [leaf for name, prop in properties.items()
                for leaf in (leaves(prop["properties"]) if "properties" in prop else [(name, prop)])]

    undescribed = [name for section in props.values() if "properties" in section
                   for name, prop in leaves(section["properties"]) if ":" not in prop.get("description", "")]
    assert not undescribed, undescribed  # every form field says what it does after its dotted key

    gpu = s.get("deployments/name/grpo-pipeline/gpu")
    assert gpu["work_pool_name"] == "gpu-pool" and gpu["parameters"]["preset"] == "qwen2.5-0.5b-gsm8k"
    assert gpu["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $GRPO_HOME }}"

    nightly = s.get("deployments/name/grpo-sweep/nightly")
    assert nightly["work_pool_name"] == "cpu-pool" and nightly["entrypoint"] == "flows/sweep.py:grpo_sweep"
    [schedule] = nightly["schedules"]
    assert schedule["active"] and schedule["schedule"]["cron"] == "0 2 * * *"
    assert schedule["schedule"]["timezone"] == "UTC"
    assert set(nightly["parameters"]) == {"preset", "space", "max_steps", "max_concurrency", "metric", "direction"}


@pytest.mark.integration
def test_process_worker_runs_a_pipeline_flow_run(prefect_server, deployed, tmp_path):
    """A flow run of grpo-pipeline/default created through the API (as the UI's Run button does), picked up by a
    real `prefect worker start --pool cpu-pool` process, runs the micro experiment in the repository to the end."""
    from grpo.config import load_config

    s = prefect_server
    cfg = load_config(MICRO, [f"output_dir={tmp_path / 'runs'}", "tracking.backend=none", "evaluation.enabled=false",
                              "grpo.max_steps=2", "grpo.logging_steps=1", "grpo.save_steps=2",
                              "model.warm_start.steps=10"])
    deployment = s.get("deployments/name/grpo-pipeline/default")
    created = s.post(f"deployments/{deployment['id']}/create_flow_run",
                     {"parameters": {"config": cfg.model_dump(mode="json", by_alias=True), "preset": None,
                                     "run_name": "by-worker"}})  # preset None: this config, not the deployment's
    assert created.status_code == 201, created.text
    flow_run_id = created.json()["id"]

    worker = s.run(str(BIN / "prefect"), "worker", "start", "--pool", "cpu-pool", "--run-once", "--name",
                   "test-worker", cwd=tmp_path, timeout=300)
    flow_run = s.get(f"flow_runs/{flow_run_id}")
    log = worker.stdout[-4000:] + worker.stderr[-4000:]
    assert worker.returncode == 0, log
    assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], log)
    logs = s.post("logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200}).json()
    assert any("set_working_directory" in entry["message"] for entry in logs), [e["message"] for e in logs][:20]
    summary = json.loads((tmp_path / "runs" / "by-worker" / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["prefect_flow_run_id"] == flow_run_id


@pytest.mark.integration
def test_grpo_serve_refuses_without_a_server(prefect_server, tmp_path):
    s = prefect_server
    env = {k: v for k, v in s.env().items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(tmp_path / "empty-home")  # no profile with an API URL either
    for run_env, fragment in ((env, "PREFECT_API_URL is not set"),
                              (s.env(PREFECT_API_URL=f"http://127.0.0.1:{free_port()}/api"), "no Prefect server at")):
        result = s.run(str(BIN / "grpo"), "serve", env=run_env, cwd=tmp_path, timeout=120)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert fragment in lines[0] and "Traceback" not in result.stderr + result.stdout


@pytest.mark.integration
def test_grpo_serve_serves_pipeline_and_scheduled_sweep(prefect_server, tmp_path):
    from flows.run_form import collapsed_sections
    from grpo.app.serve import SWEEP_PARAMETERS

    s = prefect_server
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "grpo"), "serve", "--schedule", "30 4 * * *", "--name", "served"],
                                env=s.env(), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # a hung server's bound: the shared one has stalled for minutes
        while True:  # the runner registers both deployments when it starts
            served = s.post("deployments/filter", {"deployments": {"name": {"any_": ["served"]}}, "limit": 5}).json()
            if len(served) == 2:
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        pipeline = s.get("deployments/name/grpo-pipeline/served")
        sweep = s.get("deployments/name/grpo-sweep/served")
        assert "serving grpo-sweep/served, schedule 30 4 * * *" in log.read_text()
        assert "at most 1 flow run at once; later ones wait their turn (--limit)" in log.read_text()  # default
        assert pipeline["work_pool_name"] is None and pipeline["entrypoint"] == "flows.pipeline.grpo_pipeline"
        assert pipeline["parameters"] == {"preset": "tiny", "resume": False, **collapsed_sections()}
        assert pipeline["schedules"] == []
        [schedule] = sweep["schedules"]
        assert schedule["schedule"]["cron"] == "30 4 * * *" and schedule["active"]
        assert sweep["parameters"] == {"preset": "tiny", **SWEEP_PARAMETERS}
        assert not sweep["paused"]
    finally:
        interrupt(proc, timeout=60)
    assert s.get("deployments/name/grpo-sweep/served")["paused"]  # serving stopped: no schedule fires into nothing



BOOM_MODULE = """
from grpo.rewards import register_reward

@register_reward("sweep_worker_boom")
def sweep_worker_boom(completions, **kwargs):
    raise RuntimeError("sweep_worker_boom: this reward always fails")
"""


def by_trial_id(by_trial: dict, run_id: str) -> int:
    [trial] = [i for i, c in by_trial.items() if c.info.run_id == run_id]
    return trial


def _max_overlap(intervals: list[tuple[int, int]]) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda x: (x[0], x[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@pytest.mark.integration
def test_sweep_triggered_through_the_api_runs_on_a_process_worker(prefect_server, deployed, mlflow_server, tmp_path):
    """A flow run of the grpo-sweep/nightly deployment created through the API, with 4 trials and max_concurrency 2,
    run by a real process worker: 4 child MLflow runs under one parent (the failing trial FAILED, the others done),
    at most 2 at once, a dashboard artifact, and the best trial's model registered with the alias "best". The
    failing reward reaches the worker through GRPO_REWARD_MODULES."""
    from mlflow import MlflowClient

    from grpo.config import load_config

    s = prefect_server
    (tmp_path / "boom_reward.py").write_text(BOOM_MODULE)
    cfg = load_config(MICRO, [
        f"output_dir={tmp_path}", "tracking.backend=mlflow", f"tracking.tracking_uri={mlflow_server.uri}",
        "tracking.experiment_name=sweep-worker", "tracking.log_system_metrics=false", "grpo.max_steps=4",
        "grpo.logging_steps=2", "grpo.save_steps=100", "model.warm_start.steps=20",
        "evaluation.before_training=false", "evaluation.num_prompts=16", "evaluation.pass_k=0"])
    space = {"grid": {"grpo.reward_funcs": [["exact_match"], ["exact_match", "digits_format"],
                                            ["exact_match", "sweep_worker_boom"], ["last_number_match"]]}}
    model_name = f"sweep-worker-{tmp_path.name}"
    nightly = s.get("deployments/name/grpo-sweep/nightly")
    created = s.post(f"deployments/{nightly['id']}/create_flow_run", {"parameters": {
        "config": cfg.model_dump(mode="json", by_alias=True), "preset": None, "max_steps": None,  # this config's
        "space": space, "max_concurrency": 2,
        "sweep_name": "sw", "registered_model_name": model_name}})  # None: this config and its steps, not the
    # deployment's preset and 50 steps per trial
    assert created.status_code == 201, created.text
    flow_run_id = created.json()["id"]
    worker = s.run(str(BIN / "prefect"), "worker", "start", "--pool", "cpu-pool", "--run-once", "--name",
                   "sweep-worker", cwd=tmp_path, timeout=600,
                   env=s.env(GRPO_REWARD_MODULES=str(tmp_path / "boom_reward.py")))
    flow_run = s.get(f"flow_runs/{flow_run_id}")
    assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], worker.stdout[-3000:], worker.stderr[-3000:])
    result = json.loads((tmp_path / "sw" / "sweep.json").read_text())

    records = result["trials"]
    assert [r["status"] for r in records] == ["completed", "completed", "failed", "completed"], records
    assert "sweep_worker_boom" in records[2]["error"] and result["completed"] == 3 and result["failed"] == 1

    client = MlflowClient(mlflow_server.uri)
    parent = client.get_run(result["mlflow_run_id"])
    assert parent.data.tags["grpo.run_type"] == "sweep" and parent.info.status == "FINISHED", parent.info
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_trial = {int(c.data.tags["grpo.sweep.trial"]): c for c in children}
    assert {i: c.info.status for i, c in by_trial.items()} == {0: "FINISHED", 1: "FINISHED", 2: "FAILED",
                                                                3: "FINISHED"}, [c.info for c in children]
    assert "sweep_worker_boom" in by_trial[2].data.tags["grpo.sweep.error"]
    assert json.loads(parent.data.params["sweep.space"]) == space
    assert {r["mlflow_run_id"] for r in records} == {c.info.run_id for c in children}
    # never more than max_concurrency trials at once; whether two did overlap here is timing (trials take turns on
    # the model in one process, and a busy machine may start the second after the first ended), not asserted
    intervals = [(c.info.start_time, c.info.end_time) for c in children]
    assert all(e is not None and e > b for b, e in intervals) and _max_overlap(intervals) <= 2, intervals

    sweep_files = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/space.json", "sweep/results.json", "sweep/results_table.json"} <= sweep_files
    dashboard = [a.path for a in client.list_artifacts(parent.info.run_id, "dashboard")]
    assert dashboard == [result["dashboard"]["artifact"]] and dashboard[0].endswith(".html"), result["dashboard"]
    version = client.get_model_version_by_alias(model_name, "best")
    assert version.run_id == by_trial[result["best"]["trial"]].info.run_id
    # "best" is the largest eval_accuracy_after among the completed trials, read from each trial's own summary
    scores = {r["trial"]: json.loads((Path(r["run_dir"]) / "summary.json").read_text())["eval_accuracy_after"]
              for r in records if r["status"] == "completed"}
    best_trial = int(by_trial_id(by_trial, version.run_id))
    assert best_trial in scores and scores[best_trial] == max(scores.values()), (best_trial, scores)

    subflows = s.post("flow_runs/filter", {"flow_runs": {"name": {"any_": ["sw-t000", "sw-t001", "sw-t002",
                                                                         "sw-t003"]}}, "limit": 20}).json()
    assert sorted((r["name"], r["state_type"]) for r in subflows) == [
        ("sw-t000", "COMPLETED"), ("sw-t001", "COMPLETED"), ("sw-t002", "FAILED"), ("sw-t003", "COMPLETED")]
    [table] = s.post("artifacts/filter", {"artifacts": {"key": {"any_": ["sweep-results"]},
                                                        "flow_run_id": {"any_": [flow_run_id]}}}).json()
    rows = json.loads(table["data"]) if isinstance(table["data"], str) else table["data"]
    assert [row["status"] for row in rows] == ["completed", "completed", "failed", "completed"]


# ---------------------------------------------------------------- the Prefect UI in a real browser

@pytest.mark.integration
def test_prefect_ui_form_runs_the_pipeline_and_pauses_the_schedule(prefect_server, deployed, tmp_path):
    """In Chromium, the pipeline deployment's run form reads as designed for a person:
    - the preset dropdown comes first, then the common fields with plain titles;
    - each config section is one collapsed line that opens into its fields;
    - there are no None toggles.
    A run submitted from it (a dropdown, a number, the run name and one field changed, every section opened) is
    picked up by a process worker. It trains the deployment's config with exactly those fields changed: opening a
    section changes nothing by itself (its on/off fields used to be sent as false). The nightly
    sweep's cron schedule is paused and resumed from the UI."""
    require_chromium()
    from playwright.sync_api import expect
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.pipeline import grpo_pipeline
    from grpo.app.serve import pipeline_parameters
    from grpo.config import flatten, load_config, to_yaml

    s = prefect_server
    micro = tmp_path / "micro.yaml"  # the form starts from a config file, as `grpo serve --config FILE` does
    micro.write_text(to_yaml(load_config(MICRO, [
        f"output_dir={tmp_path / 'runs'}", "tracking.backend=none", "evaluation.enabled=false", "grpo.max_steps=2",
        "grpo.logging_steps=1", "grpo.save_steps=2", "model.warm_start.steps=10"])))
    with temporary_settings({PREFECT_API_URL: s.url}):
        deployment_id = grpo_pipeline.to_deployment(
            name="ui-form", work_pool_name="cpu-pool", parameters=pipeline_parameters(micro),
            job_variables={"working_dir": str(REPO)}).apply()
    ui = s.url.removesuffix("/api")
    errors: list[str] = []
    with chromium_page() as page:
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.goto(f"{ui}/deployments/deployment/{deployment_id}/run", wait_until="networkidle")
        # the form renders once the deployment has loaded, which a busy shared server can delay
        expect(page.locator(".schema-form-property__label")).to_have_count(22, timeout=120_000)
        labels = [t.removesuffix(" (Optional)") for t in
                  page.locator(".schema-form-property__label").all_inner_texts()]
        assert labels[:10] == ["Preset", "Learning rate", "Training steps",
                               "Batch size (completions per device per step)",
                               "Completions per prompt (group size)", "Reward functions", "Loss type", "Seed",
                               "MLflow run name", "Resume"]
        assert labels[10:] == ["Data", "Model", "GRPO training", "Sampling and balancing", "Async generation",
                               "Environments and tools", "Evaluation", "MLflow tracking", "Experiment",
                               "More settings (key=value)", "Whole config (advanced)",
                               "Extra MLflow run tags"]  # sections collapsed
        body = page.locator("body").inner_text()
        assert 'Property is type "None"' not in body and page.get_by_role("button", name="None").count() == 0
        form_height = page.locator("form").first.bounding_box()["height"]
        assert form_height < 4000, form_height  # was about 14,500 px
        page.screenshot(path=str(SCREENSHOTS / "prefect-run-form.png"))

        assert open_select(page, form_property(page, "Preset")) == [
            "qwen2.5-0.5b-gsm8k", "tiny", "tiny-calculator", "tiny-calculator-agent", "tiny-guess-digit"]
        page.keyboard.press("Escape")
        loss = form_property(page, "Loss type")
        assert open_select(page, loss) == ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
        page.get_by_role("option", name="bnpo", exact=True).click()
        expect(loss.locator(".p-select-button__value")).to_have_text("bnpo")
        form_property(page, "Training steps").locator("input").fill("3")
        form_property(page, "MLflow run name").locator("textarea").fill("from-the-ui")
        page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-filled.png"))

        for title in SECTION_TITLES:  # open every collapsed section; change one field of the Model section
            open_section(page, title)
        model = form_property(page, "Model")
        steps = form_property(page, "Steps")
        expect(steps).to_contain_text("model.warm_start.steps")  # its description renders after the label
        steps.locator("input").fill("6")
        assert form_property(page, "Learning Rate (Warm Start)").count() == 1
        model.scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / "prefect-run-form-section.png"))
        created = submit(page, s, deployment_id, set())
        flow_run_id = created["id"]
        page.wait_for_url(re.compile(rf".*/deployments/deployment/{deployment_id}(\?.*)?$"), timeout=120_000)
        park(page)

        worker = s.run(str(BIN / "prefect"), "worker", "start", "--pool", "cpu-pool", "--run-once", "--name",
                       "ui-worker", cwd=tmp_path, timeout=300)
        flow_run = s.get(f"flow_runs/{flow_run_id}")
        assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], worker.stdout[-3000:],
                                                          worker.stderr[-3000:])
        page.goto(f"{ui}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
        page.get_by_text("Completed").first.wait_for(timeout=120_000)
        page.screenshot(path=str(SCREENSHOTS / "prefect-flow-run.png"))

        nightly = s.get("deployments/name/grpo-sweep/nightly")

        def schedule_active() -> bool:
            [schedule] = s.get(f"deployments/{nightly['id']}")["schedules"]
            return schedule["active"]

        # The page's schedule updates and what the server answered them (the toggle's PATCH), for the message.
        answers: list[tuple[str, int]] = []
        page.on("response", lambda r: answers.append((r.request.post_data or "", r.status))
                if r.request.method == "PATCH" and "/schedules/" in r.url else None)
        # The first update is refused with a 503, as the shared server's SQLite does when another writer holds it
        # under the suite's load: the page must still get the schedule changed (forced, not left to load).
        refusals = [1]

        def refuse_the_first_update(route) -> None:
            if route.request.method == "PATCH" and refusals:
                refusals.pop()
                route.fulfill(status=503, content_type="application/json", body='{"detail": "database is locked"}')
            else:
                route.continue_()

        page.route(re.compile(r".*/schedules/.*"), refuse_the_first_update)
        page.goto(f"{ui}/deployments/deployment/{nightly['id']}", wait_until="networkidle")
        toggle = page.locator(".deployment-schedule-card__action").get_by_role("switch")
        states = [schedule_active()]
        for _ in range(2):  # pause the cron schedule, then resume it
            want = not states[-1]
            # click once the page shows the schedule's current state: a click before the card has loaded is lost
            (expect(toggle).to_be_checked if states[-1] else expect(toggle).not_to_be_checked)(timeout=60_000)
            sent, clicked = len(answers), time.monotonic()
            toggle.click()
            deadline = time.monotonic() + 600  # a bound on a hung server, not a speed requirement
            while schedule_active() != want:
                assert time.monotonic() < deadline, f"the UI toggle did not change the schedule: {answers}"
                # A refused update (the shared server's SQLite busy under the suite's load) or a lost click: the
                # switch shows the old state again, so click again, as a person would.
                refused = answers[sent:] and answers[-1][1] >= 400
                lost = not answers[sent:] and time.monotonic() - clicked > 30
                if refused and toggle.is_checked() == want:
                    # the switch stays where it was clicked though the server refused the update: a reload shows
                    # the server's state again, then the next pass clicks
                    page.reload(wait_until="networkidle")
                    continue
                if (refused or lost) and toggle.is_checked() != want:
                    sent, clicked = len(answers), time.monotonic()
                    toggle.click()
                page.wait_for_timeout(300)  # the sync API delivers the page's events while it waits
            states.append(schedule_active())
        assert not refusals and any(code == 503 for _, code in answers), answers  # the refusal was met
        page.screenshot(path=str(SCREENSHOTS / "prefect-schedule.png"))

    assert states == [True, False, True]
    params = flow_run["parameters"]
    assert params["run_name"] == "from-the-ui" and params["loss_type"] == "bnpo" and params["max_steps"] == 3
    assert params["model_settings"]["warm_start"]["steps"] == 6 and params.get("preset") is None
    summary = json.loads((tmp_path / "runs" / "from-the-ui" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["prefect_flow_run_id"] == flow_run_id
    trained = load_config(tmp_path / "runs" / "from-the-ui" / "config.yaml")
    changed = {k: v for k, v in flatten(trained).items() if flatten(load_config(micro))[k] != v}
    assert changed == {"grpo.loss_type": "bnpo", "grpo.max_steps": 3, "model.warm_start.steps": 6}
    assert not errors, errors
