"""What a cluster costs an hour and what a run cost: gcp's list prices from the Cloud Billing
Catalog (the real client against tests/fake_billing.py) or the shipped table, the arithmetic of
VMs, GPUs and disks on demand and spot, the restarts' share, and GPU hours elsewhere."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from fake_billing import FakeBilling, Sku
from rich.console import Console

from orchestrator import cost, spec
from orchestrator.console import render_plan
from orchestrator.cost import Price
from orchestrator.errors import SpecError
from orchestrator.paths import price_cache
from orchestrator.providers.gcp import billing, prices
from orchestrator.providers.gcp.prices import Rates, key
from orchestrator.state import AttemptRecord, RunRecord, TaskRecord

REPO = Path(__file__).resolve().parent.parent
TODAY = datetime.now(timezone.utc).date().isoformat()


def gcp_spec(workers: int = 2, **provider: Any) -> spec.ClusterSpec:
    settings = {"kind": "gcp", "project": "my-project-1", "zones": ["us-central1-a"], **provider}
    return spec.parse(json.dumps({"name": "priced", "workers": workers, "provider": settings,
                                  "job": {"module": "examples.digits"}}))


def other_spec(provider: dict[str, Any], *, workers: int = 3, **top: Any) -> spec.ClusterSpec:
    return spec.parse(json.dumps({"name": "counted", "workers": workers, "provider": provider,
                                  "job": {"module": "examples.digits"}, **top}))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    with FakeBilling(page_size=40) as server:
        monkeypatch.setenv(billing.ENDPOINT_ENV, server.url)
        yield server


class Sleeps(list[float]):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


# -- the Billing Catalog through the real client -------------------------------------------
def test_catalog_prices_are_read_from_every_page_and_skus_that_only_look_alike_are_skipped(
        fake: FakeBilling) -> None:
    rates = billing.read_catalog("USD")
    pages = math.ceil(len(fake.skus) / fake.page_size)
    assert len(fake.requests) == pages > 2
    assert [r.get("pageToken") for r in fake.requests] == \
        [None, *(f"page-{fake.page_size * i}" for i in range(1, pages))]
    assert {r["pageSize"] for r in fake.requests} == {str(billing.PAGE_SIZE)}
    assert rates.source == f"Cloud Billing Catalog, read {TODAY}" and rates.as_of == TODAY
    central = rates.regions["us-central1"]
    assert central[key("core", "n1")] == pytest.approx(0.0332)  # not a commitment's, a custom's
    assert central[key("ram", "n1", spot=True)] == pytest.approx(0.00095)
    assert central[key("gpu", "nvidia-tesla-t4")] == pytest.approx(0.37)  # not a workstation's
    assert central[key("gpu", "nvidia-a100-80gb", spot=True)] == pytest.approx(1.67)
    assert central[key("gpu", "nvidia-tesla-a100")] == pytest.approx(3.08)  # not the 80 GB's
    assert central[key("disk", "pd-standard")] == pytest.approx(0.048)  # past its free tier
    assert central[key("disk", "pd-balanced")] == pytest.approx(0.11)  # not the regional disk
    assert key("core", "n2") in central and not any("e2" in name for name in central)
    assert rates.regions["europe-west4"][key("gpu", "nvidia-l4", spot=True)] == \
        pytest.approx(0.235 * 1.1)
    assert set(rates.regions) == {"us-central1", "us-east1", "us-west1", "europe-west4"}


def test_catalog_prices_come_in_the_currency_asked_for(fake: FakeBilling) -> None:
    rates = billing.read_catalog("EUR")
    assert {r["currencyCode"] for r in fake.requests} == {"EUR"}
    assert rates.currency == "EUR"
    assert rates.rate("us-east1", key("gpu", "nvidia-l4")) == pytest.approx(0.59 * 0.9)


def test_a_narrower_sku_wins_over_a_wider_one_for_the_same_region(
        monkeypatch: pytest.MonkeyPatch) -> None:
    skus = [Sku("N1 Predefined Instance Core running in Americas", ("us-central1", "us-east4"),
                "OnDemand", "N1Standard", "h", ((0, 0.03),)),
            Sku("N1 Predefined Instance Core running in Virginia", ("us-east4",), "OnDemand",
                "N1Standard", "h", ((0, 0.036),)),
            Sku("N1 Predefined Instance Core running in Americas", ("us-central1", "us-east4"),
                "Preemptible", "N1Standard", "GiBy.h", ((0, 0.5),))]  # a unit it cannot be in
    with FakeBilling(skus) as server:
        monkeypatch.setenv(billing.ENDPOINT_ENV, server.url)
        rates = billing.read_catalog("USD")
    assert rates.regions == {"us-central1": {"core n1": 0.03}, "us-east4": {"core n1": 0.036}}


def test_the_catalog_is_read_once_a_day_and_kept_in_a_private_file(fake: FakeBilling) -> None:
    first = billing.rates("USD", online=True)
    asked = len(fake.requests)
    assert first.source.startswith("Cloud Billing Catalog") and first.note == ""
    again = billing.rates("USD", online=True)
    assert len(fake.requests) == asked and again == first
    path = price_cache(billing.CACHE)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    data = json.loads(path.read_text())
    data["read_at"] -= billing.FRESH_S + 1
    path.write_text(json.dumps(data))
    billing.rates("USD", online=True)
    assert len(fake.requests) == 2 * asked  # a day old: read again
    assert billing.rates("EUR", online=False) == prices.TABLE  # the cache is in USD


def test_a_damaged_cache_is_ignored() -> None:
    path = price_cache(billing.CACHE)
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"version": 1, "currency": "USD"}),
                 json.dumps({"version": 1, "currency": "USD", "regions": [1], "read_at": 0,
                             "source": "s", "as_of": "2030-01-01"})):
        path.write_text(text)
        assert billing.rates("USD", online=False) == prices.TABLE


def test_503s_are_retried_and_the_read_goes_on(fake: FakeBilling) -> None:
    fake.fail_next(2, 503)
    sleeps = Sleeps()
    rates = billing.rates("USD", online=True, sleep=sleeps)
    assert rates.source == f"Cloud Billing Catalog, read {TODAY}" and rates.note == ""
    assert len(sleeps) == 2


def test_503s_past_the_retries_fall_back_to_the_table_with_a_note(fake: FakeBilling) -> None:
    fake.fail_next(100, 503)
    sleeps = Sleeps()
    rates = billing.rates("USD", online=True, sleep=sleeps)
    assert rates.regions == prices.TABLE.regions and rates.source == prices.SOURCE
    assert rates.note == ("the Billing Catalog was not read: HTTP 503: The service is currently "
                          "unavailable.")
    assert len(sleeps) == billing.MAX_TRIES - 1


def test_a_403_falls_back_to_the_table_whose_date_is_in_the_price(fake: FakeBilling) -> None:
    fake.deny()
    price = cost.lookup_price(gcp_spec(machine_type="n1-standard-8"), online=True)
    assert price is not None and price.per_hour is not None
    assert price.source == f"price table of {prices.AS_OF}, not a quote"
    assert price.as_of == prices.AS_OF
    assert price.note == ("the Billing Catalog was not read: HTTP 403 SERVICE_DISABLED: Cloud "
                          "Billing API has not been used in project 123456789012 before or it "
                          "is disabled.")
    line = cost.describe_price(price)
    assert f"price table of {prices.AS_OF}, not a quote" in line and "HTTP 403" in line


def test_a_cached_read_outlives_a_failed_refresh(fake: FakeBilling) -> None:
    billing.rates("USD", online=True)
    path = price_cache(billing.CACHE)
    data = json.loads(path.read_text())
    data["read_at"] -= billing.FRESH_S + 1
    path.write_text(json.dumps(data))
    fake.deny()
    rates = billing.rates("USD", online=True)
    assert rates.source == f"Cloud Billing Catalog, read {TODAY}" and "HTTP 403" in rates.note


def test_a_slow_catalog_is_given_up_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeBilling(latency_s=2.0) as server:
        monkeypatch.setenv(billing.ENDPOINT_ENV, server.url)
        started = time.monotonic()
        rates = billing.rates("USD", online=True, deadline_s=0.5, sleep=Sleeps())
        took = time.monotonic() - started
    assert rates.regions == prices.TABLE.regions and rates.source == prices.SOURCE
    assert rates.note == "the Billing Catalog was not read: it did not answer within 0.5 s"
    assert took < 2.0


def test_an_endpoint_that_is_down_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeBilling() as server:
        url = server.url
    monkeypatch.setenv(billing.ENDPOINT_ENV, url)
    rates = billing.rates("USD", online=True, sleep=Sleeps())
    assert rates.note == f"the Billing Catalog was not read: cannot reach {url} (ConnectionError)"


def test_no_credentials_fall_back_to_the_table(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    monkeypatch.delenv(billing.ENDPOINT_ENV, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    rates = billing.rates("USD", online=True)
    assert rates.regions == prices.TABLE.regions
    assert rates.note == ("the Billing Catalog was not read: no Google Cloud credentials on this "
                          "machine ('gcloud auth application-default login' makes them)")


def test_catalog_prices_make_the_cluster_price(fake: FakeBilling) -> None:
    s = gcp_spec(machine_type="n1-standard-8", accelerator={"type": "nvidia-tesla-t4",
                                                            "count": 2})
    price = cost.lookup_price(s, online=True)
    assert price is not None and price.per_hour is not None
    vm = 2 * (8 * 0.0332 + 30 * 0.00445)
    gpu = 2 * 2 * 0.37
    disk = 2 * 100 * 0.11 / 730
    assert price.parts == pytest.approx({"vm": vm, "gpu": gpu, "disk": disk})
    assert price.per_hour == pytest.approx(vm + gpu + disk)
    assert price.source == f"Cloud Billing Catalog, read {TODAY}"


# -- the shipped table -----------------------------------------------------------------------
def test_the_shipped_table_is_dated_and_its_date_is_shown_beside_the_price() -> None:
    assert date.fromisoformat(prices.AS_OF) <= date.today()
    price = cost.price_of(gcp_spec(machine_type="a2-highgpu-1g"))
    assert price is not None
    assert price.as_of == prices.AS_OF
    assert cost.describe_price(price).endswith(f"; price table of {prices.AS_OF}, not a quote")


def test_the_table_prices_every_family_gpu_and_disk_it_names_in_every_region() -> None:
    for region, rates in prices.TABLE.regions.items():
        for family in prices.FAMILIES:
            for spot in (False, True):
                assert rates[key("core", family, spot=spot)] > 0, (region, family)
                assert rates[key("ram", family, spot=spot)] > 0, (region, family)
        for gpu in prices.GPU_MODELS.values():
            assert 0 < rates[key("gpu", gpu, spot=True)] < rates[key("gpu", gpu)], (region, gpu)
        for disk in prices.DISK_SKUS:
            assert rates[key("disk", disk)] > 0


# -- the arithmetic --------------------------------------------------------------------------
RATES = Rates("test prices", "2026-01-01", "USD", {"us-central1": {
    "core n1": 0.03, "ram n1": 0.004, "spot core n1": 0.01, "spot ram n1": 0.001,
    "core a2": 0.03, "ram a2": 0.004, "spot core a2": 0.012, "spot ram a2": 0.0016,
    "gpu nvidia-tesla-t4": 0.35, "spot gpu nvidia-tesla-t4": 0.1,
    "gpu nvidia-tesla-a100": 3.0, "spot gpu nvidia-tesla-a100": 1.2,
    "disk pd-balanced": 0.1, "disk pd-ssd": 0.17}})


@pytest.mark.parametrize(("provider", "workers", "vm", "gpu", "disk", "gpus"), [
    # n1-standard-8: 8 cores, 30 GiB; a 100 GiB pd-balanced boot disk; no GPU
    ({"machine_type": "n1-standard-8"}, 2, 2 * (8 * 0.03 + 30 * 0.004), 0.0,
     2 * 100 * 0.1 / 730, 0),
    # spot: cores, RAM and GPUs at spot prices, the disk at its one price
    ({"machine_type": "n1-standard-8", "spot": True,
      "accelerator": {"type": "nvidia-tesla-t4", "count": 2}}, 2,
     2 * (8 * 0.01 + 30 * 0.001), 2 * 2 * 0.1, 2 * 100 * 0.1 / 730, 4),
    ({"machine_type": "n1-highmem-4", "accelerator": {"type": "nvidia-tesla-t4"}}, 3,
     3 * (4 * 0.03 + 26 * 0.004), 3 * 0.35, 3 * 100 * 0.1 / 730, 3),
    # a2-highgpu-1g: 12 cores, 85 GiB and one A100 built in
    ({"machine_type": "a2-highgpu-1g", "disk_type": "pd-ssd", "disk_size_gb": 150}, 4,
     4 * (12 * 0.03 + 85 * 0.004), 4 * 3.0, 4 * 150 * 0.17 / 730, 4),
    ({"machine_type": "a2-highgpu-2g", "spot": True}, 1,
     24 * 0.012 + 170 * 0.0016, 2 * 1.2, 100 * 0.1 / 730, 2),
])
def test_a_gcp_cluster_costs_its_vms_gpus_and_disks_an_hour(
        provider: dict[str, Any], workers: int, vm: float, gpu: float, disk: float,
        gpus: int) -> None:
    price = cost.price_of(gcp_spec(workers, **provider), catalog=RATES)
    assert price is not None and price.per_hour is not None
    expected = {"vm": vm, "gpu": gpu, "disk": disk}
    assert price.parts == pytest.approx({k: v for k, v in expected.items() if v})
    assert price.per_hour == pytest.approx(vm + gpu + disk)
    assert (price.gpus, price.machines, price.spot) == \
        (gpus, workers, provider.get("spot", False))
    assert (price.source, price.as_of, price.region, price.note) == \
        ("test prices", "2026-01-01", "us-central1", "")


def test_a_price_per_gpu_hour_replaces_the_list_price_of_gcp_gpus() -> None:
    s = gcp_spec(2, machine_type="a2-highgpu-1g").model_copy(
        update={"cost": spec.CostSettings(gpu_hour_price=2.0)})
    price = cost.price_of(s, catalog=RATES)
    assert price is not None
    assert price.parts["gpu"] == pytest.approx(2 * 2.0)
    assert price.source == f"test prices; GPUs at {cost.USER_PRICE}"


@pytest.mark.parametrize(("provider", "named"), [
    ({"machine_type": "e2-standard-4"}, "no price for machine type e2-standard-4 in us-central1"),
    ({"machine_type": "n1-standard-8", "accelerator": {"type": "nvidia-tesla-k80"}},
     "no price for nvidia-tesla-k80 in us-central1"),
    ({"machine_type": "n1-standard-8", "disk_type": "hyperdisk-balanced"},
     "no price for hyperdisk-balanced in us-central1"),
    ({"machine_type": "n1-standard-8", "spot": True, "accelerator": {"type": "nvidia-l4"}},
     "no price for spot nvidia-l4 in us-central1"),
    ({"zones": ["southamerica-east1-b"]}, "no prices for region southamerica-east1"),
])
def test_what_the_list_lacks_leaves_the_price_unknown_and_named(provider: dict[str, Any],
                                                                 named: str) -> None:
    price = cost.price_of(gcp_spec(**provider), catalog=RATES)
    assert price is not None and price.per_hour is None and price.parts == {}
    assert named in price.note
    assert cost.describe_price(price).startswith("price unknown for 2 VMs")


# -- the restarts' share ---------------------------------------------------------------------
def attempt(number: int, started: float, first_step: float | None, ended: float | None,
            resumed: int | None, last: int | None, *, recovery: float | None = None,
            lost: int | None = None) -> AttemptRecord:
    return AttemptRecord(run_id="r1", number=number, status="failed" if lost else "running",
                         started_at=started, ended_at=ended, cause="", detail="", failed_task="",
                         exit_code=None, resumed_from_step=resumed, last_step=last,
                         first_step_at=first_step, tasks=[], recovery_s=recovery,
                         steps_lost=lost)


def run(attempts: list[AttemptRecord], ended: float | None) -> RunRecord:
    return RunRecord(id="r1", cluster="c", status="running" if ended is None else "succeeded",
                     started_at=1000.0, ended_at=ended, metrics={}, model_path="", message="",
                     controller_pid=None, attempts=attempts)


PRICED = Price(per_hour=10.0, currency="USD", gpus=4, machines=2, parts={"vm": 2.0, "gpu": 8.0},
               spot=False, source="test prices", as_of="2026-01-01", provider="gcp")
# Attempt 1 makes steps 0-100 from its first step at 1010 to its failure at 1500 (4.9 s a
# step); 30 s later attempt 2 trains again, from step 88: 12 steps done twice. Attempt 2
# makes steps 88-400 from 1530 to 4600 (3070 s / 312 steps).
FIRST = attempt(1, 1000, 1010, 1500, 0, 100, recovery=30.0, lost=12)
SECOND = attempt(2, 1520, 1530, 4600, 88, 400)


@pytest.mark.parametrize(("attempts", "ended", "now", "hours", "lost", "redone", "untimed"), [
    ([FIRST, SECOND], 4600.0, 9999.0, 1.0, 30 + 12 * 3070 / 312, 12, 0),
    # attempt 2 still running (no pace of its own yet): the steps at attempt 1's pace
    ([FIRST, attempt(2, 1520, 1530, None, 88, None)], None, 2800.0, 0.5, 30 + 12 * 4.9, 12, 0),
    # neither attempt timed a step: the steps are counted, not their time
    ([attempt(1, 1000, None, 1500, 0, None, recovery=30.0, lost=12),
      attempt(2, 1520, None, None, None, None)], None, 2800.0, 0.5, 30.0, 12, 12),
    # a run without restarts loses nothing
    ([attempt(1, 1000, 1010, 4600, 0, 400)], 4600.0, 9999.0, 1.0, 0.0, 0, 0),
])
def test_a_runs_cost_and_the_restarts_share_of_it(
        attempts: list[AttemptRecord], ended: float | None, now: float, hours: float,
        lost: float, redone: int, untimed: int) -> None:
    c = cost.cost_of(PRICED, run(attempts, ended), now)
    assert c.hours == pytest.approx(hours)
    assert c.gpu_hours == pytest.approx(4 * hours)
    assert c.money == pytest.approx(10.0 * hours)
    assert c.lost_seconds == pytest.approx(lost)
    assert c.lost_gpu_hours == pytest.approx(4 * lost / 3600)
    assert c.lost_money == pytest.approx(10.0 * lost / 3600)
    assert (c.steps_redone, c.steps_untimed, c.ended) == (redone, untimed, ended is not None)


def test_an_elastic_groups_attempts_cost_in_proportion_to_their_tasks() -> None:
    """A price for 3 tasks: the time before the first attempt and attempt 1 at 3 tasks, a
    shrunk attempt 2 at 2 tasks (an hour), then attempt 3 grown to 4 (a spare: half an hour).
    The wall hours are the run's; the money and GPU hours follow the sizes."""
    price = replace(PRICED, tasks=3, gpus=3)
    tasks = [TaskRecord(task=f"worker:{i}", host=f"h{i}", endpoint="", pgid=0, log="", rc="")
             for i in range(4)]
    attempts = [replace(attempt(1, 1000 + 600, 1610, 2200, 0, 10), tasks=tasks[:3]),
                replace(attempt(2, 2200, 2210, 5800, 10, 400), tasks=tasks[:2]),
                replace(attempt(3, 5800, 5810, 7600, 400, 600), tasks=tasks)]
    c = cost.cost_of(price, run(attempts, 7600.0), 9999.0)
    assert c.hours == pytest.approx(6600 / 3600)
    sized = (600 + 600 + 3600 * 2 / 3 + 1800 * 4 / 3) / 3600  # 0.333 + 0.667 + 0.667 h
    assert c.money == pytest.approx(10.0 * sized)
    assert c.gpu_hours == pytest.approx(3 * sized)
    # a record kept before the tasks were: at full size, as it was counted then
    old = cost.Price.from_json({k: v for k, v in price.to_json().items() if k != "tasks"})
    assert old.tasks == 0
    assert cost.cost_of(old, run(attempts, 7600.0), 9999.0).money == pytest.approx(10 * 6600 / 3600)
    assert cost.Price.from_json(price.to_json()) == price


