"""The `orchestrate` command: parses arguments, calls the API, renders. No logic lives here."""

from __future__ import annotations

import functools
import gc
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from orchestrator import early_claim
from orchestrator.errors import OrchestratorError

app = typer.Typer(
    name="orchestrate",
    help="Multi-worker Keras/TensorFlow training: one spec file, every worker, survives failures.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
DEBUG = {"on": False}

def say(text: str) -> None:
    """A line of plain text: paths, names, addresses and commands are the user's or a host's,
    so none of it is read as rich markup."""
    out.print(text, markup=False, highlight=False, soft_wrap=True)


SpecArg = Annotated[Path, typer.Argument(help="Cluster spec file (YAML).", show_default=False)]


@app.callback()
def _global(debug: Annotated[bool, typer.Option(help="Show tracebacks.")] = False) -> None:
    DEBUG["on"] = debug


@app.command()
def validate(spec_file: SpecArg) -> None:
    """Check a spec file and say what it describes."""
    from orchestrator import spec as specs

    s = specs.load(spec_file)
    job = s.job.module if s.job.mode == "managed" else " ".join(s.job.command)
    say(f"{spec_file}: ok: cluster {s.name!r}, provider {s.provider.kind}, "
        f"{s.num_tasks} task(s), {s.job.mode} job ({job})")


@app.command()
def plan(spec_file: SpecArg,
         as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False) -> None:
    """Show the hosts, every task's address, port, TF_CONFIG and command, touching nothing."""
    from orchestrator.api import Cluster
    from orchestrator.console import render_plan

    document = Cluster.from_spec(spec_file).plan_document()
    if as_json:
        out.print_json(json.dumps(document), highlight=False)
    else:
        render_plan(out, document)


@app.command()
def doctor(
    spec_file: SpecArg,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False,
    import_tf: Annotated[bool, typer.Option(
        "--import-tf", help="Import TensorFlow on every host (seconds each); by default only "
        "on hosts with GPUs, to see the GPUs it sees. For a job with job.backend: jax, JAX "
        "instead.")] = False,
) -> None:
    """Check every host in parallel: SSH, Python, TensorFlow, GPUs, disk, ports, network."""
    from orchestrator.api import Cluster
    from orchestrator.console import render_doctor

    cluster = Cluster.from_spec(spec_file)
    report = cluster.doctor(tensorflow="always" if import_tf else "auto")
    if as_json:
        out.print_json(json.dumps(report.to_dict()), highlight=False)
    else:
        render_doctor(out, report, cluster.scaling(report.replicas))
    if not report.ok:
        raise typer.Exit(1)


@app.command()
def up(
    spec_file: SpecArg,
    attach: Annotated[str | None, typer.Option(
        metavar="JOBID", help="Use an allocation you hold (Slurm: a job id from salloc) "
        "instead of submitting one; 'down' leaves it running.")] = None,
) -> None:
    """Create or attach to the cluster's hosts and prepare them."""
    from orchestrator.api import Cluster

    cluster = Cluster.from_spec(spec_file)
    hosts = cluster.up(attach=attach, progress=lambda line: say(f"  {line}"))
    for note in cluster.provider.notes():
        say(f"  {note}")
    for h in hosts:
        say(f"  {h.name}  {h.address}" + (f"  (node {h.node})" if h.node else ""))
    out.print(f"[green]up[/]: {len(hosts)} host(s)", highlight=False)


@app.command()
def train(
    spec_file: SpecArg,
    plain: Annotated[bool, typer.Option(help="Plain lines even on a terminal.")] = False,
    attach: Annotated[bool, typer.Option(
        help="Take over a running run whose controller died; its tasks kept training.")] = False,
    resume: Annotated[str | None, typer.Option(
        metavar="RUN", help="Continue an ended run from its newest checkpoint: a run id, or "
        "'last' (the newest stopped, cancelled or failed run).")] = None,
    run_doctor: Annotated[bool, typer.Option(
        "--doctor/--no-doctor", help="Check every host first and stop on a blocking problem.")]
    = True,
    recheck: Annotated[bool, typer.Option(
        help="Run the doctor even if it passed for this spec and these hosts before (a pass "
        "with nothing found is kept for the next train, 12 h at most).")] = False,
) -> None:
    """Launch every task, show live progress, recover from failures, print the result."""
    from orchestrator.api import Cluster
    from orchestrator.console import LiveProgress, PlainProgress, doctor_brief
    from orchestrator.console import summary as show_summary

    cluster = Cluster.from_spec(spec_file)
    cluster.provider.progress = lambda line: say(f"  {line}")  # what 'up' waits for
    train_with = functools.partial(cluster.train, attach=attach, resume=resume, doctor=run_doctor,
                                   on_doctor=lambda report: doctor_brief(out, report),
                                   recheck=recheck)
    if out.is_terminal and not plain:
        with LiveProgress(out) as live:
            run = train_with(listener=live)
    else:
        run = train_with(listener=PlainProgress(out))
    show_summary(out, run.wait())
    say(f"  logs: orchestrate logs {cluster.name} --run {run.id}")


@app.command()
def down(spec_file: SpecArg) -> None:
    """Stop our tasks and remove what `up` made."""
    from orchestrator.api import Cluster

    report = Cluster.from_spec(spec_file).down()
    for line in report.stopped:
        say(f"  stopped {line}")
    for line in report.removed:
        say(f"  removed {line}")
    for line in report.notes:
        say(f"  {line}")
    out.print("[green]down[/]", highlight=False)


@app.command()
def status(
    name: Annotated[str | None, typer.Argument(help="Cluster name; all when omitted.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False,
    run: Annotated[str | None, typer.Option(help="Only this run (an id 'status' lists).")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Draw the run (the newest, or --run) to this .png or .svg: loss and steps/s over "
        "time, the restarts marked. Needs matplotlib (the plot extra).")] = None,
    chart: Annotated[bool, typer.Option(
        help="Draw each cluster's newest run (or --run) in the terminal.")] = True,
) -> None:
    """Clusters, their hosts and state, runs with every attempt, its cause and recovery
    figures, and a chart of the newest run's loss and speed over time."""
    from orchestrator.api import plot_run, statuses
    from orchestrator.console import render_status

    if plot is not None:
        written = plot_run(name, run, plot)
        out.print(f"wrote {written}", markup=False, highlight=False)
        return
    clusters = [c.to_dict() for c in statuses(name, run_id=run)]
    if as_json:
        out.print_json(json.dumps({"clusters": clusters}), highlight=False)
    else:
        render_status(out, clusters, charts=chart)


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="Cluster name.")],
    task: Annotated[str | None, typer.Option(help="One task, e.g. worker:1.")] = None,
    run: Annotated[str | None, typer.Option(help="Run id; the newest by default.")] = None,
    attempt: Annotated[int | None, typer.Option(help="Attempt number; the last by default.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")]
    = False,
) -> None:
    """Every task's output (or one task's), each line prefixed with its role and index."""
    from orchestrator.api import Cluster
    from orchestrator.console import log_line

    cluster = Cluster.named(name)
    for key, line in cluster.logs(run, task=task, attempt=attempt, follow=follow):
        log_line(out, key, line)


