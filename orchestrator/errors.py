"""One error hierarchy: every message says what failed, what was received, and what to try."""

from __future__ import annotations


class OrchestratorError(Exception):
    """Base of every error the controller raises on purpose.

    The CLI prints ``str(err)`` without a traceback; ``fix`` is the advice line.
    """

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        if self.fix:
            return f"{self.message}\n  fix: {self.fix}"
        return self.message


class SpecError(OrchestratorError):
    """A cluster spec file that cannot be used: names the file, the field path and the fix."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        field: str | None = None,
        line: int | None = None,
        fix: str | None = None,
    ) -> None:
        where = file or "<spec>"
        if line is not None:
            where = f"{where}:{line}"
        prefix = f"{where}: {field}: " if field else f"{where}: "
        super().__init__(prefix + message, fix=fix)
        self.file = file
        self.field = field
        self.line = line


class PlanError(OrchestratorError):
    """Spec and hosts that cannot form a working cluster."""


class StateError(OrchestratorError):
    """The state store is unreadable, or names something that does not exist."""


class ProviderError(OrchestratorError):
    """Hosts could not be created, found or repaired."""


class RemoteError(OrchestratorError):
    """A command or file transfer on a host failed."""

    def __init__(self, message: str, *, host: str | None = None, fix: str | None = None) -> None:
        super().__init__(f"{host}: {message}" if host else message, fix=fix)
        self.host = host


class HostUnreachableError(RemoteError):
    """No connection could be made to a host within its timeout."""


class HostKeyError(RemoteError):
    """A host presented an unknown or changed SSH host key."""


class AuthError(RemoteError):
    """The host refused our SSH credentials."""


class CommandError(RemoteError):
    """A command on a host exited non-zero; carries the command, exit code and output tail."""

    def __init__(
        self, host: str, command: str, exit_code: int, output: str, *, fix: str | None = None
    ) -> None:
        tail = "\n".join(output.strip().splitlines()[-20:])
        message = f"command exited {exit_code}: {command}"
        if tail:
            message += "\n" + "\n".join("    " + line for line in tail.splitlines())
        super().__init__(message, host=host, fix=fix)
        self.command = command
        self.exit_code = exit_code
        self.output = output


class RunFailed(OrchestratorError):
    """A training run ended without success after its retry budget; carries the report."""

    def __init__(self, message: str, *, run_id: str, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.run_id = run_id
