"""``grpo`` command line. User errors print one line and exit with code 2; nothing is written before validation."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from grpo.errors import GRPOPlatformError


def _flags_take_no_value() -> None:
    """typer 0.29's help prints a ``<bool>`` type after every flag (``--resume <bool>``, even ``--help <bool>``),
    which reads as if the flag took a value: show no type for flags."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "_grpo_flags", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich._grpo_flags = True
    TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="GRPO experiment platform: config-driven GRPO training on TRL.",
)

PREFECT_STARTUP_SECONDS = 120
ConfigOpt = Annotated[Path, typer.Option("--config", "-c", metavar="FILE|PRESET",
                                         help="Experiment YAML file, or a preset name: tiny, tiny-calculator, "
                                              "tiny-guess-digit, qwen2.5-0.5b-gsm8k.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", "-s", metavar="KEY=VALUE",
                                                     help="Override a field: section.field=value (repeatable).")]
RewardModuleOpt = Annotated[
    Optional[list[Path]],
    typer.Option("--reward-module", metavar="FILE", help="Python file registering reward functions (repeatable)."),
]
EnvModuleOpt = Annotated[
    Optional[list[Path]],
    typer.Option("--env-module", metavar="FILE", help="Python file registering environments and tools (repeatable)."),
]


def _note(message: str) -> None:
    """A line about a wait the user should know of (a busy server), on stderr beside the errors."""
    typer.echo(f"note: {message}", err=True)


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


class _RunLogHandler(logging.FileHandler):
    """The run's log file; its directory is created on the first record (after the run directory was checked)."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


class _NoTraceback(logging.Formatter):
    """Formats as ``inner`` does, without the traceback: the console shows what happened, the run's log file how."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info = record.exc_text = record.stack_info = None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


def _not_an_exception_report(record: logging.LogRecord) -> bool:
    # Prefect logs each exception that ends a (sub)flow at ERROR with its traceback; the CLI's last line says it once.
    return not (record.levelno >= logging.ERROR and record.exc_info)