def test_the_cost_lines_say_money_gpu_hours_and_what_the_restarts_cost() -> None:
    c = cost.cost_of(PRICED, run([FIRST, SECOND], 4600.0), 9999.0)
    assert cost.describe_cost(c, PRICED) == (
        "cost $10.00 (1.0 h, 4.0 GPU h); restarts $0.41 (0.16 GPU h: recoveries 30 s, "
        "12 steps redone); test prices")
    unknown = Price(**{**PRICED.to_json(), "per_hour": None, "parts": {}})
    c = cost.cost_of(unknown, run([FIRST, attempt(2, 1520, None, None, None, None)], None),
                     2800.0)
    assert c.money is None and c.lost_money is None
    assert cost.describe_cost(c, unknown) == (
        "so far 0.5 h, 2.0 GPU h; restarts 0.099 GPU h: recoveries 30 s, 12 steps redone")


@pytest.mark.parametrize(("price", "line"), [
    (PRICED, "$10.00/h for 2 VMs (4 GPUs; VMs $2.00, GPUs $8.00), on demand; test prices"),
    (Price(per_hour=0.046, currency="EUR", gpus=0, machines=1, parts={"vm": 0.04, "disk": 0.006},
           spot=True, source="Cloud Billing Catalog, read 2026-11-29", as_of="2026-11-29",
           provider="gcp", region="europe-west4"),
     "0.046 EUR/h for 1 VM (0 GPUs; VMs 0.04 EUR, disks 0.006 EUR), spot in europe-west4; "
     "Cloud Billing Catalog, read 2026-11-29"),
])
def test_a_price_is_one_line_with_its_parts_and_source(price: Price, line: str) -> None:
    assert cost.describe_price(price) == line


