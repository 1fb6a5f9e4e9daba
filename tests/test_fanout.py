"""fan_out: every item's result is kept, failures are collected into one message."""

from __future__ import annotations

import threading

import pytest
from hostlab import HostLab

from orchestrator.errors import HostUnreachableError, RemoteError
from orchestrator.remote.fanout import fan_out
from orchestrator.remote.ssh import SSHRunner


def test_results_keep_the_order_of_the_items_and_every_failure() -> None:
    def square_unless_odd(n: int) -> int:
        if n % 2:
            raise ValueError(f"{n} is odd")
        return n * n

    result = fan_out(range(6), square_unless_odd, name_of=lambda n: f"item{n}")
    assert [r.name for r in result.results] == [f"item{n}" for n in range(6)]
    assert result.values() == {"item0": 0, "item2": 4, "item4": 16}
    assert [r.name for r in result.failed] == ["item1", "item3", "item5"]
    assert all(isinstance(r.error, ValueError) for r in result.failed)
    with pytest.raises(RemoteError) as err:
        result.raise_if_failed("squaring")
    message = str(err.value)
    assert message.startswith("squaring failed on 3 of 6 hosts:")
    assert "item3: ValueError: 3 is odd" in message


def test_calls_run_in_parallel_up_to_max_workers() -> None:
    barrier = threading.Barrier(4, timeout=5)
    result = fan_out(range(4), lambda _: barrier.wait(), max_workers=4)
    assert len(result.succeeded) == 4
    serial = fan_out(range(3), lambda n: threading.get_ident(), max_workers=1)
    assert len({r.value for r in serial.results}) == 1


def test_nothing_to_do_is_an_empty_success() -> None:
    result = fan_out([], str)
    assert result.results == () and result.failed == []
    result.raise_if_failed("nothing")


@pytest.mark.ssh
def test_fan_out_over_ssh_hosts_collects_the_one_that_failed(hostlab: HostLab) -> None:
    hosts = hostlab.hosts(3)
    runners = [SSHRunner(h.name, h.endpoint()) for h in hosts]
    address, port = hostlab.unused_address()
    ghost = hosts[0].endpoint(address=address, port=port, connect_timeout_s=1.0)
    runners.append(SSHRunner("ghost", ghost, connect_deadline_s=2.0))
    try:
        result = fan_out(
            runners, lambda r: r.run("echo $LOGNAME").stdout.strip(), name_of=lambda r: r.host_name
        )
    finally:
        for r in runners:
            r.close()
    assert result.values() == {h.name: h.user for h in hosts}
    (failed,) = result.failed
    assert failed.name == "ghost" and isinstance(failed.error, HostUnreachableError)
    with pytest.raises(RemoteError, match="uptime failed on 1 of 4 hosts:\n  ghost: cannot"):
        result.raise_if_failed("uptime")