def _log_to_file(path: Path) -> None:
    """Send every log record (Prefect's and ours, tracebacks included) to ``path``; keep the console to one line
    per record with no tracebacks, so a failed run ends with the CLI's one-line error."""
    handler = _RunLogHandler(path, delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s - %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger()
    for logger in (root, logging.getLogger("prefect")):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setFormatter(_NoTraceback(h.formatter))
                h.addFilter(_not_an_exception_report)
    root.addHandler(handler)


def _sweep_console() -> None:
    """``grpo sweep``'s console: a person follows the sweep by its own lines (its Prefect link, a grid's points already
    run, one line per trial as it ends: grpo.pipeline.sweep.PROGRESS records), printed plainly on stdout; of every
    other log record only warnings and errors. The trials' stage lines, Prefect's lines for each (sub)flow and task
    run ("Beginning", "Finished in state", "View at") and the sweep's INFO stay in each flow run's log in the Prefect
    UI."""
    from grpo.pipeline.sweep import is_progress

    root = logging.getLogger()
    if any(getattr(h, "_grpo_sweep_lines", False) for h in root.handlers):
        return
    for logger in (root, logging.getLogger("prefect")):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.addFilter(lambda r: r.levelno >= logging.WARNING and not is_progress(r))
    lines = logging.StreamHandler(sys.stdout)
    lines.setFormatter(logging.Formatter("%(message)s"))
    lines.addFilter(is_progress)
    lines._grpo_sweep_lines = True
    root.addHandler(lines)


@contextmanager
def _stoppable(saved: str, flow_runs: list[str]):
    """Run a flow so that Ctrl-C or SIGTERM stops it within seconds (#12.5, #12.6): the embedded Prefect server runs
    in its own session (a Ctrl-C to the terminal does not kill it under the run) and dies with this process; the
    first signal unwinds the run (its MLflow run ends KILLED) and marks its flow runs Cancelled; exit 130 / 143. A
    second Ctrl-C exits at once. ``flow_runs``: the command's (its RunContext's), filled as the flow runs start."""
    from prefect.exceptions import TerminationSignal

    from grpo.app import procguard

    server = procguard.embedded_prefect_server()
    procguard.install_signal_handlers()
    try:
        with procguard.CancelWatch(flow_runs, server.api_url if server else None):
            yield
    except (KeyboardInterrupt, procguard.Terminated, TerminationSignal) as err:
        code = procguard.exit_code(err)
        cancelled = procguard.cancel_flow_runs(flow_runs, server.api_url if server else None,
                                               f"stopped by {signal.Signals(code - 128).name}")
        typer.echo(f"interrupted ({signal.Signals(code - 128).name}): {cancelled} flow run(s) cancelled; {saved}",
                   err=True)
        raise typer.Exit(code=code) from None
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _load(config: Path | None, overrides: list[str] | None, reward_modules: list[Path] | None,
          env_modules: list[Path] | None = None):
    from grpo.config import load_config
    from grpo.rewards import load_reward_module

    for module in reward_modules or []:
        load_reward_module(module)
    if env_modules:
        from grpo.environments import MODULES_ENV, load_environment_module

        for module in env_modules:
            load_environment_module(module)
        # Processes started from here (the async generator, reward workers, torchrun ranks' children) register the
        # same environments and tools: they read GRPO_ENV_MODULES, as a served flow run reads its server's.
        listed = [p for p in os.environ.get(MODULES_ENV, "").split(os.pathsep) if p]
        added = [str(Path(m).resolve()) for m in env_modules if str(Path(m).resolve()) not in listed]
        os.environ[MODULES_ENV] = os.pathsep.join(listed + added)
    return load_config(config, overrides or [])


@app.command()
def run(
    config: ConfigOpt,
    set_: SetOpt = None,
    run_name: Annotated[
        Optional[str], typer.Option("--run-name", help="Run directory name (default: <name>-<time>).")
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue an existing run from its last checkpoint.")
    ] = False,
    reward_module: RewardModuleOpt = None,
    env_module: EnvModuleOpt = None,
) -> None:
    """Run the pipeline (prep → plan → train → eval) as a Prefect flow run tracked in MLflow.

    Under torchrun or accelerate launch every rank runs the same stages in-process instead (rank 0 writes).
    """
    try:
        cfg = _load(config, set_, reward_module, env_module)
        from grpo import distributed
        from grpo.runs import check_run_dir, default_run_name, open_run_dir, validate_run_name

        if resume and not run_name:
            _fail("--resume needs --run-name NAME of the run to continue")
        if run_name is not None:
            validate_run_name(run_name)  # "" is a mistake, not a request for a generated name
        distributed.check_launch_matches_config(cfg, distributed.launched_world_size())  # before any stage runs
        if distributed.launched_world_size() > 1:
            with distributed.process_group():
                name = distributed.decide_on_main(lambda: run_name or default_run_name(cfg))
                run_dir = distributed.decide_on_main(lambda: open_run_dir(cfg, name, resume))
                if distributed.is_main_process():  # rank 0 reports, as for every later line
                    typer.echo(f"run: {run_dir.path}")
                from grpo.pipeline.experiment import run_experiment

                summary = run_experiment(cfg, run_dir, resume=resume, log=typer.echo)
        else:
            name = run_name or default_run_name(cfg)
            run_dir = check_run_dir(cfg, name, resume)  # fail fast, before Prefect or MLflow start
            typer.echo(f"run: {run_dir.path}")
            from flows.pipeline import grpo_pipeline
            from grpo.console import quiet_library_noise
            from grpo.pipeline.run_context import RunContext

            _log_to_file(run_dir.path / "run.log")
            quiet_library_noise()  # before the flow call starts Prefect's temporary server (its start line)
            context = RunContext()  # collects the flow runs to cancel when stopped; the flow finds it by run dir
            with _stoppable(f"checkpoints and metrics so far are in {run_dir.path}; continue with --resume "
                            f"--run-name {name}", context.flow_runs), context.registered(run_dir.path):
                summary = grpo_pipeline(config=cfg, run_name=name, resume=resume)
    except GRPOPlatformError as err:
        _fail(str(err))
    except RuntimeError as err:
        if "ephemeral Prefect API server" not in str(err):
            raise
        _fail(f"the embedded Prefect server did not start within "
              f"{os.environ.get('PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS')} s (machine busy?); retry, raise "
              "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS, or start one with `grpo ui` and set PREFECT_API_URL")
    if summary is None:  # a non-main rank of a multi-process run: rank 0 reports
        return
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    if before is not None and after is not None:
        typer.echo(f"accuracy {before:.3f} -> {after:.3f} ({after - before:+.3f}) in {summary['wall_seconds']:.0f}s")
    typer.echo(f"model: {run_dir.model_dir}")
    link = _mlflow_link(cfg, summary.get("mlflow_run_id"))
    if link:
        typer.echo(f"mlflow: {link}")
    typer.echo(f"summary: {run_dir.summary_file}")


def _mlflow_link(cfg, run_id: str | None) -> str | None:
    """The run's page in the MLflow UI, opening its training view (MLflow's own "View run" line opens the GenAI one
    and is switched off by grpo.console.quiet_library_noise); None when the run is not tracked or not found."""
    if not run_id:
        return None
    from mlflow import MlflowClient

    from grpo.tracking.store import mlflow_ui_url, resolve_tracking_uri

    uri = resolve_tracking_uri(cfg.tracking.tracking_uri, Path.cwd())
    try:
        return mlflow_ui_url(uri, MlflowClient(uri).get_run(run_id).info.experiment_id, run_id)
    except Exception:  # the store went away since the run: the summary still names the run id
        return None


@app.command()
def sweep(
    config: ConfigOpt,
    space: Annotated[Path, typer.Option("--space", help="Search space YAML/JSON (sampler grid|random|tpe, params, "
                                                        "pruner) over field paths; or a space preset name "
                                                        "(tiny-lr-beta, tiny-tpe-pruned).")],
    max_concurrency: Annotated[int, typer.Option("--max-concurrency", help="Trials running at once.")] = 2,
    metric: Annotated[
        str, typer.Option("--metric", help="Summary key (or MLflow metric) picking the best trial.")
    ] = "eval_accuracy_after",
    direction: Annotated[str, typer.Option("--direction", help="maximize or minimize the metric.")] = "maximize",
    name: Annotated[Optional[str], typer.Option("--name", help="Sweep name (default: <name>-sweep-<time>).")] = None,
    deployment: Annotated[
        Optional[str], typer.Option("--deployment", help="Run trials as flow runs of this grpo-pipeline deployment.")
    ] = None,
    study: Annotated[
        Optional[str],
        typer.Option("--study", help="Optuna study to create or continue (default: a new one named as the sweep)."),
    ] = None,
    storage: Annotated[
        Optional[str], typer.Option("--storage", help="Optuna storage URL (default: sqlite:///<output_dir>/optuna.db).")
    ] = None,
    set_: SetOpt = None,
    reward_module: RewardModuleOpt = None,
    env_module: EnvModuleOpt = None,
) -> None:
    """Run one pipeline per trial of a search space (Prefect flow grpo-sweep), nested under one MLflow run."""
    try:
        cfg = _load(config, set_, reward_module, env_module)
        from grpo.errors import RunDirectoryError
        from grpo.pipeline.sweep_space import load_space, validate_space
        from grpo.runs import validate_run_name

        if direction not in ("maximize", "minimize"):
            _fail(f"--direction {direction!r}: use maximize or minimize")
        if max_concurrency < 1:
            _fail(f"--max-concurrency {max_concurrency}: must be >= 1")
        space_data = load_space(space)
        checked = validate_space(cfg, space_data)  # fail fast, before Prefect or MLflow start
        if name is not None:
            try:
                validate_run_name(name)
            except RunDirectoryError:
                _fail(f"--name {name!r}: use letters, digits, '.', '_' or '-' "
                      "(max 128 characters, no leading punctuation)")
            if (Path(cfg.output_dir) / name).exists():
                raise RunDirectoryError(f"sweep directory {Path(cfg.output_dir) / name} already exists; "
                                        "choose another --name")
        pruner = checked.pruner_spec["type"] if checked.pruner_spec else "no"
        trials = f"{checked.n_trials} grid points" if checked.sampler_kind == "grid" else \
            f"{checked.n_trials} trials ({checked.sampler_kind} sampler)"
        typer.echo(f"sweep: {trials}, {pruner} pruner, at most {max_concurrency} at once")
        from flows.sweep import grpo_sweep
        from grpo.app.sweep_dashboard import add_comparison_dashboard
        from grpo.console import quiet_library_noise
        from grpo.formatting import human_metric
        from grpo.pipeline.run_context import RunContext
        from grpo.pipeline.sweep import SweepError, default_sweep_name

        quiet_library_noise()  # also for what the sweep does itself: best model, dashboard (artifact downloads)
        _sweep_console()
        name = name or default_sweep_name(cfg)  # the sweep's directory: where the flow finds this command's context
        context = RunContext()  # collects the sweep's and its trials' flow runs, to cancel when stopped
        try:
            with _stoppable(f"finished trials are in {Path(cfg.output_dir)}", context.flow_runs), \
                    context.registered(Path(cfg.output_dir) / name):
                try:
                    result = grpo_sweep(config=cfg, space=space_data, max_concurrency=max_concurrency, metric=metric,
                                        direction=direction, sweep_name=name, use_deployment=deployment,
                                        study_name=study, storage=storage)
                except SweepError as err:  # every trial failed: their runs are compared all the same
                    if err.result is not None:
                        add_comparison_dashboard(cfg, err.result)
                    raise
                if result["trials"]:  # none ran (a grid the study has run): nothing under this parent to compare
                    add_comparison_dashboard(cfg, result)
        except SweepError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(code=1) from None
    except GRPOPlatformError as err:
        _fail(str(err))
    st = result["study"]  # each trial's line came as it ended (_sweep_console)
    typer.echo(f"study: {st['name']} ({st['storage']}), {st['n_trials']} trials in all: "
               + ", ".join(f"{v} {k}" for k, v in st["states"].items()))
    if result["best"] is not None:
        typer.echo(f"best: {result['best']['run_name']} ({metric}={human_metric(result['best']['metric_value'])})")
    if result["registered_model"]:
        m = result["registered_model"]
        typer.echo(f"registered: {m['name']} version {m['version']}{', as before' if m['unchanged'] else ''} "
                   + (f"(alias {m['alias']})" if m["alias"] else f"({m['note']})"))
    if result.get("mlflow_run_id"):
        typer.echo(f"mlflow parent run: {result['mlflow_run_id']} "
                   f"(compare again: grpo dashboard --experiment {cfg.tracking.experiment_name} "
                   f"--sweep {result['mlflow_run_id']} --out compare.html)")
    dashboard = result.get("dashboard") or {}
    if dashboard.get("path"):
        logged = f", logged to MLflow as {dashboard['artifact']}" if dashboard.get("artifact") else ""
        typer.echo(f"dashboard: {dashboard['path']} ({dashboard['kind']}{logged})")
    typer.echo(f"sweep: {result['sweep_dir']}")


@app.command()
def validate(config: ConfigOpt, set_: SetOpt = None, reward_module: RewardModuleOpt = None,
             env_module: EnvModuleOpt = None) -> None:
    """Check a config without building anything; prints the resolved YAML."""
    try:
        cfg = _load(config, set_, reward_module, env_module)
    except GRPOPlatformError as err:
        _fail(str(err))
    from grpo.config import to_yaml

    typer.echo(to_yaml(cfg), nl=False)


@app.command()
def plan(
    config: ConfigOpt,
    set_: SetOpt = None,
    out: Annotated[
        Optional[Path], typer.Option("--out", help="Plan directory (default: <output_dir>/plans/<name>).")
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing plan.")] = False,
    reward_module: RewardModuleOpt = None,
    env_module: EnvModuleOpt = None,
) -> None:
    """Write the prompt schedule (plan.parquet + plan.json) over the prepared training rows a run trains on,
    checking that the config fits the dataset."""
    try:
        cfg = _load(config, set_, reward_module, env_module)
        from grpo.algo.plan import summary_table
        from grpo.pipeline.plans import default_plan_dir
        from grpo.pipeline.stages import cached_prep, plan_stage, plan_tokenizer, prep_summary

        # The rows a run trains on: the prep stage's cached output (validated, quarantine applied), as `grpo run`.
        prep = cached_prep(cfg)
        summary = plan_stage(cfg, Path(prep["data_dir"]), out or default_plan_dir(cfg), plan_tokenizer(cfg),
                             overwrite=overwrite)
    except GRPOPlatformError as err:
        _fail(str(err))
    from rich.console import Console

    typer.echo(prep_summary(prep))
    Console().print(summary_table(summary))


@app.command()
def rewards(reward_module: RewardModuleOpt = None) -> None:
    """List registered reward functions."""
    from grpo.rewards import available_rewards, get_reward, load_reward_module

    try:
        for module in reward_module or []:
            load_reward_module(module)
    except GRPOPlatformError as err:
        _fail(str(err))
    for name in available_rewards():
        typer.echo(f"{name:20s} {first_sentence(get_reward(name).__doc__)}")


@app.command()
def environments(env_module: EnvModuleOpt = None) -> None:
    """List registered environments, tools and agents."""
    from grpo.environments import (
        available_environments,
        available_tools,
        get_environment,
        get_tool,
        load_environment_module,
    )
    from grpo.environments.agents import available_agents, get_agent

    try:
        for module in env_module or []:
            load_environment_module(module)
        sections = {"environments": (available_environments(), get_environment), "tools": (available_tools(), get_tool),
                    "agents": (available_agents(), get_agent)}
    except GRPOPlatformError as err:
        _fail(str(err))
    for title, (names, get) in sections.items():
        typer.echo(f"{title}:")
        for name in names:
            typer.echo(f"  {name:20s} {first_sentence(get(name).__doc__)}")


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence as one line of plain text: its first paragraph's lines joined (a sentence that
    wraps is not cut at its line end) and reStructuredText's double backticks dropped."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split()).replace("``", "")
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", paragraph)
    return paragraph[: end.start() + 1] if end else paragraph


@app.command()
def dashboard(
    experiment: Annotated[str, typer.Option("--experiment", "-e", help="MLflow experiment name.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="HTML file to write (self-contained, opens offline).")],
    sweep: Annotated[Optional[str], typer.Option("--sweep", help="Only the child runs of this sweep run id.")] = None,
    tracking_uri: Annotated[
        Optional[str],
        typer.Option("--tracking-uri", help="MLflow URI (default: MLFLOW_TRACKING_URI, else ./mlflow.db)."),
    ] = None,
) -> None:
    """Write an HTML dashboard comparing the runs of an MLflow experiment or sweep (rewards, eval, final metrics)."""
    from grpo.console import quiet_library_noise
    from grpo.tracking.store import resolve_tracking_uri

    quiet_library_noise()  # no "Downloading artifacts" bar for a sweep's importances
    uri = resolve_tracking_uri(tracking_uri, Path.cwd())
    try:
        from mlflow.exceptions import MlflowException

        from dashboards.comparison import build_dashboard

        path = build_dashboard(uri, experiment, sweep, out=out)
    except (GRPOPlatformError, ValueError) as err:
        _fail(str(err))
    except MlflowException as err:
        _fail(f"MLflow ({uri}): {err.message.strip().splitlines()[0] if err.message.strip() else err}")
    except OSError as err:
        _fail(f"can not write {out}: {err}")
    typer.echo(f"dashboard: {path}")


@app.command()
def ui(
    prefect_port: Annotated[int, typer.Option(help="Prefect UI/API port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow UI/API port.")] = 5000,
) -> None:
    """Start the Prefect and MLflow servers on 127.0.0.1 over the local stores; Ctrl-C or SIGTERM stops both."""
    import time

    from grpo.app import procguard
    from grpo.app.ui import server_logs, start_servers, stop_servers, taken_ports_message

    taken = taken_ports_message(prefect_port, mlflow_port)
    if taken:
        _fail(taken)
    procguard.install_signal_handlers()  # SIGTERM unwinds like Ctrl-C: the servers (own sessions) are stopped
    procs: list = []
    try:
        procs = start_servers(Path.cwd(), prefect_port, mlflow_port)
        typer.echo(f"Prefect UI: http://127.0.0.1:{prefect_port}    MLflow UI: http://127.0.0.1:{mlflow_port}")
        typer.echo("In another shell, point grpo serve (or grpo run, grpo sweep) at these servers:")
        typer.echo(f"  export PREFECT_API_URL=http://127.0.0.1:{prefect_port}/api "
                   f"MLFLOW_TRACKING_URI=http://127.0.0.1:{mlflow_port}")
        typer.echo(f"The servers' own logs: {' and '.join(str(p) for p in server_logs().values())}. "
                   "Ctrl-C stops both.")
        while all(p.poll() is None for p in procs):
            time.sleep(1)
    except RuntimeError as err:
        _fail(str(err))
    except (KeyboardInterrupt, procguard.Terminated):
        pass
    finally:
        stop_servers(procs)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@app.command("serve-model")
def serve_model(
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="A saved model's folder, e.g. runs/NAME/model.")],
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model_name: Annotated[Optional[str], typer.Option(help="The model's name in the API (default: the run's name, "
                                                           "the folder above model/).")] = None,
    max_batch: Annotated[int, typer.Option(metavar="N", help="At most N calls sampled at once (one generate); "
                                                            "later ones wait.")] = 64,
) -> None:
    """Serve a trained model on an OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions) for
    eval harnesses, until Ctrl-C. Unlike the training endpoint, each call's temperature (0: greedy), top_p, top_k,
    max_tokens, stop and seed are honoured; concurrent calls are sampled together in one batch."""
    from grpo.app.ui import port_taken

    if max_batch < 1:
        _fail(f"--max-batch {max_batch}: must be >= 1")
    if port_taken(port, host):
        _fail(f"port {port} already in use on {host}; pick a free one, e.g. grpo serve-model {folder} "
              f"--port {port + 1}")
    from grpo.console import quiet_library_noise
    from grpo.training.model_server import ModelServer, default_model_name, load_model

    quiet_library_noise()  # no "Loading weights" bar under the serving line
    try:
        model, tokenizer = load_model(folder)
    except GRPOPlatformError as err:
        _fail(str(err))
    from grpo.app import procguard

    server = ModelServer(model, tokenizer, model_name or default_model_name(folder), max_batch)
    procguard.install_signal_handlers()  # SIGTERM unwinds like Ctrl-C
    try:
        try:
            bound = server.listen(host, port)
        except OSError as err:  # taken between the check and the bind
            _fail(f"cannot listen on {host}:{port}: {err.strerror or err}")
        typer.echo(f"serving {server.name} at http://{host}:{bound}/v1 (Ctrl-C stops)")
        server.run()
    except (KeyboardInterrupt, procguard.Terminated):
        typer.echo("stopped")
    finally:
        server.stop()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


team_app = typer.Typer(no_args_is_help=True, help="The team setup without Docker: PostgreSQL, the Prefect and MLflow "
                                                   "servers on it with authentication, the work pools and deployments.")
app.add_typer(team_app, name="team")
TeamHomeOpt = Annotated[Optional[Path], typer.Option("--home", metavar="DIR", help="The team's folder: data, logs, "
                                                     "credentials (default: $GRPO_TEAM_HOME, else ./.grpo-team).")]


@team_app.command("up")
def team_up(
    home: TeamHomeOpt = None,
    host: Annotated[str, typer.Option(help="Address the Prefect and MLflow servers listen on (PostgreSQL stays on "
                                           "127.0.0.1); put a TLS proxy in front for others "
                                           "(docs/guides/team.md).")] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option(help="Prefect UI/API port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow UI/API port.")] = 5000,
    pg_port: Annotated[int, typer.Option(help="PostgreSQL port (127.0.0.1).")] = 5432,
    artifacts_destination: Annotated[Optional[str], typer.Option(
        help="Where MLflow stores artifacts (it serves them to clients): a folder (default: DIR/mlflow/artifacts) "
             "or s3://bucket/path with MLFLOW_S3_ENDPOINT_URL and AWS_* set (boto3 installed).")] = None,
) -> None:
    """Start the team setup in the background: PostgreSQL, the Prefect and MLflow servers with authentication, the
    work pools of infra/ and (the first time) the deployments of infra/prefect.yaml. Run from the repository root."""
    from grpo.app import team

    where = team.Team((home or team.default_home()).resolve())
    try:
        started = team.up(where, Path.cwd(), host, team.Ports(prefect_port, mlflow_port, pg_port),
                          artifacts_destination, echo=typer.echo)
    except GRPOPlatformError as err:
        _fail(str(err))
    urls = started.urls
    typer.echo(f"Prefect UI/API: {urls['prefect']} (API auth on)    MLflow UI/API: {urls['mlflow']} (basic auth)    "
               f"PostgreSQL: {urls['postgres']}")
    typer.echo(f"work pools: {', '.join(started.pools)}; deployments of infra/prefect.yaml: "
               + ("created" if started.deployed else "kept (grpo deploy updates them)"))
    typer.echo(f"Clients and workers (the worker's credentials, 0600): source {where.team_env}    "
               f"MLflow's admin: {where.admin_env}")
    typer.echo(f"Logs: {where.logs}/    Stop: grpo team down{'' if home is None else f' --home {home}'}")