# -- providers without a price list ----------------------------------------------------------
SLURM = {"kind": "slurm", "gpus_per_node": 8}
STATIC = {"kind": "static", "hosts": [
    {"address": f"10.0.0.{i}", "user": "ml", "key_file": "/k"} for i in (2, 3, 3)]}
KUBE = {"kind": "kubernetes", "gpus_per_pod": 2, "spot": True, "volume": {"claim": "runs"}}
IMAGE = {"image": "example.com/worker:1"}


@pytest.mark.parametrize(("provider", "top", "gpus", "machines", "note"), [
    (SLURM, {}, 24, 3, ""),
    (KUBE, {"container": IMAGE}, 6, 3, ""),
    (STATIC, {}, 0, 2, "the spec does not say how many GPUs the hosts have: 0 counted"),
])
def test_other_providers_count_gpu_hours_only(provider: dict[str, Any], top: dict[str, Any],
                                              gpus: int, machines: int, note: str) -> None:
    price = cost.price_of(other_spec(provider, **top))
    assert price is not None
    assert (price.per_hour, price.parts, price.gpus, price.machines) == (None, {}, gpus, machines)
    assert price.note.startswith(note)
    assert "GPU hours only (set cost.gpu_hour_price to see money)" in cost.describe_price(price)
    c = cost.cost_of(price, run([FIRST, SECOND], 4600.0), 9999.0)
    assert c.gpu_hours == pytest.approx(gpus) and c.money is None


