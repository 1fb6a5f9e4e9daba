"""The JAX side of managed jobs (``job.backend: jax``): the user's Keras 3 model trained across
every task's processes with JAX's distributed service and ``keras.distribution.DataParallel``.

No TensorFlow here (unless the module's input is a tf.data pipeline): a JAX host need not
have it. What multi-process JAX asks, measured with
jax 0.10.2 and keras 3.15 (the facts are in issue 30), and how this runtime does it:

- ``jax.distributed.initialize`` itself, not ``keras.distribution.initialize`` (which does not
  pass the timeouts on): the coordinator at the chief's address, and heartbeat and shutdown
  timeouts of seconds, so that a process whose peer died aborts in seconds instead of JAX's
  100 to 300 s and the controller restarts the group.
- The same seed on every process before the model is built (the initial weights are put on
  every device and must agree: checked once for all of them, ``_placed_once``, not by JAX
  once per variable), then Keras's DataParallel over every device of every process.
- Each process feeds its own part of every global batch (``Batches``): which examples make up
  global step ``s`` is a function of the seed and ``s`` alone, so a resumed run reads what an
  unbroken one reads (a ``tf.data.Dataset`` of global batches from the module is read whole by
  every process, which keeps its rows, and skipped to the step on a resume:
  ``DatasetBatches``). With ``distribution: model_parallel``, Keras's ModelParallel over the
  spec's mesh and the module's layout map instead; a split variable is gathered to be saved.
- Saving is a collective: every process saves, only the chief's copy is kept (the others write
  to a scratch directory). Checkpoints are Keras's own ``.weights.h5`` (model and optimizer),
  plus ``.state.npz`` (the step, and the non-trainable variables ``.weights.h5`` leaves out:
  the dropout layers' seed states), named by a ``checkpoint`` index in the layout of the
  TensorFlow runtimes (``DIR/chief/checkpoint``), so the controller's verification, copies and
  warm checks find them as they find TensorFlow's.
- A SIGTERM on any task: its handler tells JAX's preemption service (the coordination
  service's preemption notice, as JAX's own SIGTERM notifier would, which is replaced so that
  the runtime knows the signal came here); every process checks
  ``multihost_utils.reached_preemption_sync_point`` after each step, so all of them stop at
  one agreed step, save it and exit with STOPPED_EXIT.
- A crash (``snapshot_on_crash``, data parallelism): the step function keeps its input state
  (no buffer donation: one more copy of the state on each device while a step runs) and the
  runtime waits for every step's result, so the state of the last step this process completed
  is always at hand, whole on its devices. When a peer dies, the chief's next step fails at
  once (gloo: "Connection reset by peer"); it then writes that state as an ordinary checkpoint
  from its own memory, with no collective (``JaxTraining.snapshot``). A step that hangs on a
  peer that is gone (a host cut off) never fails: the controller's snapshot request, read on a
  thread of its own, saves the same state while the step waits. The coordination service, which
  ends every process once it has missed a dead one's heartbeats, waits ``timeouts.snapshot_s``
  longer for that (JAX's recoverability mode, which would not end them, lets the coordinator
  leave before the others have disconnected at a clean end: they then abort). The service runs
  in a process of its own beside the chief's (``worker.jax_service``): in the chief's, its
  death would end every other process at once; beside it, the process the controller asks
  saves the same state in the chief's place.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import io
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from worker.checkpoints import (
    STATE,
    STEP_KEY,
    WEIGHTS,
    index_names,
    join,
    makedirs,
    read_bytes,
    write_bytes,
    write_index,
)
from worker.events import emit
from worker.runtimes.common import (
    COORDINATOR_WAIT_S,
    SnapshotRefused,
    asked_for_snapshot,
    await_port,
    emit_error,
    emit_progress,
    exit_now,
    exit_stopped,
    save_model,
    save_snapshot,
    weights_digest,
    when_asked,
)
from worker.runtimes.managed import BuildError, Job
from worker.tensorboard import Board, Profile, learning_rate
from worker.tfimport import keras as import_keras

KEEP = 3  # checkpoints kept in the chief's directory, as for the TensorFlow runtimes
# Long enough for a loaded machine's missed beats; short enough that a process whose peer died
# stops in seconds (JAX's defaults: 100 s to declare a peer dead, 300 s at shutdown).
HEARTBEAT_TIMEOUT_S = 10
SHUTDOWN_TIMEOUT_S = 10
# The preemption service's key (tsl's preemption_sync_manager.cc): a time, RFC 3339, at which a
# task will be gone; every process's sync manager then agrees on a step to stop at.
PREEMPTION_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"

Phase = str


@dataclass(frozen=True)
class Processes:
    """This task among JAX's processes, from the ``KERAS_DISTRIBUTION_*`` variables the
    controller sets (every task's address, the chief's first: the coordinator)."""

    coordinator: str
    count: int
    index: int

    @classmethod
    def from_env(cls) -> Processes:
        addresses = os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")
        return cls(addresses[0], int(os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"]),
                   int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"]))

    @property
    def chief(self) -> bool:
        return self.index == 0


def run(job: Job) -> int:
    """Train the job's model on this task with JAX; return the process exit code."""
    phase: Phase = "connect"
    try:
        processes = Processes.from_env()
        # Started first, so that it serves by the time JAX is imported here.
        service = _Service.start(processes, job.snapshot_s) \
            if job.snapshot_on_crash and processes.chief and processes.count > 1 else None
        jax = _connect(processes, snapshot_s=job.snapshot_s if job.snapshot_on_crash else 0.0,
                       service=service)
        keras = import_keras()

        emit("connected", replicas=jax.device_count(), local_replicas=jax.local_device_count(),
             gpus=sum(1 for d in jax.local_devices() if d.platform == "gpu"),
             collectives="nccl" if jax.default_backend() == "gpu" else "gloo",
             jax_version=jax.__version__, keras_version=keras.__version__)
        phase = "build"
        training = _build(jax, keras, job, processes)
        training.service = service
        phase = "train"
        try:
            metrics, step = training.fit()
        except Exception:
            # The chief saves the state of the last step it completed, whatever broke the step
            # after it (a computation's collective, or a checkpoint's, whose peer is gone):
            # that state is whole, the step that failed left it be. Another process saves only
            # when the controller asks it to (the chief is the peer that died: the coordination
            # service, in a process of its own, outlives it).
            if training.snapshots and (processes.chief or asked_for_snapshot()):
                training.snapshot_once()
            raise
        phase = "save"
        model_path = training.save_model()
        emit("finished", metrics=metrics, model_path=model_path,
             weights_sha256=training.weights_digest(), step=step)
        return 0
    except Exception as exc:  # reported to the controller, then the task fails
        emit_error(exc, phase)
        _fail_now()