@team_app.command("status")
def team_status(home: TeamHomeOpt = None) -> None:
    """Say what of the team setup runs, and where."""
    from grpo.app import team

    try:
        lines = team.status_lines(team.Team((home or team.default_home()).resolve()))
    except GRPOPlatformError as err:
        _fail(str(err))
    for line in lines:
        typer.echo(line)


@team_app.command("down")
def team_down(home: TeamHomeOpt = None) -> None:
    """Stop every process the team setup started; its data stays for the next grpo team up."""
    from grpo.app import team

    where = team.Team((home or team.default_home()).resolve())
    try:
        stopped = team.down(where)
    except GRPOPlatformError as err:
        _fail(str(err))
    typer.echo(f"stopped: {', '.join(stopped)} (data kept in {where.home})" if stopped
               else f"nothing of the team setup in {where.home} was running")


@app.command()
def serve(
    config: Annotated[
        Optional[Path], typer.Option("--config", "-c", metavar="FILE|PRESET",
                                     help="Defaults of the run form: a YAML file or preset name (default: tiny).")
    ] = None,
    schedule: Annotated[
        Optional[str], typer.Option("--schedule", help="Cron string: run the sweep (or the pipeline) on this schedule.")
    ] = None,
    schedule_flow: Annotated[
        Optional[str], typer.Option("--schedule-flow", help="Which deployment --schedule applies to: sweep or pipeline "
                                                            "(default: sweep when the sweep flow is installed).")
    ] = None,
    timezone: Annotated[Optional[str], typer.Option("--timezone", help="Time zone of --schedule (default UTC).")] = (
        None
    ),
    name: Annotated[str, typer.Option("--name", help="Deployment name: grpo-pipeline/NAME, grpo-sweep/NAME.")] = (
        "local"
    ),
    limit: Annotated[int, typer.Option("--limit", metavar="N", help="At most N flow runs at once; later submissions "
                                        "wait until one ends (two trainings on one machine only compete).")] = 1,
    allow_path: Annotated[Optional[list[Path]], typer.Option(
        "--allow-path", metavar="DIR", help="Runs may also read and write under DIR (repeatable; default: only "
                                            "the current directory, plus $GRPO_SERVE_ALLOW_PATHS).")] = None,
) -> None:
    """Serve the pipeline (and sweep) flows on the Prefect server at PREFECT_API_URL until Ctrl-C: runs started from
    the Prefect UI, or by the schedule, execute here; no work pool or worker needed."""
    from grpo.app import serve as serving

    if schedule_flow not in (None, "sweep", "pipeline"):
        _fail(f"--schedule-flow {schedule_flow!r}: valid values are 'sweep', 'pipeline'")
    if schedule_flow and schedule is None:
        _fail("--schedule-flow needs --schedule CRON")
    if limit < 1:
        _fail(f"--limit {limit}: must be >= 1")
    try:
        if schedule is not None:  # a bad cron is the user's error whether or not a server answers: say it first
            serving.check_cron(schedule, timezone)
        url = serving.check_server(on_wait=_note)
        deployments = serving.build_deployments(name, config, schedule, schedule_flow, timezone)
    except GRPOPlatformError as err:
        _fail(str(err))
    from grpo.pipeline.confine import ENV, serve_roots

    roots = serve_roots(Path.cwd(), allow_path)
    os.environ[ENV] = os.pathsep.join(map(str, roots))  # inherited by the flow runs this process starts
    typer.echo(f"Prefect server: {url.removesuffix('/api')}  (Ctrl-C stops serving and pauses the schedules)")
    typer.echo(f"runs may read and write under: {', '.join(map(str, roots))}")
    typer.echo(f"at most {limit} flow run{'s' if limit > 1 else ''} at once; later ones wait their turn (--limit)")
    serving.serve(deployments, limit=limit, echo=typer.echo)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def deploy(
    ctx: typer.Context,
    prefect_file: Annotated[Path, typer.Option("--prefect-file", help="Deployment file.")] = Path("infra/prefect.yaml"),
    name: Annotated[
        Optional[list[str]],
        typer.Option("--name", "-n", metavar="NAME", help="Deploy only this deployment (repeatable)."),
    ] = None,
) -> None:
    """`prefect deploy` of infra/prefect.yaml (run from the repository root, work pools created first; see
    infra/README.md). Other options are passed to `prefect deploy`."""
    from grpo.app import serve as serving

    try:
        code = serving.prefect_deploy(prefect_file, name, ctx.args, on_wait=_note)
    except GRPOPlatformError as err:
        _fail(str(err))
    raise typer.Exit(code=code)


def main() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no network here; don't try to phone home
    # Prefect's default start-up budget for its ephemeral API server (20 s) is missed on a busy 2-core machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(PREFECT_STARTUP_SECONDS))
    try:
        try:
            app()
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            sys.exit(130)
    except SystemExit as done:  # every ending the CLI chose: finished, refused (2), interrupted (130/143)
        from grpo import distributed

        if distributed.launched_world_size() > 1:
            distributed.exit_rank(done.code)
        raise


if __name__ == "__main__":
    main()
