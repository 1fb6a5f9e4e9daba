"""Every benchmark runs in --quick mode and prints one JSON line of figures, so none of them rots.

No figure is compared with anything: the machines are noisy, and benchmarks report, tests check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
COMMON_KEYS = {"benchmark", "mode", "repeats", "machine", "wall_s"}


def measured(figure: dict[str, Any]) -> bool:
    """A median/min/max/n spread with at least one value in it."""
    return bool(figure["n"] >= 1 and figure["min"] <= figure["median"] <= figure["max"])


def check_launch(record: dict[str, Any]) -> None:
    first = record["results"][0]
    assert (first["target"], first["workers"]) == ("local", 2)
    train = first["orchestrated"]["orchestrate train"]
    assert measured(train["first_step_s"]) and measured(first["by_hand_s"])
    assert isinstance(train["goal_met"], bool) and "namespaces" in record["skipped"]


def check_steady(record: dict[str, Any]) -> None:
    first = record["results"][0]
    assert measured(first["orchestrated_steps_per_s"]) and measured(first["by_hand_steps_per_s"])
    assert first["ratio"] > 0


def check_watching(record: dict[str, Any]) -> None:
    assert [r["tensorboard"] for r in record["results"]] == ["none", "every 100 steps",
                                                             "every step"]
    for result in record["results"]:
        assert measured(result["steps_per_s"]) and result["ratio_to_none"] > 0
        assert measured(result["controller_cpu_share"])
    assert isinstance(record["goal_met"], bool)
    assert record["write_us"] > 0 and 0 < record["write_share_of_steps"]["every step"] < 1


def check_elastic(record: dict[str, Any]) -> None:
    (run,) = record["runs"].values()  # --quick: the elastic run alone
    assert (run["sizes"], run["causes"], run["status"]) == (
        [3, 2, 3], ["host_lost", "resized"], "succeeded"), run
    # the smaller group trained (the host is back only after its first step there: on a loaded
    # machine the shrink alone can outlast the window, so the window's count may be 0)
    assert run["steps_on_fewer"] > 0 and run["steps_redone"] == 0
    assert isinstance(run["steps_in_window"], int)
    assert run["outage_s"] >= record["window_s"]
    assert run["shrink_s"] > 0 and run["back_at_full_size_s"] > 0
    assert len(run["phases"]) == 2 and all(phases for phases in run["phases"])


def check_recovery(record: dict[str, Any]) -> None:
    (worker_killed,) = record["results"]
    assert (worker_killed["case"], worker_killed["cause"]) == ("worker killed", "crashed")
    assert worker_killed["repair_s"]["n"] == 0  # a crashed process leaves no host to repair
    assert all(measured(worker_killed[p]) for p in record["phases"] if p != "repair_s")
    assert measured(worker_killed["kill_to_first_step_s"])
    # the chief's snapshot: the group resumed at the step the crash broke, not a checkpoint's
    assert worker_killed["resumed_from_a_snapshot"] == 1, worker_killed["snapshots"]
    assert worker_killed["steps_repeated"]["max"] <= 1
    assert set(record["skipped"]) == {"chief killed", "host cut off", "cold start"}


def check_peer(record: dict[str, Any]) -> None:
    ray = record["ray"]
    if "skipped" in ray:  # --quick without Ray compares nothing; launch and recovery measure ours
        assert ray["skipped"] and "orchestrate" in record["skipped"]
        return
    assert measured(ray["first_step_s"]) and measured(ray["kill_to_first_step_s"]), ray
    assert measured(record["orchestrate"]["kill_to_first_step_s"])


def check_provision(record: dict[str, Any]) -> None:
    assert [r["vms"] for r in record["results"]] == [1, 8, 64]
    assert all(measured(r["up_s"]) and r["create_calls"]["median"] >= 1 for r in record["results"])


def check_controller(record: dict[str, Any]) -> None:
    result = record["result"]
    assert result["tasks"] == 8 and result["transport"] in ("namespaces", "local")
    assert measured(result["cpu_share"]) and measured(result["latency_median_s"])
    assert result["rss_mib"]["median"] > 0 and result["events"]["median"] > 0


def check_control_path(record: dict[str, Any]) -> None:
    if "skipped" in record:  # not root: no namespace host to throttle
        assert record["skipped"]
        return
    for way in ("own connection", "one connection"):
        result = record["results"][way]
        assert measured(result["idle_poll_s"]) and measured(result["poll_s"]), way
        assert measured(result["download_s"]) and result["max_poll_of_poll_timeout"] > 0


def check_checkpoints(record: dict[str, Any]) -> None:
    if "skipped" in record:  # not root: no namespace hosts
        assert record["skipped"]
        return
    trained, by_hand = record["results"]
    assert (trained["size_mib"], by_hand["size_mib"]) == (1, 16) and "not_trained" in by_hand
    for config in ("none", "off", "on", "shared"):
        figures = trained["configs"][config]
        assert measured(figures["steps_per_s"]) and measured(figures["controller_bytes"]), config
    assert trained["configs"]["off"]["checkpoints"]["median"] >= 2
    assert trained["configs"]["on"]["product_through_controller"]["median"] > 0
    assert trained["configs"]["shared"]["product_through_controller"]["max"] >= 0
    assert set(trained["goals"]) == {"shared_moves_no_checkpoint_bytes", "mirror_keeps_0_95",
                                     "shared_keeps_0_95"}
    assert measured(by_hand["mirror_pull"]["seconds"])
    assert by_hand["mirror_pull"]["product_bytes"]["median"] >= 16 << 20
    for size in (trained, by_hand):
        for key, link in (("relaunch", "as they are"), ("relaunch_capped", "2gbit")):
            copy = size[key]
            assert copy["link"] == link
            assert copy["bytes"] > 0 and copy["hosts"] == 2 and copy["again_bytes_sent"] == 0
            assert measured(copy["chain_s"]) and measured(copy["plain_s"])
            assert measured(copy["busiest_cpu_s"]) and measured(copy["plain_busiest_cpu_s"])
        assert size["relaunch"]["goal_met"] is None  # the goal is for capped links
        assert isinstance(size["relaunch_capped"]["goal_met"], bool)


def check_keras3(record: dict[str, Any]) -> None:
    result = record["results"]
    assert measured(result["tf_keras_fit_steps_per_s"]) and measured(result["keras3_loop_steps_per_s"])
    assert result["ratio"] > 0 and isinstance(result["goal_met"], bool)
    assert all(loss is not None and loss > 0 for loss in result["final_loss"].values())


def check_warm_cost(record: dict[str, Any]) -> None:
    for figure in ("cold_first_step_s", "warm_ready_s", "idle_cpu_share", "rss_mib",
                   "go_to_first_step_s"):
        assert measured(record[figure]), figure
    assert record["rss_mib"]["median"] > 0 and record["go_over_cold"] > 0


def check_jax(record: dict[str, Any]) -> None:
    result = record["results"]
    assert measured(result["jax_steps_per_s"]) and measured(result["tensorflow_steps_per_s"])
    assert measured(result["jax_first_step_s"]) and measured(result["tensorflow_first_step_s"])
    assert all(loss is not None and loss > 0 for loss in result["final_loss"].values())
    recovery = result["recovery"]
    assert measured(recovery["kill_to_first_step_s"]) and measured(recovery["cold_start_s"])
    assert recovery["ratio_to_cold_start"] > 0 and isinstance(recovery["goal_met"], bool)
    assert recovery["warm_told_to_go"]["median"] == 2  # the relaunch used the warm tasks
    # The chief's snapshot: the crash redid at most the step under way; and what it costs.
    assert recovery["steps_repeated"]["max"] <= 1, recovery["snapshots"]


def check_chaos(record: dict[str, Any]) -> None:
    (local,) = record["results"]  # --quick: local processes only
    faults = {f["fault"]: f for f in local["faults"]}
    disk = [] if "disk full" in local["skipped"] else ["disk full"]  # mounting needs root
    assert sorted(faults) == sorted(["worker killed", "chief killed", "task hung", "preempted",
                                     "controller killed", *disk]), local["schedule"]
    assert local["survived"] == local["injected"] == len(faults), local["faults"]
    assert local["status"] == "succeeded" and local["bit_identical"], local
    assert local["attempts"] == len(faults)  # every fault but the controller's restarted once
    # a crashed (or hung, then killed) worker: the chief saved the step under way, and train's
    # output said so; the chief crashed: worker:1 saved it in the chief's place
    hung = faults["task hung"]["task"]  # killed first: then as a crash of that task
    for fault, died in (("worker killed", "worker:1"), ("chief killed", "worker:0"),
                        ("task hung", hung)):
        figures, saver = faults[fault], "worker:1" if died == "worker:0" else "worker:0"
        assert figures["snapshot_step"] is not None and figures["steps_redone"] <= 1, figures
        assert figures["said_snapshot"], figures
        assert figures["why"] == (f"{saver} saved its state at step {figures['snapshot_step']} "
                                  f"after {died} failed"), figures
    assert local["max_redone_per_crash"] <= 1 and local["goal_met"], local
    assert faults["preempted"]["steps_redone"] == 0, faults["preempted"]
    if disk:  # the chief's save found the disk full: said as such, not as the job's error
        assert faults["disk full"]["detail"].startswith("the disk is full on local-"), faults
    assert all(f["steps_redone"] <= local["checkpoint_every"] for f in local["faults"]), faults


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "launch": check_launch, "steady": check_steady, "recovery": check_recovery,
    "peer": check_peer, "provision": check_provision, "controller": check_controller,
    "control_path": check_control_path, "checkpoints": check_checkpoints,
    "keras3": check_keras3, "warm_cost": check_warm_cost, "jax": check_jax,
    "chaos": check_chaos, "watching": check_watching, "elastic": check_elastic,
}


MARKS = {"launch": [pytest.mark.tf], "steady": [pytest.mark.tf], "recovery": [pytest.mark.tf],
         "peer": [pytest.mark.tf], "keras3": [pytest.mark.tf], "warm_cost": [pytest.mark.tf],
         "jax": [pytest.mark.tf], "chaos": [pytest.mark.tf], "watching": [pytest.mark.tf],
         "elastic": [pytest.mark.tf, pytest.mark.ssh],
         "controller": [pytest.mark.ssh],
         "control_path": [pytest.mark.ssh], "checkpoints": [pytest.mark.ssh, pytest.mark.tf]}


@pytest.mark.parametrize("name", [pytest.param(n, marks=MARKS.get(n, [])) for n in sorted(CHECKS)])
def test_benchmark_runs_in_quick_mode_and_prints_one_json_line(name: str) -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), "--quick"],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # the table and progress notes go to stderr
    record = json.loads(lines[0])
    assert set(record) >= COMMON_KEYS, sorted(record)
    assert (record["benchmark"], record["mode"], record["repeats"]) == (name, "quick", 1)
    assert record["machine"]["cpus"] >= 1
    CHECKS[name](record)
    assert "----" in proc.stderr  # the short table
