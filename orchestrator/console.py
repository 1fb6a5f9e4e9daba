"""How things look to the operator: live views of a run (terminal, notebook, plain lines), and
the plan, doctor, status and logs renderings of the CLI."""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from orchestrator.charts import has_history, terminal_chart
from orchestrator.view import RunResult, RunView, describe_phases, human_bytes

if TYPE_CHECKING:
    from orchestrator.api import Scaling
    from orchestrator.doctor import DoctorReport, HostCheck
    from orchestrator.events import Event

TASK_COLOURS = ("cyan", "magenta", "green", "yellow", "blue", "bright_red", "bright_green",
                "bright_magenta")
STATE_STYLES = {"starting": "dim", "connected": "cyan", "training": "green", "running": "green",
                "finished": "bold green", "failed": "bold red", "error": "bold red",
                "lost": "bold magenta", "waiting": "yellow"}
NOTEBOOK_PRE = ("<pre style=\"white-space:pre;overflow-x:auto;line-height:1.25;"
                "font-family:Menlo,'DejaVu Sans Mono',consolas,monospace\">{code}</pre>")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def say_parts(console: Console, *parts: str | tuple[str, str]) -> None:
    """One line from plain text and (text, style) parts: whatever a part holds (a path, a
    host's name, a task's message) prints as it is, never read as rich markup."""
    console.print(Text.assemble(*parts), highlight=False, soft_wrap=True)


def task_style(key: str) -> str:
    """A colour per task, the same in every command: the chief bold, workers by index."""
    role, _, index = key.partition(":")
    if role == "chief":
        return "bold bright_white"
    return TASK_COLOURS[int(index) % len(TASK_COLOURS)] if index.isdigit() else "white"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


# -- a run, live -------------------------------------------------------------------------------
class PlainProgress:
    """One line per notable event; progress at most every ``every_s`` seconds per run."""

    def __init__(self, console: Console, every_s: float = 2.0) -> None:
        self.console = console
        self.every_s = every_s
        self._last = 0.0
        self._said = 0

    def __call__(self, view: RunView, event: Event | None) -> None:
        for message in view.messages[self._said :]:
            self.console.print(f"[{view.cluster}] {message}", markup=False, highlight=False)
        self._said = len(view.messages)
        if event is None:
            return
        if event.kind == "progress" and event.task == _chief(view):
            now = time.monotonic()
            if now - self._last >= self.every_s or event.get("step") == view.total_steps:
                self._last = now
                self.console.print(_progress_line(view, event), markup=False, highlight=False)
        elif event.kind == "built" and event.task == _chief(view) and replicas_text(view):
            self.console.print(f"[{event.task}] {replicas_text(view)}", markup=False,
                               highlight=False)
        elif event.kind in ("checkpoint", "resumed", "error"):
            self.console.print(f"[{event.task}] {event.kind}: {_event_text(event)}",
                               markup=False, highlight=False)


class RunFrame:
    """The picture of a run: a row per task, the overall bar with ETA, the latest messages."""

    def __init__(self) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._bar_id = self.bar.add_task("steps", total=None)

    def render(self, view: RunView) -> RenderableType:
        steps = min((t.step for t in view.tasks.values()), default=0)
        self.bar.update(self._bar_id, completed=steps, total=view.total_steps,
                        description=f"attempt {view.attempt}")
        messages = [Text(m, style="dim") for m in view.messages[-4:]]
        replicas = replicas_text(view)
        return Group(self.table(view), self.bar, *([Text(replicas)] if replicas else []), *messages)

    @staticmethod
    def table(view: RunView) -> Table:
        title = f"{view.cluster}  run {view.run_id}  attempt {view.attempt}"
        if view.attempt > 1:
            title += f" ({view.attempt - 1} restart{'s' if view.attempt > 2 else ''})"
        # Every cell is a Text: a str cell would be read as markup (a task's names, a host's).
        table = Table(title=Text(title), expand=False, title_justify="left")
        for column in ("task", "host", "state", "step", "loss", "steps/s", "last event"):
            table.add_column(column, justify="right" if column in ("step", "loss", "steps/s")
                             else "left", no_wrap=True)
        total = f"/{view.total_steps}" if view.total_steps else ""
        for t in view.tasks.values():
            table.add_row(Text(t.key, style=task_style(t.key)), Text(t.host),
                          Text(t.state, style=STATE_STYLES.get(t.state, "")),
                          Text(f"{t.step}{total}"), Text(_fmt(t.loss, ".4f")),
                          Text(_fmt(t.steps_per_s, ".1f")), Text(t.last_event))
        return table