def _fail_now() -> NoReturn:
    """End a task that failed, now: its ``atexit`` handlers run (``exit_now``) but JAX's own.
    Those wait for the work in flight and then for every process at JAX's shutdown barrier
    (``SHUTDOWN_TIMEOUT_S``), which a broken group never reaches: measured, a chief whose
    checkpoint found the disk full said its error and lived on past ``timeouts.hang_s``, so
    the attempt was taken for hung, not crashed. Where this JAX keeps them elsewhere, they
    stay (the exit then takes that long again)."""
    with contextlib.suppress(ImportError):
        from jax._src import api, dispatch

        for handler in (getattr(api, "clean_up", None), getattr(dispatch, "wait_for_tokens", None)):
            if handler is not None:
                atexit.unregister(handler)
    exit_now(1)


def _connect(processes: Processes, *, snapshot_s: float = 0.0,
             service: _Service | None = None) -> Any:
    """JAX's distributed service, the coordinator at the chief's address: in the chief's
    process, or in ``service``, a process of its own that the chief started. ``snapshot_s``:
    how long a survivor may take to save its snapshot after a peer died; the service, which
    ends every process once it has missed a dead one's heartbeats for ``heartbeat_timeout``,
    waits that much longer (the controller sees a death itself, and stops the group)."""
    import jax

    _cache_compilations(jax)
    if service is not None:
        service.await_serving()
    elif not processes.chief:
        await_port(processes.coordinator)
    with service.in_place_of_jaxs() if service is not None else contextlib.nullcontext():
        jax.distributed.initialize(
            coordinator_address=processes.coordinator, num_processes=processes.count,
            process_id=processes.index, heartbeat_timeout_seconds=_heartbeat_s(snapshot_s),
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S)
    return jax


def _heartbeat_s(snapshot_s: float) -> int:
    return HEARTBEAT_TIMEOUT_S + math.ceil(snapshot_s)


