"""A problem a check found: what is wrong, on which hosts, and how to fix it.

Its own module, below the providers and the doctor alike: the doctor reports problems, and a
provider's own checks (a cloud's catalog) produce them before any host is asked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing that is wrong, on which hosts, and how to fix it."""

    check: str
    message: str
    fix: str
    blocking: bool = True
    hosts: tuple[str, ...] = ()