class LiveProgress:
    """The run's frame on a terminal, redrawn in place (rich Live) a few times a second."""

    def __init__(self, console: Console) -> None:
        from rich.live import Live

        self.console = console
        self.frame = RunFrame()
        self.live = Live(console=console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveProgress:
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)

    def __call__(self, view: RunView, event: Event | None) -> None:
        self.live.update(self.frame.render(view))


class NotebookProgress:
    """The run's frame in a Jupyter notebook: one output updated in place through IPython's
    display handles (no ipywidgets needed), at most every ``every_s`` seconds."""

    def __init__(self, every_s: float = 0.5, width: int = 110) -> None:
        self.every_s = every_s
        self.width = width
        self.frame = RunFrame()
        self._handle: Any = None
        self._last = 0.0

    def __call__(self, view: RunView, event: Event | None) -> None:
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._show(self.frame.render(view))

    def finish(self, view: RunView, result: RunResult | None) -> None:
        """Show the last state (the throttle may have skipped it) and, on success, the summary."""
        parts: list[RenderableType] = [self.frame.render(view)]
        if result is not None:
            summary_text = Console(file=io.StringIO(), width=self.width, record=True)
            summary(summary_text, result)
            parts.append(Text.from_ansi(summary_text.export_text(styles=True)))
        self._show(Group(*parts))

    def _show(self, renderable: RenderableType) -> None:
        from IPython.display import display

        show: Any = display
        snapshot = Snapshot.of(renderable, self.width)
        if self._handle is None:
            self._handle = show(snapshot, display_id=True)
        else:
            self._handle.update(snapshot)


class Snapshot:
    """A rendered frame as Jupyter shows it: HTML, with plain text for other front ends."""

    def __init__(self, html: str, text: str) -> None:
        self.html = html
        self.text = text

    @classmethod
    def of(cls, renderable: RenderableType, width: int) -> Snapshot:
        console = Console(file=io.StringIO(), width=width, record=True, force_jupyter=False,
                          color_system="truecolor")
        console.print(renderable)
        text = console.export_text(clear=False)
        return cls(console.export_html(inline_styles=True, code_format=NOTEBOOK_PRE), text)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"text/plain": self.text, "text/html": self.html}

    def __repr__(self) -> str:
        return self.text


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, VS Code, Colab); IPython is not imported here."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ in ("ZMQInteractiveShell", "Shell")


def summary(console: Console, result: RunResult) -> None:
    """What a finished run achieved: time, attempts and why each ended, metrics, the model."""
    restarts = len(result.attempts) - 1
    say_parts(console, (f"run {result.run_id} succeeded", "bold green"),
              f" in {duration(result.seconds)}, {len(result.attempts)} attempt(s), "
              f"{restarts} restart(s)")
    for a in result.attempts:
        if a.cause:
            console.print(f"  attempt {a.number}: {a.cause} in {a.failed_task}: {a.detail}",
                          markup=False, highlight=False)
        else:
            console.print(f"  attempt {a.number}: {a.status}, started at step "
                          f"{a.resumed_from_step or 0}", markup=False, highlight=False)
    for name, value in result.metrics.items():
        console.print(f"  final {name}: {value:.4f}", markup=False, highlight=False)
    if result.model_path:
        console.print(f"  model saved by the chief: {result.model_path}",
                      markup=False, highlight=False, soft_wrap=True)