class _Service:
    """JAX's coordination service in a process of its own (``worker.jax_service``), started by
    the chief so that it outlives the chief's death: the other processes then live on, and the
    one the controller asks saves the group's state in the chief's place. A child of the
    chief's task, in its process group: stopping the task stops it. It ends when the chief
    writes a line to its stdin (``shutdown``, ``end``); with its stdin closed without one (the
    chief died) it serves on for the survivors' heartbeat timeout."""

    def __init__(self, process: subprocess.Popen[bytes], bind: str) -> None:
        self.process, self.bind = process, bind

    @classmethod
    def start(cls, processes: Processes, snapshot_s: float) -> _Service:
        port = processes.coordinator.rsplit(":", 1)[1]
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", f"[::]:{port}")  # as JAX binds
        beat = str(_heartbeat_s(snapshot_s))  # also its grace once the chief is gone
        argv = [sys.executable, "-m", "worker.jax_service", bind, str(processes.count), beat,
                str(SHUTDOWN_TIMEOUT_S), beat]
        return cls(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE), bind)

    def await_serving(self, limit_s: float = COORDINATOR_WAIT_S) -> None:
        """Until the service says it serves (at most ``limit_s``; then JAX's own wait goes
        on). One that exits first could not bind its port: that is raised, where JAX would
        wait for a service that never comes (or talk to whatever holds the port)."""
        import select

        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], limit_s)
        if ready and not stdout.readline():
            code = self.process.wait()
            raise RuntimeError(
                f"JAX's coordination service (worker.jax_service) exited with {code} before it "
                f"served on {self.bind}: is the port taken? (`orchestrate doctor` names what "
                "holds a task's port; move the spec's `ports: {start, end}` to free ones)")

    @contextlib.contextmanager
    def in_place_of_jaxs(self) -> Iterator[None]:
        """While ``jax.distributed.initialize`` runs in the chief: the service it would start
        in this process is this one (``jax._src.distributed``'s ``_jax`` is replaced for that
        call alone); JAX's ``shutdown`` calls ``shutdown`` here after its client's."""
        from jax._src import distributed

        real, service = distributed._jax, self  # type: ignore[attr-defined]

        class Ours:
            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

            @staticmethod
            def get_distributed_runtime_service(*args: Any, **options: Any) -> Any:
                return service

        distributed._jax = Ours()  # type: ignore[attr-defined]
        try:
            yield
        finally:
            distributed._jax = real  # type: ignore[attr-defined]

    def end(self) -> None:
        """Tell the service to end now (the processes are leaving)."""
        stdin = self.process.stdin
        if stdin is not None and not stdin.closed:
            with contextlib.suppress(OSError):
                stdin.write(b"end\n")
                stdin.close()

    def shutdown(self) -> None:
        """At JAX's shutdown, once every process has left its barrier (the chief's client
        shut down): end the service and wait for it."""
        self.end()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _cache_compilations(jax: Any) -> None:
    """JAX's persistent compilation cache in this user's cache directory, unless the user set
    one (JAX_COMPILATION_CACHE_DIR): a relaunch, and the next run of the same model, then
    loads the compiled steps and initializers instead of compiling them again (measured
    here: 2.2 s to build the digits model and 2.2 s to its second step without, 0.2 s and
    0.45 s with). Every compilation is kept, however fast: on a relaunch they add up."""
    if jax.config.jax_compilation_cache_dir:
        return
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    directory = os.path.join(base, "orchestrate", "jax")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError:  # a read-only home (a container's): compile every time, as without
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def _seed(keras: Any, seed: int) -> None:
    """``keras.utils.set_random_seed`` without its ``tf.random.set_seed``: that imports
    TensorFlow where it is installed (1.5 s here) for the tf.data pipelines this runtime does
    not use. The rest is what it does: Python's, NumPy's and Keras's global seed."""
    import random

    import numpy as np

    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils.rng_utils import GLOBAL_RANDOM_SEED
    except ImportError:  # another Keras layout: its own function, TensorFlow and all
        keras.utils.set_random_seed(seed)
        return
    global_state.set_global_attribute(GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    random.seed(seed)
    np.random.seed(seed)


@contextlib.contextmanager
def _tensorflow_left_out() -> Iterator[None]:
    """Keras' serializer asks whether TensorFlow is available (``module_utils.tensorflow``, a
    lazy module) before it checks a config's values for TensorFlow's types, and so imports it
    where it is installed: measured, 2.7 s before every JAX task's ``finished``, in the model's
    save. Where TensorFlow is not imported, no value can be of its types: while the model is
    saved, the lazy module says it is not available (and asks again afterwards)."""
    try:
        from keras.src.utils import module_utils

        lazy = module_utils.tensorflow
        untouched = lazy.module is None and lazy._available is None
    except (ImportError, AttributeError):  # another Keras layout: as it is
        untouched = False
    if not untouched or "tensorflow" in sys.modules:
        yield
        return
    lazy._available = False
    try:
        yield
    finally:
        if lazy.module is None:
            lazy._available = None


def _build(jax: Any, keras: Any, job: Job, processes: Processes) -> JaxTraining:
    import importlib

    if job.seed is not None:
        _seed(keras, job.seed)
    else:  # one seed agreed by every process, as keras.distribution.initialize() agrees it
        from keras.src.backend.jax.distribution_lib import initialize_rng

        initialize_rng()
    module = importlib.import_module(job.module)
    distribution = _distribution(jax, keras, job, module)
    keras.distribution.set_distribution(distribution)
    with _placed_once(jax, processes, restoring=bool(index_names(_chief_dir()))) as placed:
        training = _built(keras, job, module, distribution, processes)
        with placed.restoring():
            training.restore()
        placed.initialize_the_rest()
    placed.agree()
    emit("built", global_batch_size=training.batches.global_batch,
         learning_rate=training.learning_rate, replicas=training.replicas,
         parameters=int(training.model.count_params()))
    return training


def _chief_dir() -> str:
    """Where the chief's checkpoints are, on this task's host (or in a bucket)."""
    return join(os.environ["ORCHESTRATE_CHECKPOINT_DIR"], "chief")


def _built(keras: Any, job: Job, module: Any, distribution: Any,
           processes: Processes) -> JaxTraining:
    """The module's model, compiled and built (its variables and the optimizer's)."""
    model = getattr(module, job.model_fn)()
    _check_model(keras, model)
    # The replicas in sync: the mesh's batch axis (DataParallel's mesh is every device).
    replicas = int(distribution.device_mesh.shape[0])
    global_batch, lr = job.scaled(replicas)
    made = getattr(module, job.dataset_fn)(global_batch_size=global_batch, seed=job.seed)
    rows = _local_rows(distribution, global_batch)
    batches: Batches | DatasetBatches = (
        DatasetBatches.of(made, global_batch, rows, job) if _is_tf_dataset(made)
        else Batches.of(made, global_batch, rows, job))
    model.compile(
        optimizer=keras.optimizers.get({"class_name": job.optimizer,
                                        "config": {"learning_rate": lr}}),
        loss=job.loss, metrics=list(job.metrics))
    return JaxTraining(job, model, batches, processes, learning_rate=lr, replicas=replicas)


class _Placement:
    """What ``_placed_once`` put on the devices (a digest of every value, in order), and the
    variables whose initializers wait for the restore."""

    def __init__(self, processes: Processes) -> None:
        import hashlib

        self.processes = processes
        self.digest = hashlib.sha256()
        self.count = 0
        self.deferred: dict[int, tuple[Any, Any]] = {}  # id -> (variable, its initializer)
        self.restored: set[int] = set()
        self.in_restore = False

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """While the checkpoint is restored: the variables it sets are noted."""
        self.in_restore = True
        try:
            yield
        finally:
            self.in_restore = False

    def initialize_the_rest(self) -> None:
        """The deferred initializers of the variables the restore did not set (a metric's
        counts, say): run now, as they would have run at the build (a Keras initializer's
        seed is fixed when it is made, so its values do not depend on when it runs)."""
        from keras import initializers

        for key, (variable, initializer) in self.deferred.items():
            if key not in self.restored and not isinstance(initializer, initializers.Zeros):
                variable.assign(initializer(variable.shape, dtype=variable.dtype))
        self.deferred.clear()

    def agree(self) -> None:
        """One collective: every process placed the same values, or a BuildError."""
        if self.processes.count < 2:
            return
        import numpy as np
        from jax.experimental import multihost_utils

        mine = np.frombuffer(self.digest.digest(), dtype=np.uint8)
        every = np.asarray(multihost_utils.process_allgather(mine))
        differ = [i for i in range(len(every)) if not np.array_equal(every[i], every[0])]
        if differ:
            raise BuildError(
                f"the model's {self.count} initial values (its weights, the optimizer's, the "
                f"checkpoint restored) are not the same in process(es) "
                f"{', '.join(map(str, differ))} as in process 0: build_model() and what it calls "
                "must make the same weights in every process; draw random numbers from Keras "
                "(seeded by the runtime, job.seed), not from an unseeded NumPy or Python random")


@contextlib.contextmanager
def _placed_once(jax: Any, processes: Processes, *, restoring: bool) -> Iterator[_Placement]:
    """While the model is built and restored, each variable's value goes to the devices of every
    process without JAX's check that it is the same in each (``device_put`` makes one
    allgather per variable, measured at 1.1 s of a 2-process relaunch's build of the digits
    model); the values are hashed instead, and ``_Placement.agree`` makes that check once for
    all of them. A value that is a traced one, a global array already, or bound for this
    process's devices only goes through Keras's own ``distribute_tensor`` as before.

    ``restoring`` (a checkpoint is there): the variables start as zeros and their initializers
    wait (``_Placement.initialize_the_rest``): the restore sets their values anyway. Running
    them costs their compilation, on CPU at every start in a process other than JAX's process
    0 (JAX writes its persistent cache from process 0 only, and on CPU the key holds the
    device: 0.9 s of the digits model's relaunch), and on a large model their time on the
    devices."""
    import numpy as np
    from keras.src.backend.jax import core, distribution_lib
    from keras.src.utils import jax_utils

    placement = _Placement(processes)
    original = distribution_lib.distribute_tensor
    variable_class = core.Variable
    own = {name: variable_class.__dict__.get(name)
           for name in ("_initialize_with_initializer", "_direct_assign")}
    initialize, assign = variable_class._initialize_with_initializer, variable_class._direct_assign

    def initialize_later(variable: Any, initializer: Any) -> None:
        if variable._shape is None or any(d is None for d in variable._shape):
            initialize(variable, initializer)
            return
        placement.deferred[id(variable)] = (variable, initializer)
        dtype = jax.dtypes.canonicalize_dtype(jax.numpy.dtype(variable._dtype))
        variable._initialize(np.zeros(variable._shape, dtype=dtype))
        if isinstance(variable._value, np.ndarray):  # no layout: not placed by ``distribute``
            variable._value = variable._convert_to_tensor(variable._value)

    def assign_noted(variable: Any, value: Any) -> None:
        if placement.in_restore:
            placement.restored.add(id(variable))
        assign(variable, value)

    def distribute(tensor: Any, layout: Any) -> Any:
        sharding = getattr(layout, "backend_layout", layout)
        host = isinstance(tensor, np.ndarray) or (
            isinstance(tensor, jax.Array) and not jax_utils.is_in_jax_tracing_scope(tensor)
            and tensor.is_fully_addressable and not getattr(tensor, "_committed", True))
        if not host or not isinstance(sharding, jax.sharding.Sharding) or \
                sharding.is_fully_addressable:
            return original(tensor, layout)
        value = np.asarray(tensor)
        placement.digest.update(f"{value.dtype.str}{value.shape}".encode())
        placement.digest.update(np.ascontiguousarray(value).data)
        placement.count += 1
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    distribution_lib.distribute_tensor = distribute
    if restoring:
        variable_class._initialize_with_initializer = initialize_later
        variable_class._direct_assign = assign_noted
    try:
        yield placement
    finally:
        distribution_lib.distribute_tensor = original
        for name, method in own.items():
            if method is None:
                with contextlib.suppress(AttributeError):
                    delattr(variable_class, name)
            else:
                setattr(variable_class, name, method)


def _reporter(training: JaxTraining) -> Any:
    """A Keras callback that hands every step's and epoch's end to ``training``."""
    import keras

    class Reporter(keras.callbacks.Callback):  # type: ignore[misc]
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if training._profile is not None:
                training._profile.before(training.step)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            training.after_step(logs or {})

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            training.after_epoch(epoch, logs or {})

    return Reporter()


def _distribution(jax: Any, keras: Any, job: Job, module: Any) -> Any:
    """Keras's DataParallel over every device, or its ModelParallel over ``job.mesh`` with the
    module's layout map; a BuildError where the mesh or the layout map cannot be."""
    if job.distribution != "model_parallel" or not job.mesh:
        return keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
    batch, model = job.mesh
    if batch * model != jax.device_count():
        raise BuildError(
            f"job.mesh is [{batch}, {model}], {batch * model} device(s), and the tasks have "
            f"{jax.device_count()} ({jax.local_device_count()} in this one): set job.mesh so "
            "that BATCH x MODEL is every device of every task")
    make = getattr(module, job.layout_map_fn, None)
    if not callable(make):
        raise BuildError(
            f"{job.module} has no function {job.layout_map_fn}(): job.distribution is "
            "model_parallel, which needs one that takes the keras.distribution.DeviceMesh and "
            "returns a keras.distribution.LayoutMap (or set job.layout_map_fn to its name)")
    mesh = keras.distribution.DeviceMesh(shape=(batch, model), axis_names=("batch", "model"),
                                         devices=jax.devices())
    layout_map = make(mesh)
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise BuildError(
            f"{job.layout_map_fn}() returned {type(layout_map).__module__}."
            f"{type(layout_map).__qualname__}: return a keras.distribution.LayoutMap of the "
            "mesh it is given, e.g. layout_map['dense.*kernel'] = (None, 'model')")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch",
                                            auto_shard_dataset=False)


