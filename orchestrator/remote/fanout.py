"""Run one function for many hosts in parallel and keep every host's result, failures included."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from orchestrator.errors import OrchestratorError, RemoteError

T = TypeVar("T")
V = TypeVar("V")


@dataclass(frozen=True)
class HostResult(Generic[V]):
    """What ``fn`` gave for one item: its value, or the exception it raised."""

    name: str
    ok: bool
    value: V | None = None
    error: Exception | None = None


@dataclass(frozen=True)
class FanOutResult(Generic[V]):
    """Every item's result, in the order the items were given."""

    results: tuple[HostResult[V], ...]

    @property
    def succeeded(self) -> list[HostResult[V]]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> list[HostResult[V]]:
        return [r for r in self.results if not r.ok]

    def values(self) -> dict[str, V | None]:
        """Name -> value of the items that succeeded."""
        return {r.name: r.value for r in self.succeeded}

    def raise_if_failed(self, what: str) -> None:
        """Raise one RemoteError naming every failed item and its error, if any failed."""
        failed = self.failed
        if not failed:
            return
        lines = [f"{what} failed on {len(failed)} of {len(self.results)} hosts:"]
        for r in failed:
            lines.append(f"  {r.name}: " + _indent(_describe(r.name, r.error)))
        raise RemoteError("\n".join(lines)) from failed[0].error


def fan_out(
    items: Iterable[T],
    fn: Callable[[T], V],
    max_workers: int = 32,
    name_of: Callable[[T], str] = str,
) -> FanOutResult[V]:
    """Call ``fn(item)`` for every item on a thread pool; never stop at the first failure.

    Args:
        items: the things to work on (hosts, runners, ...).
        fn: the work for one item; an exception it raises is that item's result.
        max_workers: the most calls in flight at once.
        name_of: how an item is named in results and messages.

    Returns:
        One HostResult per item, in the order of ``items``.
    """
    todo = list(items)
    if not todo:
        return FanOutResult(())
    results: list[HostResult[V] | None] = [None] * len(todo)
    queue = iter(enumerate(todo))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                entry = next(queue, None)
            if entry is None:
                return
            index, item = entry
            results[index] = _call(fn, item, name_of(item))

    # Daemon threads, joined here: a Ctrl-C in the caller ends the wait at once and the process
    # can exit, instead of waiting (as a thread pool's shutdown does) for every call in flight,
    # e.g. one polling a booting VM for minutes. An interrupted notebook leaves them to finish.
    workers = [threading.Thread(target=work, daemon=True, name=f"fan-out-{i}")
               for i in range(max(1, min(max_workers, len(todo))))]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return FanOutResult(tuple(r for r in results if r is not None))


def _call(fn: Callable[[T], V], item: T, name: str) -> HostResult[V]:
    try:
        return HostResult(name, True, value=fn(item))
    except Exception as exc:
        return HostResult(name, False, error=exc)


def _describe(name: str, error: Exception | None) -> str:
    """The error as the user reads it, without repeating the host name it starts with."""
    if not isinstance(error, OrchestratorError):
        return f"{type(error).__name__}: {error}"
    text = str(error)
    return text.removeprefix(f"{name}: ")


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")
