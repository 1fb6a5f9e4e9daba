"""The `orchestrate` command: parses arguments, calls the API, renders. No logic lives here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from orchestrator.errors import OrchestratorError, StateError

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
    out.print(f"{spec_file}: ok: cluster {s.name!r}, provider {s.provider.kind}, "
              f"{s.num_tasks} task(s), {s.job.mode} job ({job})")


@app.command()
def plan(spec_file: SpecArg,
         as_json: Annotated[bool, typer.Option("--json", help="Machine-readable.")] = False) -> None:
    """Show every task's host, port, TF_CONFIG and command, touching nothing."""
    from orchestrator.api import Cluster

    p = Cluster.from_spec(spec_file).plan()
    tasks: list[dict[str, Any]] = [
        {"task": t.key, "host": t.host.name, "endpoint": t.endpoint, "tf_config": t.tf_config,
         "cwd": t.cwd, "argv": list(t.argv)}
        for t in p.tasks
    ]
    if as_json:
        out.print_json(json.dumps({"cluster": p.cluster, "chief": p.chief_key, "tasks": tasks}))
        return
    for t in tasks:
        out.print(f"[bold]{t['task']}[/] on {t['host']} at {t['endpoint']}")
        out.print(f"  TF_CONFIG={json.dumps(t['tf_config'])}")
        out.print(f"  cwd: {t['cwd']}")
        out.print(f"  command: {' '.join(t['argv'][:4])} ...")


@app.command()
def up(spec_file: SpecArg) -> None:
    """Create or attach to the cluster's hosts and prepare them."""
    from orchestrator.api import Cluster

    hosts = Cluster.from_spec(spec_file).up()
    for h in hosts:
        out.print(f"  {h.name}  {h.address}")
    out.print(f"[green]up[/]: {len(hosts)} host(s)")


@app.command()
def train(
    spec_file: SpecArg,
    plain: Annotated[bool, typer.Option(help="Plain lines even on a terminal.")] = False,
    attach: Annotated[bool, typer.Option(
        help="Take over a running run whose controller died; its tasks kept training.")] = False,
) -> None:
    """Launch every task, stream progress, recover from failures, print the result."""
    from orchestrator.api import Cluster
    from orchestrator.console import LiveProgress, PlainProgress, summary

    cluster = Cluster.from_spec(spec_file)
    if out.is_terminal and not plain:
        with LiveProgress(out) as live:
            run = cluster.train(listener=live, attach=attach)
    else:
        run = cluster.train(listener=PlainProgress(out), attach=attach)
    summary(out, run.wait())


@app.command()
def down(spec_file: SpecArg) -> None:
    """Stop our tasks and remove what `up` made."""
    from orchestrator.api import Cluster

    report = Cluster.from_spec(spec_file).down()
    for line in report.stopped:
        out.print(f"  stopped {line}")
    for line in report.removed:
        out.print(f"  removed {line}")
    for line in report.notes:
        out.print(f"  {line}")
    out.print("[green]down[/]")


@app.command()
def status(
    name: Annotated[str | None, typer.Argument(help="Cluster name; all when omitted.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Clusters, their runs and every attempt with its cause."""
    from dataclasses import asdict

    from orchestrator.state import Store

    store = Store()
    clusters = [c for c in store.clusters() if name in (None, c.name)]
    if name and not clusters:
        raise StateError(f"no cluster named {name!r}", fix="see 'orchestrate status'")
    data: list[dict[str, Any]] = [
        {"cluster": asdict(c), "runs": [asdict(r) for r in store.runs(c.name)]} for c in clusters
    ]
    if as_json:
        out.print_json(json.dumps(data))
        return
    for entry in data:
        c = entry["cluster"]
        out.print(f"[bold]{c['name']}[/] ({c['provider']}) {c['status']}, spec {c['spec_path']}")
        for h in c["hosts"]:
            out.print(f"  host {h['name']} {h['address']}")
        for r in entry["runs"]:
            out.print(f"  run {r['id']} {r['status']} "
                      f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(r['started_at']))} "
                      f"{json.dumps(r['metrics']) if r['metrics'] else ''}")
            for a in r["attempts"]:
                out.print(f"    attempt {a['number']}: {a['status']} from step "
                          f"{a['resumed_from_step'] or 0} to {a['last_step'] or 0}"
                          f"{_attempt_figures(a)}", markup=False)


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="Cluster name.")],
    task: Annotated[str | None, typer.Option(help="One task, e.g. worker:1.")] = None,
    run: Annotated[str | None, typer.Option(help="Run id; the newest by default.")] = None,
    attempt: Annotated[int | None, typer.Option(help="Attempt number; the last by default.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the run ends.")]
    = False,
) -> None:
    """Each task's output, prefixed with its role and index."""
    from orchestrator.api import Cluster
    from orchestrator.state import Store

    record = Store().get_cluster(name)
    if record is None:
        raise StateError(f"no cluster named {name!r}", fix="see 'orchestrate status'")
    cluster = Cluster.from_spec(record.spec_path)
    for key, line in cluster.logs(run, task=task, attempt=attempt, follow=follow):
        out.print(f"[cyan]\\[{key}][/] {line}", markup=True, highlight=False, soft_wrap=True)


def _attempt_figures(a: dict[str, Any]) -> str:
    if not a["cause"]:
        return ""
    parts = [f"{a['cause']} in {a['failed_task']}: {a['detail'].splitlines()[0][:160]}"]
    if a["failed_at"] is not None and a["detected_at"] is not None:
        parts.append(f"detected in {max(0.0, a['detected_at'] - a['failed_at']):.1f}s")
    if a["recovery_s"] is not None:
        parts.append(f"back to training {a['recovery_s']:.1f}s after the failure")
    if a["steps_lost"] is not None:
        parts.append(f"{a['steps_lost']} step(s) redone")
    return "; " + "; ".join(parts)


def main() -> None:
    try:
        app()
    except OrchestratorError as exc:
        if DEBUG["on"]:
            raise
        err.print(f"[red]error:[/] {escape(exc.message)}", highlight=False, soft_wrap=True)
        if exc.fix:
            err.print(f"  fix: {exc.fix}", highlight=False, markup=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted; every task of this run was stopped")
        sys.exit(130)


if __name__ == "__main__":
    main()
