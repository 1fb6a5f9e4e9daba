"""The spec's ``secrets``: values every task gets from this controller's environment at launch.

Only the names are in the spec. The values are read when a run starts and go to the tasks'
environment through the launch script's stdin (``Runner.start``), never a command line that
``ps`` shows; they are not in the state store, ``plan``, ``status`` or an error message, and a
value a task prints is replaced by ``<secret NAME>`` in what the store keeps of its output.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orchestrator.errors import SpecError
from orchestrator.spec import MAX_ENV_VALUE_BYTES, ClusterSpec

MIN_REDACTED = 4  # a shorter value would blank out ordinary words of the output


def resolve(spec: ClusterSpec, spec_path: str | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The secrets' values from ``environ`` (this process's environment).

    Raises:
        SpecError: a secret is not set here, or too large for a launch.
    """
    environ = os.environ if environ is None else environ
    missing = [name for name in spec.secrets if name not in environ]
    if missing:
        raise SpecError(
            f"{', '.join(missing)} not set in the environment of this controller",
            file=spec_path, field="secrets",
            fix=f"export {missing[0]}=... in the shell that runs orchestrate (the tasks get "
                "its value at launch), or remove it from secrets")
    large = [name for name in spec.secrets if len(environ[name].encode()) > MAX_ENV_VALUE_BYTES]
    if large:
        raise SpecError(
            f"{', '.join(large)}: the value is over {MAX_ENV_VALUE_BYTES // 1024} KiB",
            file=spec_path, field="secrets",
            fix="pass large data in a file under workdir, and its path here")
    return {name: environ[name] for name in spec.secrets}


def redact(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every secret value (of at least MIN_REDACTED characters) replaced by
    ``<secret NAME>``, longest first (one value may contain another)."""
    for name, value in sorted(values.items(), key=lambda item: -len(item[1])):
        if len(value) >= MIN_REDACTED:
            text = text.replace(value, f"<secret {name}>")
    return text
