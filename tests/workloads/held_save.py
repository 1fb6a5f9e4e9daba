"""A workload whose worker:1 waits before it saves the final model, so that a test can kill it
after the last step: the module named by ``HELD_SAVE_OF`` (a paced digits workload), with the
model's ``save`` held on worker:1 until the run's ``release`` file exists (see
``tests.workloads.pace``). While it waits, the run's directory holds ``held``, with its pid."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

_base = importlib.import_module(os.environ.get("HELD_SAVE_OF", "tests.workloads.paced_digits"))
make_dataset = _base.make_dataset

__all__ = ["build_model", "make_dataset"]


def build_model() -> Any:
    model = _base.build_model()
    save = model.save

    def held(path: str, *args: Any, **kwargs: Any) -> Any:
        run = Path(os.environ["ORCHESTRATE_CHECKPOINT_DIR"]).parent
        if os.environ.get("ORCHESTRATE_TASK") == "worker:1" and not (run / "release").exists():
            (run / "held.tmp").write_text(str(os.getpid()))
            (run / "held.tmp").rename(run / "held")
            deadline = time.monotonic() + 300
            while not (run / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return save(path, *args, **kwargs)

    model.save = held
    return model