@app.command()
def tensorboard(
    cluster: Annotated[str, typer.Argument(help="Cluster spec file (YAML), or cluster name.")],
    run: Annotated[str | None, typer.Option(help="Run id; the newest by default.")] = None,
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1; a free one by default.")] = 0,
    print_dir: Annotated[bool, typer.Option(
        "--print-dir", help="Only bring the logs here and print their directory.")] = False,
) -> None:
    """TensorBoard on a run's logs (its chief's, every attempt's), copied here where they were
    written on another machine, and kept up to date while it runs."""
    from orchestrator.api import Cluster

    chosen = Cluster.from_spec(cluster) if Path(cluster).is_file() else Cluster.named(cluster)
    if print_dir:
        logs = chosen.tensorboard(run)
        for note in logs.notes:
            err.print(f"note: {note}", markup=False, highlight=False)
        say(str(logs.directory))
        return
    chosen.serve_tensorboard(run, say, port=port)


@app.command()
def schema() -> None:
    """Print the spec file's JSON Schema, for editors to validate and complete spec files."""
    from orchestrator.api import spec_schema

    out.print_json(json.dumps(spec_schema()), highlight=False)


def main(*, reached: bool = False) -> None:
    """The command. ``reached``: the program reached a kept cluster's hosts already, before
    this module loaded (``orchestrator/__main__.py``)."""
    try:
        if not reached:
            early_claim.begin(sys.argv[1:])
        _import_the_controller()
        try:
            app()
        finally:
            early_claim.reset()  # what the command did not take: nothing outlives it
            early_claim.hold(sys.argv[1:])  # but the kept hosts' connections, for the next
    except OrchestratorError as exc:
        if DEBUG["on"]:
            raise
        err.print(Text.assemble(("error:", "red"), " ", exc.message), highlight=False,
                  soft_wrap=True)
        if exc.fix:
            err.print(f"  fix: {exc.fix}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        _interrupted()
    except SystemExit as exc:  # typer turns a Ctrl-C into a silent exit 130
        if exc.code == 130 and _from_ctrl_c(exc):
            _interrupted()
        raise


def _import_the_controller() -> None:
    """Import what every command but ``--help`` uses with the collector off, then keep those
    objects out of its later passes (``gc.freeze``): the imports make some 80,000 objects, and
    the full collections they set off cost every start 0.04 to 0.09 s (Python 3.11, measured).
    The command itself runs with the collector on."""
    gc.disable()
    try:
        import orchestrator.api
        import orchestrator.console  # noqa: F401
    finally:
        gc.freeze()
        gc.enable()


def _interrupted() -> None:
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
    err.print({
        "train": "interrupted: every task of this run was stopped",
        "up": "interrupted: 'orchestrate down FILE' removes whatever was already made",
    }.get(command, "interrupted"), markup=False)
    sys.exit(130)


def _from_ctrl_c(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    for _ in range(8):  # SystemExit <- typer's Exit <- KeyboardInterrupt
        if seen is None:
            return False
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


if __name__ == "__main__":
    main()