def _local_rows(distribution: Any, global_batch: int) -> tuple[int, int]:
    """The rows of every global batch that this process's devices hold (from, to): its part
    of the batch axis (all of them where the batch axis is 1, as in a model-only mesh)."""
    sharding = distribution.get_data_layout((global_batch,)).backend_layout
    spans = [index[0] for index in sharding.addressable_devices_indices_map(
        (global_batch,)).values()]
    return (min(s.start or 0 for s in spans),
            max(global_batch if s.stop is None else s.stop for s in spans))


def _check_model(keras: Any, model: Any) -> None:
    received = f"{type(model).__module__}.{type(model).__qualname__}"
    if not isinstance(model, keras.Model):
        raise BuildError(
            f"build_model() returned {received}, not a Keras 3 model: on job.backend jax, build "
            "it with keras (import keras; not tf.keras or tf_keras, which are TensorFlow's) and "
            "return it uncompiled")
    if model.compiled:
        raise BuildError(
            f"build_model() returned a compiled model ({received}): the runtime compiles it "
            "with job.optimizer, job.loss and job.metrics; return it uncompiled (remove the "
            "model.compile call)")


class Batches:
    """Every process's part of every global batch, by global step.

    The examples are shuffled once per pass (a seeded permutation of pass ``k``), cut into
    global batches (the remainder dropped), and pass after pass follow: the examples of global
    step ``s`` depend on the seed and ``s`` only. A process takes the rows of each global batch
    that its devices hold in the global array (``_local_rows``).
    """

    def __init__(self, features: Any, labels: Any, global_batch: int, rows: tuple[int, int],
                 seed: int) -> None:
        import numpy as np

        self.np, self.features, self.labels = np, features, labels
        self.global_batch, self.seed = global_batch, seed
        self.offset, self.local = rows[0], rows[1] - rows[0]
        self.per_pass = len(features) // global_batch
        self._pass: tuple[int, Any] | None = None

    @classmethod
    def of(cls, made: Any, global_batch: int, rows: tuple[int, int], job: Job) -> Batches:
        import numpy as np

        if not (isinstance(made, tuple) and len(made) == 2
                and all(isinstance(a, np.ndarray) for a in made)):
            raise BuildError(
                f"{job.dataset_fn}() returned {type(made).__module__}.{type(made).__qualname__}"
                ": on job.backend jax, return a tuple (features, labels) of NumPy arrays (the "
                "runtime shuffles them and gives each process its part of every global batch) "
                "or a tf.data.Dataset of (features, labels) global batches")
        features, labels = made
        if len(features) != len(labels):
            raise BuildError(
                f"{job.dataset_fn}() returned {len(features)} features and {len(labels)} "
                "labels: return as many of each")
        if len(features) < global_batch:
            raise BuildError(
                f"{job.dataset_fn}() returned {len(features)} examples, fewer than one global "
                f"batch of {global_batch}: lower job.per_replica_batch_size or give more data")
        seed = 0 if job.seed is None else job.seed
        return cls(features, labels, global_batch, rows, seed)

    def first_local(self) -> tuple[Any, Any]:
        return self.local_batch(0)

    def from_step(self, step: int) -> Iterator[tuple[Any, Any]]:
        """This process's part of every global batch from global step ``step`` on."""
        while True:
            yield self.local_batch(step)
            step += 1

    def local_batch(self, step: int) -> tuple[Any, Any]:
        """This process's part of global step ``step`` (counted from 0)."""
        number, index = divmod(step, self.per_pass)
        if self._pass is None or self._pass[0] != number:
            order = self.np.random.default_rng([self.seed, number]).permutation(
                len(self.features))
            self._pass = (number, order)
        start = index * self.global_batch + self.offset
        rows = self._pass[1][start:start + self.local]
        return self.features[rows], self.labels[rows]