@pytest.mark.parametrize(("provider", "top"), [(SLURM, {}), (KUBE, {"container": IMAGE})])
def test_a_price_per_gpu_hour_costs_other_providers_in_money(provider: dict[str, Any],
                                                             top: dict[str, Any]) -> None:
    price = cost.price_of(other_spec(provider, cost={"gpu_hour_price": 2.5, "currency": "EUR"},
                                     **top))
    assert price is not None and price.per_hour is not None
    assert price.per_hour == pytest.approx(price.gpus * 2.5) and price.currency == "EUR"
    assert price.source == cost.USER_PRICE and price.as_of == ""
    c = cost.cost_of(price, run([FIRST, SECOND], 4600.0), 9999.0)
    assert c.money == pytest.approx(price.gpus * 2.5)
    assert cost.describe_cost(c, price).startswith(f"cost {c.money:.2f} EUR (1.0 h, ")


def test_static_hosts_take_the_gpus_their_tasks_counted() -> None:
    price = cost.price_of(other_spec(STATIC, cost={"gpu_hour_price": 1.0}), gpus_counted=4)
    assert price is not None
    assert (price.gpus, price.machines, price.per_hour, price.note) == (4, 2, 4.0, "")
    unknown = cost.price_of(other_spec(STATIC, cost={"gpu_hour_price": 1.0}))
    assert unknown is not None and (unknown.gpus, unknown.per_hour) == (0, 0.0)
    assert "0 counted until the tasks say" in unknown.note