def replicas_text(view: RunView) -> str:
    """The replicas the tasks reported at connect, and what the batch and learning rate are
    for them ("" until a task connected)."""
    if view.replicas is None:
        return ""
    local = sorted({t.replicas for t in view.tasks.values() if t.replicas is not None})
    per_task = f" ({local[0]} per task)" if len(local) == 1 else (
        f" ({' or '.join(map(str, local))} per task)" if local else "")
    text = f"{view.replicas} replica(s) in sync{per_task}"
    if view.collectives:
        text += f", {view.collectives.upper()} collectives"
    if view.global_batch_size is not None:
        text += f"; global batch {view.global_batch_size}"
    if view.learning_rate is not None:
        text += f", learning rate {view.learning_rate:g}"
    return text


def _chief(view: RunView) -> str:
    return next(iter(view.tasks), "")


def _progress_line(view: RunView, event: Event) -> str:
    metrics = " ".join(f"{k}={v:.4f}" for k, v in (event.get("metrics") or {}).items())
    return (f"[{event.task}] step {event.get('step')}/{view.total_steps} "
            f"loss={_fmt(event.get('loss'), '.4f')} {metrics} "
            f"{_fmt(event.get('steps_per_s'), '.1f')} steps/s "
            f"{_fmt(event.get('examples_per_s'), '.0f')} examples/s").replace("  ", " ")


def _event_text(event: Event) -> str:
    if event.kind == "error":
        return f"{event.get('type', '')}: {event.get('message', '')}"
    return f"step {event.get('step')}"


# -- plan --------------------------------------------------------------------------------------
def render_plan(console: Console, document: dict[str, Any]) -> None:
    say = _printer(console)
    tasks, scaling = document["tasks"], document["scaling"]
    say_parts(console, (f"plan for {document['cluster']}", "bold"),
              f": {len(tasks)} task(s), {document['provider']} provider; nothing was touched")
    say("  hosts      " + _hosts_text(document))
    if document.get("price") is not None:
        say("  price      " + document["price"]["summary"])
    say("  job        " + document["job_summary"])
    if scaling["per_replica_batch_size"] is not None:
        say("  batch      " + _batch_text(scaling))
        say("  learning   " + _lr_text(scaling))
    if "checkpoints" in document:
        say("  checkpoint " + document["checkpoints"]["summary"])
    if "tensorboard" in document:
        say("  curves     " + document["tensorboard"]["summary"])
    if "stop" in document:
        say("  stop       " + document["stop"]["summary"])
    if "elastic" in document:
        say("  elastic    " + document["elastic"]["summary"])
    if "gpus" in document:
        say("  gpus       " + document["gpus"]["summary"])
    if "container" in document:
        say("  container  " + document["container"]["summary"])
    if "upload" in document:
        up = document["upload"]
        largest = ", ".join(f"{e['path']} {human_bytes(e['bytes'])}" for e in up["largest"])
        where = "once, to the cluster's shared root" if document["provider"] == "slurm" else \
            "to each host"
        sends = f"{up['files']} file(s), {human_bytes(up['bytes'])} {where}"
        say(f"  upload     {up['dir']}: " + (f"'up' refuses it: {up['refused']}" if up["refused"]
                                             else sends) + (f" (largest: {largest})" if largest else ""))
        if up["secrets_left_out_count"]:
            more = up["secrets_left_out_count"] - len(up["secrets_left_out"])
            say("             left out as secrets: " + ", ".join(up["secrets_left_out"])
                + (f" and {more} more" if more else ""))
    if "secrets" in document:
        say("  secrets    " + ", ".join(
            f"{x['name']} ({'set here' if x['set'] else 'NOT set here: train refuses'})"
            for x in document["secrets"]) + "; every task gets them from this environment")
    for t in tasks:
        chief = " (chief)" if t["is_chief"] else ""
        say_parts(console, "\n", (t["task"], task_style(t["task"])),
                  f"{chief}  {t['host']}  {t['endpoint']}")
        if "jax" in t:
            jax = t["jax"]
            say(f"  JAX        process {jax['process_id']} of {jax['processes']}, coordinator "
                f"{jax['coordinator']} (KERAS_DISTRIBUTION_*)")
        else:
            say(f"  TF_CONFIG  {json.dumps(t['tf_config'])}")
        say(f"  cwd        {t['cwd']}")
        say(f"  command    {t['command']}")
        say(f"  log        {t['log']}")
    kube = (document["creates"] or {}).get("kubernetes")
    if kube is not None:
        say("\nThe JobSet 'train' applies (kubectl apply -f accepts it as it is):" if "manifest"
            in kube else f"\n'up' would refuse: {kube.get('refused')}")
        if "manifest" in kube:
            console.print(json.dumps(kube["manifest"], indent=2), markup=False, highlight=False,
                          soft_wrap=True)
    say("\n(--json adds every task's environment)")