def _is_tf_dataset(made: Any) -> bool:
    """A ``tf.data.Dataset`` (told by its type's module: TensorFlow is not imported for it)."""
    return any(c.__module__.startswith("tensorflow.") and c.__name__ == "DatasetV2"
               for c in type(made).__mro__)


class DatasetBatches:
    """Every process's part of every global batch, from the module's ``tf.data.Dataset`` of
    global batches (as it gives MultiWorkerMirroredStrategy on TensorFlow): each process reads
    the whole pipeline and keeps the rows its devices hold. A resume at step ``s`` skips the
    first ``s`` batches, as the TensorFlow runtimes do, so a deterministic pipeline (a seeded
    shuffle, ``job.deterministic``) gives a resumed run what it gave an unbroken one.
    TensorFlow runs on the CPU only here: its GPUs are JAX's."""

    def __init__(self, dataset: Any, global_batch: int, rows: tuple[int, int]) -> None:
        self.dataset, self.global_batch = dataset, global_batch
        self.offset, self.local = rows

    @classmethod
    def of(cls, dataset: Any, global_batch: int, rows: tuple[int, int],
           job: Job) -> DatasetBatches:
        import tensorflow as tf

        with contextlib.suppress(RuntimeError):  # its devices were set up already
            tf.config.set_visible_devices([], "GPU")
        made = cls(dataset, global_batch, rows)
        spec = dataset.element_spec
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise BuildError(
                f"{job.dataset_fn}() returned a tf.data.Dataset of {spec}: on job.backend jax, "
                "make its elements (features, labels) global batches")
        first, _ = next(dataset.take(1).as_numpy_iterator())
        import jax

        sizes = {len(a) for a in jax.tree_util.tree_leaves(first)}
        if sizes != {global_batch}:
            raise BuildError(
                f"{job.dataset_fn}() returned batches of {sorted(sizes)} examples, not the "
                f"global batch of {global_batch}: batch the dataset by global_batch_size with "
                "drop_remainder=True")
        return made

    def first_local(self) -> tuple[Any, Any]:
        return next(self.from_step(0))

    def from_step(self, step: int) -> Iterator[tuple[Any, Any]]:
        import jax

        end = self.offset + self.local
        for features, labels in self.dataset.skip(step).as_numpy_iterator():
            yield jax.tree_util.tree_map(lambda a: a[self.offset:end], (features, labels))