def test_local_runs_are_not_priced() -> None:
    assert cost.price_of(spec.parse("name: here\njob: {module: examples.digits}\n")) is None


@pytest.mark.parametrize(("text", "field", "says", "fix"), [
    ("cost: {gpu_hour_price: -1}\n", "cost.gpu_hour_price", "greater than or equal to 0",
     "use a larger value"),
    ("cost: {gpu_hour_price: true}\n", "cost.gpu_hour_price", "expected a number",
     "write a number"),
    ("cost: {gpu_hour_price: .inf}\n", "cost.gpu_hour_price", "finite number", None),
    ("cost: {currency: usd}\n", "cost.currency", "not an ISO 4217 currency code",
     "three-letter ISO 4217 code in capitals"),
    ("cost: {gpu_price: 2}\n", "cost.gpu_price", "unknown key 'gpu_price'",
     "did you mean 'gpu_hour_price'?"),
])
def test_a_bad_cost_field_names_its_line_field_and_fix(text: str, field: str, says: str,
                                                        fix: str | None) -> None:
    with pytest.raises(SpecError) as info:
        spec.parse("name: demo\njob:\n  module: examples.digits\n" + text, file="c.yaml")
    err = info.value
    assert (err.file, err.field, err.line) == ("c.yaml", field, 4)
    assert says in str(err)
    assert fix is None or (err.fix is not None and fix in err.fix)


