"""A run's history of the chief's progress, kept in the store bounded and evenly thinned, for
the charts of ``status`` and ``status --plot`` and for ``status --json``."""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.events import Event
from orchestrator.state import Point, Store

MAX_POINTS = 1000  # a run's points at most: a chart is a few hundred columns wide
FLUSH_S = 5.0  # how often new points are written (one transaction), besides at an attempt's end
CLOCK_SKEW_S = 30.0  # a host's clock further from this machine's is not used for the time axis


class History:
    """The run's points, as the supervisor records them from the chief's progress events.

    The n-th progress event is kept when n is a multiple of ``stride``; when the points pass
    ``limit``, those off the doubled stride are dropped, so a run of any length keeps between
    half and all of ``limit``, spread evenly over its steps. The first point of each attempt is
    never dropped (where it resumed), nor the newest (how far it got, should it end now).
    Points are written every ``FLUSH_S`` and by ``flush``.
    """

    def __init__(self, store: Store, run_id: str, *, limit: int = MAX_POINTS,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.run_id = run_id
        self.limit = limit
        self.clock = clock
        # (n, point); a run taken over or resumed goes on with its own points
        self._kept = list(enumerate(store.points(run_id)))
        self._n = len(self._kept)
        self.stride = 1
        self._added: dict[tuple[int, int], Point] = {}
        self._dropped: list[tuple[int, int]] = []
        self._flushed_at = clock()
        while len(self._kept) > self.limit:
            self._thin()

    @property
    def points(self) -> list[Point]:
        return [point for _, point in self._kept]

    def add(self, attempt: int, event: Event) -> None:
        """The chief's ``progress`` event of ``attempt``."""
        metrics = event.get("metrics") or {}
        point = Point(attempt, int(event.get("step", 0)), self._when(event), event.get("loss"),
                      event.get("steps_per_s"), event.get("examples_per_s"), dict(metrics))
        if self._kept and point.key <= self._kept[-1][1].key:
            return  # a step it has (a log read again after a take-over)
        if self._kept and self._kept[-1][1].attempt == attempt and \
                not self._wanted(len(self._kept) - 1):
            self._drop(self._kept.pop()[1])  # the newest, off the stride: this one is newer
        self._kept.append((self._n, point))
        self._n += 1
        self._added[point.key] = point
        if len(self._kept) > self.limit:
            self._thin()
        if self.clock() - self._flushed_at >= FLUSH_S:
            self.flush()

    def _when(self, event: Event) -> float:
        """When the chief reported the step: its own clock (this machine reads the logs in
        batches, a poll apart), unless that clock is not within ``CLOCK_SKEW_S`` of this
        machine's and after the previous point: then the time it was read here."""
        now = self.clock()
        after = self._kept[-1][1].at if self._kept else 0.0
        if after <= event.time and abs(event.time - now) <= CLOCK_SKEW_S:
            return event.time
        return max(now, after)

    def flush(self) -> None:
        """Write what changed since the last flush."""
        self._flushed_at = self.clock()
        if self._added or self._dropped:
            added, dropped, self._added, self._dropped = self._added, self._dropped, {}, []
            self.store.change_points(self.run_id, list(added.values()), dropped)

    def _wanted(self, index: int) -> bool:
        """Whether the point at ``index`` stays when another comes after it: on the stride, or
        the first of its attempt, or the last of one."""
        n, point = self._kept[index]
        before = self._kept[index - 1][1] if index else None
        return n % self.stride == 0 or before is None or before.attempt != point.attempt

    def _thin(self) -> None:
        self.stride *= 2
        last = len(self._kept) - 1
        kept = []
        for index, (n, point) in enumerate(self._kept):
            last_of_attempt = index == last or self._kept[index + 1][1].attempt != point.attempt
            if last_of_attempt or self._wanted(index):
                kept.append((n, point))
            else:
                self._drop(point)
        self._kept = kept

    def _drop(self, point: Point) -> None:
        if self._added.pop(point.key, None) is None:
            self._dropped.append(point.key)