class JaxTraining:
    """The compiled model, trained with ``fit`` on global batches, and its checkpoints."""

    def __init__(self, job: Job, model: Any, batches: Batches | DatasetBatches,
                 processes: Processes, *,
                 learning_rate: float, replicas: int) -> None:
        self.job, self.model = job, model
        self.batches, self.processes = batches, processes
        self.learning_rate, self.replicas = learning_rate, replicas
        self.chief_dir = _chief_dir()
        self.signalled = False
        # Built before a restore: the optimizer's variables exist only once it is.
        if not model.built:  # a functional model, or one given its keras.Input, is already
            features, _ = batches.first_local()
            model.build(features.shape)
        model.optimizer.build(model.trainable_variables)
        self.step = self.saved_step = 0
        # The snapshot after a crash: the newest state whose step this process completed (its
        # step, and the trainer's state lists), and the lock that makes one save of it, from
        # the main thread after a step failed or from the request's thread while one hangs.
        self.snapshots = job.snapshot_on_crash
        self.service: _Service | None = None  # the chief's coordination service, if its own
        self._completed: tuple[int, dict[str, list[Any]]] | None = None
        self._snapshot_lock = threading.Lock()
        self._saving = False  # the main thread writes a checkpoint (a collective)
        self._snapshot_taken = False

    def restore(self) -> None:
        """From the chief's newest checkpoint, where there is one."""
        self.step = self.saved_step = self._restore()

    # -- checkpoints -------------------------------------------------------------------------

    def _restore(self) -> int:
        """The chief's newest checkpoint restored on every process; the step it resumes at."""
        names = index_names(self.chief_dir)
        if not names:
            return 0
        import numpy as np

        path = join(self.chief_dir, names[-1])
        self.model.load_weights(path + WEIGHTS)  # Keras reads a gs:// URL through gfile
        with np.load(io.BytesIO(read_bytes(path + STATE))) as state:
            by_path = {v.path: v for v in self.model.non_trainable_variables}
            for key in state.files:
                if key in by_path:
                    by_path[key].assign(state[key])
            return int(state[STEP_KEY])

    def save(self, reason: str | None = None) -> None:
        """A checkpoint of this step. Every process saves (a save is a collective); the chief's
        goes to its directory and is named in the index, the others' are written to a scratch
        directory and removed."""
        with self._snapshot_lock:
            if self._snapshot_taken:  # the request's thread saved this process's state
                raise RuntimeError("a snapshot of this process's state was saved: the attempt ends")
            self._saving = True
        try:
            self._save(reason)
        finally:
            self._saving = False

    def _save(self, reason: str | None) -> None:
        self.model.jax_state_sync()  # inside fit, the newest state is the trainer's, not yet the model's
        if not self.processes.chief:
            directory = tempfile.mkdtemp(prefix="orchestrate-ckpt-")
            try:
                self._write(directory, self.step, gather=True)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            self.saved_step = self.step
            return
        self._write(self.chief_dir, self.step, gather=True)
        self.saved_step = self.step
        emit("checkpoint", step=self.step, epoch=self._epoch(self.step), path=self.chief_dir,
             **({"reason": reason} if reason else {}))

    def _write(self, directory: str, step: int, *, gather: bool) -> None:
        """The model's variables as checkpoint ``ckpt-STEP`` in ``directory``, named last in its
        index there (for the chief's). ``gather``: split variables are gathered from every
        process (a collective); else only this process's memory is read."""
        import numpy as np

        makedirs(directory)
        name = f"ckpt-{step}"
        path = join(directory, name)
        with _gathering() if gather else _alone():
            self.model.save_weights(path + WEIGHTS)  # a gs:// URL: Keras uploads it with gfile
        state: dict[str, Any] = {v.path: to_host(v.value)
                                 for v in self.model.non_trainable_variables}
        state[STEP_KEY] = np.asarray(step)
        buffer = io.BytesIO()
        np.savez(buffer, **state)
        write_bytes(path + STATE, buffer.getvalue())
        if directory == self.chief_dir:
            kept = [n for n in index_names(directory) if n != name][-(KEEP - 1):]
            write_index(directory, [*kept, name])

    # -- the snapshot after a crash ----------------------------------------------------------

    def completed(self, state: dict[str, list[Any]]) -> None:
        """After step ``self.step`` was dispatched (its new ``state``): wait for its result.
        A step that failed raises here (its collective lost a peer); one that completed becomes
        the state a snapshot saves, and the one before it is let go."""
        import jax
        import numpy as np

        values = [value for values in state.values() for value in values or ()]
        jax.block_until_ready(values)
        # A step that failed leaves every result an error, which block_until_ready does not
        # raise (measured: jax 0.10.2, gloo): reading one raises it. The smallest is read.
        if values:
            np.asarray(min(values, key=lambda value: value.size))
        with self._snapshot_lock:  # a snapshot being saved meanwhile ends first
            pass
        self._completed = (self.step, state)

    def snapshot_once(self) -> None:
        """Save the snapshot (``save_snapshot`` reports it), unless one was saved already or
        the main thread writes a checkpoint (its own, of the same step: a request's thread
        then saves nothing)."""
        with self._snapshot_lock:
            if self._snapshot_taken or self._saving:
                return
            self._snapshot_taken = True
            save_snapshot(self.snapshot, self.chief_dir)

    def snapshot(self) -> tuple[int, int]:
        """The state of the last step this process completed, written as an ordinary checkpoint
        in the chief's directory (on this process's host: a worker saves in a dead chief's
        place) from this process's memory alone (no collective: a peer is gone); (step,
        epoch). Call under the snapshot lock."""
        if self.job.distribution != "data_parallel":
            raise SnapshotRefused(
                "the variables are split over the processes (job.distribution: "
                f"{self.job.distribution}): a survivor holds only its part of them")
        if self._completed is None:
            raise SnapshotRefused("no step had completed in this attempt")
        step, state = self._completed
        epoch = self._epoch(step)
        if step == self.saved_step and self.processes.chief:  # that checkpoint is there already
            return step, epoch
        model = self.model
        for variables, key in ((model.trainable_variables, "trainable_variables"),
                               (model.non_trainable_variables, "non_trainable_variables"),
                               (model.optimizer.variables, "optimizer_variables"),
                               (model.metrics_variables, "metrics_variables")):
            for variable, value in zip(variables, state.get(key) or (), strict=False):
                variable._value = value  # no assign: that may place the value, a collective
        self._write(self.chief_dir, step, gather=False)
        self.saved_step = step
        return step, epoch

    def _watch_for_the_request(self) -> None:
        """Once the controller asks this task for the snapshot (``when_asked``), save it from
        that thread: a step that waits on a peer that is gone (a host cut off; of 3 or more
        processes, a neighbour in the ring whose own step waits on the dead one) neither
        completes nor fails. The main thread meanwhile never reads the model's variables but
        at an epoch's end, where it sets them to the same state."""
        when_asked(self.snapshot_once)

    def save_model(self) -> str:
        """Every process saves the model (a collective); only the chief's is kept."""
        with _gathering(), _tensorflow_left_out():
            return save_model(self.processes.chief, self.model.save)

    def weights_digest(self) -> str:
        """Of every weight, whole (gathered from every process where it is split: a collective)."""
        return weights_digest(to_host(weight.value) for weight in self.model.weights)

    # -- training ----------------------------------------------------------------------------

    def fit(self) -> tuple[dict[str, float], int]:
        """Keras's own ``fit`` on JAX, which keeps the state on the devices between steps; a
        callback reports, checkpoints and stops. ``train_on_batch`` would cost 4 collectives a
        step more: resetting the metrics puts host zeros on every process's devices, which
        JAX checks are equal across processes (measured: 3 ms a step on 1 process, 50 ms on 2).

        A run resumed mid-epoch first fits the rest of that epoch, then the epochs after it."""
        job = self.job
        self._take_sigterm()
        emit("resumed" if self.step else "training", step=self.step, total_steps=job.total_steps)
        self._mark = (time.monotonic(), self.step)
        self._logs: dict[str, float] = {}
        self._board = Board.from_env(self.processes.chief)
        self._profile = Profile.from_env(self.processes.chief, "jax")
        # Read here: inside fit the optimizer's variables live in the trainer's state, not
        # readable between its syncs. The runtime compiles a constant rate (job.learning_rate).
        self._rate = learning_rate(self.model.optimizer)
        if self._board is not None:
            self._board.begin(self.step)
        if self._keeps_snapshots:
            self._watch_for_the_request()
        callback = _reporter(self)
        batches = self.batches.from_step(self.step)
        epoch, done = divmod(self.step, job.steps_per_epoch)
        try:
            if done:
                self._fit(batches, callback, epochs=epoch + 1, initial_epoch=epoch,
                          steps=job.steps_per_epoch - done)
                epoch += 1
            if epoch < job.epochs:
                self._fit(batches, callback, epochs=job.epochs, initial_epoch=epoch,
                          steps=job.steps_per_epoch)
        finally:
            self._close_board()
        if self._profile is not None:
            self._profile.close()
        if self.saved_step != self.step:  # the end is a checkpoint: a failure after it costs
            self.save()                   # no step (the relaunch goes straight to the save)
        return self._logs, self.step

    def _close_board(self) -> None:
        """The TensorBoard log closed (in a bucket: uploaded whole), not left to the garbage
        collector at exit, which never runs for what a thread still holds (the request's)."""
        if self._board is not None:
            self._board.close()

    def _fit(self, batches: Any, callback: Any, *, epochs: int, initial_epoch: int,
             steps: int) -> None:
        """``fit`` on exactly the batches it trains on, taken from ``batches``: Keras 3.15's
        fit of one epoch of one step takes two batches from a generator and trains on one
        (measured), so a run resumed at the last step but one of an epoch trained every later
        step on the batch after its own, and ended with other weights than an unbroken run."""
        take = steps * (epochs - initial_epoch)
        bounded = (batch for batch in itertools.islice(batches, take))
        with _keeping_the_input_state() if self._keeps_snapshots else contextlib.nullcontext():
            self.model.fit(bounded, epochs=epochs, initial_epoch=initial_epoch,
                           steps_per_epoch=steps, callbacks=[callback], verbose=0)

    @property
    def _keeps_snapshots(self) -> bool:
        """Whether every step's state is kept for a snapshot: data parallelism only (split
        variables would be a survivor's part alone: ``snapshot`` refuses)."""
        return self.snapshots and self.job.distribution == "data_parallel"

    def after_step(self, logs: dict[str, Any]) -> None:
        """What follows every step: a stop the group agreed on, a checkpoint, a progress event.
        ``logs`` are the loss and metrics over the epoch so far."""
        from jax.experimental import multihost_utils

        job = self.job
        self.step += 1
        if self._keeps_snapshots:
            self.completed(self.model._jax_state)
        if self._profile is not None:
            self._profile.after(self.step)
        if self.step < job.total_steps and \
                multihost_utils.reached_preemption_sync_point(self.step):
            self._stop()
        if self.step % job.checkpoint_every_steps == 0:
            self.save()
        plot = self._board is not None and self._board.due(self.step, job.total_steps)
        report = self.step % job.progress_every_steps == 0 or self.step == job.total_steps
        if plot or report:
            means = {k: float(v) for k, v in logs.items()}
            if plot and self._board is not None:
                self._board.scalars(self.step, means, self.batches.global_batch, self._rate)
            if report:
                self._progress(means)

    def after_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        self._logs = {k: float(v) for k, v in logs.items()}
        emit("epoch", epoch=epoch, logs=self._logs)

    def _progress(self, means: dict[str, float]) -> None:
        self._mark = emit_progress(self.step, self.job.total_steps, means,
                                   self.batches.global_batch, self._mark)

    def _epoch(self, step: int) -> int:
        """The epoch that ``step`` (the steps done) ends in."""
        return max(step - 1, 0) // self.job.steps_per_epoch

    # -- SIGTERM -----------------------------------------------------------------------------

    def _take_sigterm(self) -> None:
        """SIGTERM to this process tells JAX's preemption service, which agrees a step with every
        process (replacing JAX's own C++ notifier, which would do the same without a word)."""
        from jax._src import distributed

        client: Any = distributed.global_state.client

        def on_sigterm(signum: int, frame: Any) -> None:
            self.signalled = True
            when = datetime.datetime.now(datetime.timezone.utc).isoformat()
            with contextlib.suppress(Exception):  # another process told it first
                client.key_value_set(PREEMPTION_NOTICE_KEY, when)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _stop(self) -> None:
        """The group agreed to stop at this step: save it, say so, exit."""
        self._close_board()  # exit_stopped leaves at once, without the interpreter's clean-up
        if self.saved_step != self.step:
            self.save(reason="stop")
        elif self.processes.chief:
            emit("checkpoint", step=self.step, epoch=self._epoch(self.step), path=self.chief_dir,
                 reason="stop")
        if self.service is not None:  # every process saved the agreed step and leaves
            self.service.end()
        exit_stopped(self.step, self.signalled)