def _hosts_text(document: dict[str, Any]) -> str:
    creates = document["creates"]
    if creates and "kubernetes" in creates:
        kube = creates["kubernetes"]
        return (f"one JobSet {kube['jobset']} of {kube['pods']} pod(s) per attempt, in "
                f"{kube['where']}; its manifest is below")
    if creates and "slurm" in creates:
        slurm = creates["slurm"]
        return (f"one Slurm allocation, driven {slurm['where']}: {slurm['sbatch']}\n"
                f"             each task a job step in it: {slurm['srun']}")
    if creates:
        gpu = creates["accelerator"]
        gpus = f" + {gpu['count']} x {gpu['type']}" if gpu else ""
        spares = creates.get("spare_vms")
        grown = f"; spares {', '.join(spares)}, created as the group grows" if spares else ""
        return (f"GCP VMs {', '.join(creates['vms'])}: {creates['machine_type']}{gpus}"
                f"{', spot' if creates['spot'] else ''}, zones {' then '.join(creates['zones'])}; "
                f"'up' creates the missing ones{grown}")
    hosts = document["hosts"]
    if all(h["ssh"] is None for h in hosts):
        kind = "container(s)" if "container" in document else "process(es)"
        return f"{len(hosts)} {kind} on this machine"
    listed = ", ".join(f"{h['name']} ({h['ssh']['user']}@{h['ssh']['address']}:{h['ssh']['port']})"
                       for h in hosts)
    return f"listed in the spec, reached over SSH: {listed}"


def _batch_text(s: dict[str, Any]) -> str:
    text = (f"{s['per_replica_batch_size']} per replica x {s['replicas']} replicas = global "
            f"batch {s['global_batch_size']}")
    if not s["replicas_known"]:
        text += (" (assuming 1 replica per task, as on CPU hosts; each GPU of a host is a "
                 "replica: 'orchestrate doctor' counts them, and train shows what the tasks "
                 "report)")
    return text


def _lr_text(s: dict[str, Any]) -> str:
    if not s["scale_learning_rate"]:
        return f"{s['learning_rate']:g} (scale_learning_rate: false)"
    return (f"{s['learning_rate']:g} x {s['replicas']} replicas = {s['scaled_learning_rate']:g} "
            "(scale_learning_rate: true)")


def _printer(console: Console) -> Any:
    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    return say


# -- doctor ------------------------------------------------------------------------------------
def render_doctor(console: Console, report: DoctorReport, scaling: Scaling | None = None) -> None:
    """The host table, the network matrix in one line, then every problem with its fix."""
    hosts = len(report.hosts)
    say_parts(console, (f"doctor: {report.cluster}", "bold"),
              f" ({report.provider}), {hosts} machine(s) checked in {report.seconds:.1f}s")
    for h in report.hosts:
        _render_host(console, h, report.backend)
    if report.links:
        say_parts(console, f"network: {_links_text(report)} (every host to every other "
                  "host's task port)")
    if scaling is not None and scaling.replicas_known and scaling.per_replica_batch_size:
        say_parts(console, f"training: {_batch_text(asdict(scaling))}; learning rate "
                  f"{_lr_text(asdict(scaling))}")
    render_problems(console, report)


def _links_text(report: DoctorReport) -> str:
    counts = {"open": 0, "blocked": 0, "not checked": 0}
    for link in report.links:
        counts["open" if link.ok else "blocked" if link.ok is False else "not checked"] += 1
    return f"{counts['open']} of {len(report.links)} connections open" + "".join(
        f", {n} {what}" for what, n in counts.items() if n and what != "open")