# -- the record and the plan -----------------------------------------------------------------
def test_a_price_survives_its_json_round_trip() -> None:
    price = cost.price_of(gcp_spec(machine_type="g2-standard-8", spot=True))
    assert price is not None
    assert Price.from_json(json.loads(json.dumps(price.to_json()))) == price


@pytest.mark.parametrize("data", [
    None, [], {}, {**PRICED.to_json(), "per_hour": "10"}, {**PRICED.to_json(), "gpus": True},
    {**PRICED.to_json(), "gpus": -1}, {**PRICED.to_json(), "parts": {"vm": "x"}},
    {**PRICED.to_json(), "parts": [1]}, {**PRICED.to_json(), "source": None},
    {**PRICED.to_json(), "spot": "no"}, {**PRICED.to_json(), "per_hour": float("nan")},
    {k: v for k, v in PRICED.to_json().items() if k != "currency"},
])
def test_a_malformed_price_record_is_a_value_error(data: Any) -> None:
    with pytest.raises(ValueError):
        Price.from_json(data)


def test_plan_prices_from_the_table_without_the_network_or_google_libraries(
        fake: FakeBilling) -> None:
    code = ("import json, sys\nfrom orchestrator import cost, spec\n"
            f"s = spec.load({str(REPO / 'cluster_specs' / 'gcp.yaml')!r})\n"
            "print(json.dumps(cost.plan_entry(s)))\n"
            "assert 'google.cloud.billing_v1' not in sys.modules\n"
            "assert 'google.auth' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=os.environ, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    entry = json.loads(proc.stdout)
    assert entry["source"] == prices.SOURCE and entry["gpus"] == 4 and entry["spot"] is True
    assert entry["summary"] == cost.describe_price(Price.from_json(
        {k: v for k, v in entry.items() if k != "summary"}))
    assert fake.requests == []


def test_plan_prices_from_a_cached_catalog_read(fake: FakeBilling) -> None:
    s = spec.load(REPO / "cluster_specs" / "gcp.yaml")
    billing.rates("USD", online=True)
    asked = len(fake.requests)
    entry = cost.plan_entry(s)
    assert entry is not None and entry["source"] == f"Cloud Billing Catalog, read {TODAY}"
    assert len(fake.requests) == asked


def test_plan_shows_the_price_line() -> None:
    s = spec.load(REPO / "cluster_specs" / "gcp.yaml")
    document = {"cluster": s.name, "provider": "gcp", "tasks": [],
                "scaling": {"per_replica_batch_size": None}, "job_summary": "a job",
                "hosts": [], "creates": {"vms": ["v-0"], "machine_type": "a2-highgpu-1g",
                                         "accelerator": None, "spot": True,
                                         "zones": ["us-central1-a"]},
                "price": cost.plan_entry(s)}
    console = Console(record=True, width=300)
    render_plan(console, document)
    price = cost.price_of(s)
    assert price is not None
    assert f"  price      {cost.describe_price(price)}\n" in console.export_text()
    console = Console(record=True, width=300)
    render_plan(console, {**document, "price": None})
    assert "  price " not in console.export_text()