@contextlib.contextmanager
def _keeping_the_input_state() -> Iterator[None]:
    """While ``fit`` makes the model's train function, make it keep its input state: Keras
    compiles it to donate the state's buffers to its result (``donate_argnums=0``), so that once
    a step is under way the state of the step before it is gone from the devices, and a step
    that fails leaves none. Kept, the last completed step's state is what a survivor saves
    after a crash; it costs one more copy of the state (weights, optimizer slots) on each
    device while a step runs."""
    from keras.src.backend.jax import trainer

    compile_with = trainer.jit

    def undonated(function: Any, **options: Any) -> Any:
        options.pop("donate_argnums", None)
        return compile_with(function, **options)

    trainer.jit = undonated
    try:
        yield
    finally:
        trainer.jit = compile_with


def to_host(value: Any) -> Any:
    """A JAX array as a NumPy array, whole: one split over other processes' devices (a
    model-parallel variable) is gathered from every process, a collective that every process
    must make at the same point; a replicated one is read here."""
    import jax
    import numpy as np

    if isinstance(value, jax.Array) and not value.is_fully_addressable \
            and not value.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


@contextlib.contextmanager
def _alone() -> Iterator[None]:
    """While one process saves by itself (a snapshot: a peer is gone), no distribution: under
    one, Keras's saving puts values on every process's devices, which JAX checks are equal
    across processes with a collective (``device_put`` -> ``multihost_utils.assert_equal``)."""
    import keras

    distribution = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(distribution)


@contextlib.contextmanager
def _gathering() -> Iterator[None]:
    """Keras's saving reads each variable with ``backend.convert_to_numpy`` (the layers') or
    ``Variable.numpy`` (the optimizer's), which cannot read an array split over other
    processes' devices (Keras 3.15: "Fetching value for jax.Array that spans non-addressable
    devices is not possible"); while saving, those are gathered (``to_host``). Every process
    saves, in the same order, so the gathers meet."""
    from keras.src import backend
    from keras.src.backend.common.variables import Variable

    convert, numpy = backend.convert_to_numpy, Variable.numpy

    def gathered(x: Any) -> Any:
        value = getattr(x, "value", x)
        if not isinstance(x, str) and hasattr(value, "is_fully_addressable"):
            return to_host(value)
        return convert(x)

    backend.convert_to_numpy = gathered
    Variable.numpy = lambda self: to_host(self.value)
    try:
        yield
    finally:
        backend.convert_to_numpy = convert
        Variable.numpy = numpy