def render_problems(console: Console, report: DoctorReport) -> None:
    for p in report.problems:
        mark = ("✗ blocking", "bold red") if p.blocking else ("! warning", "yellow")
        say_parts(console, mark, f" {p.check}: {p.message}")
        console.print(f"    fix: {p.fix}", markup=False, highlight=False, soft_wrap=True)
    if report.ok:
        warned = f" ({len(report.warnings)} warning(s))" if report.warnings else ""
        say_parts(console, ("✓ ready to train", "bold green"), warned)
    else:
        say_parts(console, (f"{len(report.blocking)} blocking problem(s)", "bold red"),
                  ": training would fail; fix them first")


def doctor_brief(console: Console, report: DoctorReport) -> None:
    """What ``train`` says of its doctor: one line, and any warnings (blocking problems
    are the error that stops it)."""
    if report.ok:
        console.print(doctor_line(report), markup=False, highlight=False, soft_wrap=True)
    for p in report.warnings:
        say_parts(console, ("! warning", "yellow"), f" {p.check}: {p.message}")
        console.print(f"    fix: {p.fix}", markup=False, highlight=False, soft_wrap=True)


def doctor_line(report: DoctorReport) -> str:
    """One line for the start of ``train`` when every check passed."""
    first = next((h for h in report.hosts if h.checked), None)
    if first is None:
        return f"doctor: {len(report.hosts)} machine(s) checked"
    gpus = sum(len(h.gpus) for h in report.hosts)
    links = f", {_links_text(report)}" if report.links else ""
    image = first.fact("container", "image_id")
    stack = (f"image {str(image)[:19]}" if image else
             f"python {first.python_version}, jax {first.jax_version}, keras "
             f"{first.keras_version}" if report.backend == "jax" else
             f"python {first.python_version}, tensorflow {first.tf_version}")
    return (f"doctor: {len(report.hosts)} machine(s) ok in {report.seconds:.1f}s: {stack}, "
            f"{gpus or 'no'} GPU(s){links}")


def _render_host(console: Console, h: HostCheck, backend: str) -> None:
    say = _printer(console)
    say_parts(console, (h.name, "bold"), f"  {h.address}  tasks {', '.join(h.tasks)}")
    if not h.checked:
        say_parts(console, "  ", ("unreachable" if not h.reachable else "not checked", "bold red"),
                  f": {h.error}")
        return
    cuda = f" (built for CUDA {h.tf_cuda})" if h.tf_cuda else ""
    if h.fact("container"):  # the tasks run the image's Python and TensorFlow
        say(f"  python {h.python_version} ({h.python}) on the host, for its checks")
    elif backend == "jax":
        say(f"  python {h.python_version} ({h.python}), jax {h.jax_version or 'MISSING'} "
            f"(jaxlib {h.jaxlib_version or '-'}), keras {h.keras_version or 'MISSING'}")
    else:
        say(f"  python {h.python_version} ({h.python}), tensorflow {h.tf_version or 'MISSING'}"
            f"{cuda}, tf_keras {h.tf_keras_version or '-'}")
    jax = backend == "jax" and not h.fact("container")  # JAX's view: the host's own
    collectives = f", collectives {h.jax_collectives}" if jax and h.jax_collectives else ""
    if h.gpus:
        seen = _seen(h, jax)
        models = ", ".join(f"{g.name} ({human_bytes((g.memory_mib or 0) << 20)})" for g in h.gpus)
        say(f"  GPUs: {models}; driver {h.driver}, CUDA {h.driver_cuda}{seen}{collectives}")
    else:
        say(f"  GPUs: none ({h.fact('nvidia', 'error') or 'nvidia-smi lists none'}): tasks "
            f"train on the CPU{collectives}")
    engine = h.fact("container")
    if engine:
        image = engine.get("image_id")
        inside = {True: "; a container sees the GPUs", False: "; a container does NOT see the "
                  "GPUs", None: ""}[engine.get("gpus_inside")]
        say("  container: " + ("engine MISSING" if not engine.get("installed") else
                               "engine NOT USABLE" if not engine.get("usable") else
                               f"image {str(image)[:19]}" if image else "image not pulled yet")
            + inside)
    free = human_bytes(h.free_bytes) if h.free_bytes is not None else "?"
    ports = ", ".join(f"{p['port']} {'free' if p['free'] else 'IN USE'}" for p in h.ports)
    say(f"  disk: {free} free for {h.fact('disk', 'path')}; ports: {ports}")


def _seen(h: HostCheck, jax: bool) -> str:
    """How many of a host's GPUs the job's framework sees, where it looked."""
    if jax:
        return "" if h.jax_gpus is None else f"; JAX sees {h.jax_gpus}"
    return "" if h.tf_gpus is None else f"; TensorFlow sees {len(h.tf_gpus)}"


# -- status ------------------------------------------------------------------------------------
def render_status(console: Console, clusters: Sequence[dict[str, Any]], *,
                  charts: bool = True) -> None:
    """Each cluster with its runs; with ``charts``, its newest run drawn under it."""
    if not clusters:
        console.print("no clusters yet: start with 'orchestrate train SPEC'", highlight=False)
    for c in clusters:
        say_parts(console, (str(c["name"]), "bold"),
                  f" ({c['provider']}) {c['status']}, spec {c['spec_path']}")
        if c["hosts"]:
            console.print("  hosts: " + ", ".join(f"{h['name']} {h['address']}" for h in c["hosts"]),
                          markup=False, highlight=False, soft_wrap=True)
        for index, r in enumerate(c["runs"]):
            _render_run(console, r)
            if charts and index == 0 and has_history(r):
                console.print(Padding(terminal_chart(r, width=min(console.width, 140) - 4),
                                      (0, 0, 0, 4)))


def _render_run(console: Console, r: dict[str, Any]) -> None:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["started_at"]))
    style = {"succeeded": "green", "running": "cyan"}.get(r["status"], "red")
    attempts = len(r["attempts"])
    controller = ""
    if r["status"] == "running":
        controller = f", controller pid {r['controller_pid']} " + (
            "alive" if r["controller_alive"] else "gone (train --attach takes over)")
    metrics = "  " + " ".join(f"{k} {v:.4f}" for k, v in r["metrics"].items()) if r["metrics"] else ""
    say_parts(console, f"  run {r['id']} ", (str(r["status"]), style),
              f" {when}, {duration(r['seconds'])}, {attempts} attempt(s), {r['restarts']} "
              f"restart(s){controller}{metrics}")
    if r["status"] == "running" and r["message"]:
        console.print(f"    now: {r['message']}", markup=False, highlight=False, soft_wrap=True)
    for a in r["attempts"]:
        resized = f" on {a['resized']}" if a.get("resized") else ""
        console.print(f"    attempt {a['number']}: {a['status']} from step "
                      f"{a['resumed_from_step'] or 0} to {a['last_step'] or 0}{resized}"
                      f"{attempt_figures(a)}", markup=False, highlight=False, soft_wrap=True)
    if r["model_path"]:
        console.print(f"    model: {r['model_path']}", markup=False, highlight=False,
                      soft_wrap=True)
    if r.get("cost"):
        console.print(f"    {r['cost']['summary']}", markup=False, highlight=False,
                      soft_wrap=True)


def attempt_figures(a: dict[str, Any]) -> str:
    if not a["cause"]:
        return ""
    first = (a["detail"].splitlines() or [""])[0]
    parts = [f"{a['cause']} in {a['failed_task']}: {first[:160]}"]
    if a["detect_s"] is not None:
        parts.append(f"detected in {a['detect_s']:.1f}s")
    if a["recovery_s"] is not None:
        parts.append(f"back to training {a['recovery_s']:.1f}s after the failure")
    if a.get("phases"):
        parts.append("of which " + describe_phases(a["phases"]))
    if a.get("snapshot_step") is not None:
        parts.append(f"resumed from a survivor's snapshot at step {a['snapshot_step']}")
    elif a.get("snapshot"):
        parts.append(f"no snapshot ({a['snapshot'][:160]})")
    if a["steps_lost"] is not None:
        parts.append(f"{a['steps_lost']} step(s) redone")
    return "; " + "; ".join(parts)


# -- logs --------------------------------------------------------------------------------------
def log_line(console: Console, task: str, line: str) -> None:
    prefix = Text(f"[{task}] ", style=task_style(task))
    console.print(prefix + Text(line), highlight=False, soft_wrap=True)
