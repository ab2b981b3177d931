"""Values at and beyond the server's limits: 422 naming the field, never a 500 or a job left unusable.

In process (FastAPI's ``TestClient``, one app per backend), with joules' own policy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from bso_helpers import spec
from fastapi.testclient import TestClient
from sqlalchemy import update

from joules.servers.batch_size import db as dbm
from joules.servers.batch_size.app import create_app
from joules.servers.batch_size.schemas import (
    MAX_BATCH_SIZE,
    MAX_EPOCH_ENERGY_J,
    MAX_EPOCH_TIME_S,
    MAX_POWER_W,
    MAX_PRIOR,
    MAX_STALE_AFTER_S,
)

JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def client(request: pytest.FixtureRequest, bso_databases: Callable[[str], str]) -> Iterator[TestClient]:
    app = create_app(bso_databases(request.param))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def job_spec(**kw: Any) -> dict[str, Any]:
    return spec(counting=False, **kw)


def register(c: TestClient, **kw: Any) -> str:
    r = c.post("/jobs", json=job_spec(**kw))
    assert r.status_code == 201, r.text
    return r.json()["job_id"]


def new_trial(c: TestClient, job: str) -> str:
    r = c.post(f"/jobs/{job}/trials")
    assert r.status_code == 201, r.text
    return r.json()["trial_id"]


def epoch(c: TestClient, job: str, trial: str, n: int, time_s: float = 10.0, energy_j: float = 2000.0,
          metric: float = 0.1) -> Any:
    return c.post(f"/jobs/{job}/trials/{trial}/epochs",
                  json={"epoch": n, "time_s": time_s, "energy_j": energy_j, "metric": metric})


def fields(r: Any) -> set[str]:
    """The field names in a 422's errors."""
    assert r.status_code == 422, r.text
    return {str(part) for d in r.json()["detail"] for part in d["loc"]}


@pytest.mark.parametrize(("change", "field", "shown"), [
    ('"target_metric": NaN', "target_metric", "nan"),
    ('"max_power_w": Infinity', "max_power_w", "inf"),
    ('"eta": NaN', "eta", "nan"),
    ('"beta": -Infinity', "beta", "-inf"),
    ('"prior_mean": 1e400', "prior_mean", "inf"),
    ('"stale_after_s": NaN', "stale_after_s", "nan"),
    ('"knobs": {"lr": NaN}', "knobs", "nan"),
    ('"knobs": {"lr": Infinity}', "knobs", "inf"),
])
def test_a_non_finite_number_in_a_job_is_422_naming_the_field(client: TestClient, change: str, field: str,
                                                              shown: str) -> None:
    r = client.post("/jobs", content=_with(job_spec(), change), headers=JSON_HEADERS)
    assert field in fields(r)
    errors = [d for d in r.json()["detail"] if field in d["loc"]]
    assert shown in {str(d.get("input")) for d in errors}  # the value, as a string


def _with(base: dict[str, Any], change: str) -> str:
    """``base`` as JSON text, ``change`` (``'"key": value'``, raw: JSON has no NaN) replacing its key."""
    key = change.split(":", 1)[0].strip().strip('"')
    rest = {k: v for k, v in base.items() if k != key}
    return json.dumps(rest)[:-1] + ", " + change + "}"


@pytest.mark.parametrize(("change", "field"), [
    ('"metric": NaN', "metric"),
    ('"time_s": Infinity', "time_s"),
    ('"time_s": 1e400', "time_s"),
    ('"energy_j": -Infinity', "energy_j"),
])
def test_a_non_finite_number_in_a_report_is_422_naming_the_field(client: TestClient, change: str,
                                                                 field: str) -> None:
    job = register(client)
    trial = new_trial(client, job)
    good = {"epoch": 1, "time_s": 10.0, "energy_j": 2000.0, "metric": 0.1}
    r = client.post(f"/jobs/{job}/trials/{trial}/epochs", content=_with(good, change), headers=JSON_HEADERS)
    assert fields(r) == {"body", field}
    assert epoch(client, job, trial, 1).status_code == 200  # the trial is fine


@pytest.mark.parametrize(("report", "field"), [
    ({"time_s": 1e307}, "time_s"),
    ({"time_s": MAX_EPOCH_TIME_S * 1.5}, "time_s"),
    ({"energy_j": 1e308}, "energy_j"),
    ({"energy_j": MAX_EPOCH_ENERGY_J * 1.5}, "energy_j"),
])
def test_a_report_beyond_the_limits_is_422_and_the_trial_still_ends(client: TestClient,
                                                                    report: dict[str, float],
                                                                    field: str) -> None:
    job = register(client)
    trial = new_trial(client, job)
    assert fields(epoch(client, job, trial, 1, **report)) == {"body", field}
    assert fields(epoch(client, job, trial, 1, metric=0.95, **report)) == {"body", field}
    r = epoch(client, job, trial, 1)
    assert r.status_code == 200 and r.json()["cost"] == pytest.approx(0.5 * 2000 + 0.5 * 300 * 10)
    r = client.post(f"/jobs/{job}/trials/{trial}/end", json={})
    assert r.status_code == 200 and r.json()["outcome"] == "max_epochs"


@pytest.mark.parametrize(("change", "field"), [
    ({"stale_after_s": 1e308}, "stale_after_s"),
    ({"stale_after_s": MAX_STALE_AFTER_S + 1}, "stale_after_s"),
    ({"prior_mean": 1e200, "prior_precision": 1.0}, "prior_mean"),
    ({"prior_mean": -1e200}, "prior_mean"),
    ({"prior_mean": 1.0, "prior_precision": 1e200}, "prior_precision"),
    ({"batch_sizes": [32, 2**40], "default_batch_size": 32}, "batch_sizes"),
    ({"batch_sizes": [32, 2**63], "default_batch_size": 32}, "batch_sizes"),
    ({"batch_sizes": [32, MAX_BATCH_SIZE + 1], "default_batch_size": MAX_BATCH_SIZE + 1},
     "default_batch_size"),
    ({"max_power_w": 1e308}, "max_power_w"),
    ({"max_power_w": MAX_POWER_W * 2}, "max_power_w"),
])
def test_a_job_beyond_the_limits_is_422_naming_the_field(client: TestClient, change: dict[str, Any],
                                                         field: str) -> None:
    assert field in fields(client.post("/jobs", json=job_spec(**change)))


@pytest.mark.parametrize("policy", ["joules", "nsdi23"])
def test_a_job_at_every_limit_works(client: TestClient, policy: str) -> None:
    """Every limit at once, and reports at theirs: every answer is 2xx and every number finite."""
    job = register(client, policy=policy, batch_sizes=[1, 2, MAX_BATCH_SIZE],
                   default_batch_size=MAX_BATCH_SIZE, max_power_w=MAX_POWER_W,
                   stale_after_s=MAX_STALE_AFTER_S, prior_mean=MAX_PRIOR, prior_precision=MAX_PRIOR,
                   beta=1000.0, max_epochs=3, knobs={"lr": 0.1, "n": 2**62})
    for metrics in ([0.1, 0.95], [0.1, 0.2, 0.3], [0.95], [0.1, 0.2, 0.95]):
        trial = client.post(f"/jobs/{job}/trials")
        assert trial.status_code == 201, trial.text
        trial_id = trial.json()["trial_id"]
        for n, metric in enumerate(metrics, 1):
            r = epoch(client, job, trial_id, n, time_s=MAX_EPOCH_TIME_S, energy_j=MAX_EPOCH_ENERGY_J,
                      metric=metric)
            assert r.status_code == 200, r.text
            per_epoch = 0.5 * MAX_EPOCH_ENERGY_J + 0.5 * MAX_POWER_W * MAX_EPOCH_TIME_S
            assert r.json()["cost"] == pytest.approx(n * per_epoch)
            if r.json()["stop"]:
                break
        r = client.post(f"/jobs/{job}/trials/{trial_id}/end", json={})
        assert r.status_code == 200, r.text
        state = client.get(f"/jobs/{job}")
        assert state.status_code == 200, state.text
    assert state.json()["job"]["knobs"] == {"lr": 0.1, "n": 2**62}
    assert client.get(f"/jobs/{job}/trials").status_code == 200


@pytest.mark.parametrize("offset", [2**31, 2**63, 10**30])
def test_a_huge_trials_offset_is_422(client: TestClient, offset: int) -> None:
    job = register(client)
    new_trial(client, job)
    r = client.get(f"/jobs/{job}/trials", params={"offset": offset})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["query", "offset"]
    r = client.get(f"/jobs/{job}/trials", params={"offset": 2**31 - 1})
    assert r.status_code == 200 and r.json() == []


def test_knobs_keep_their_types(client: TestClient) -> None:
    knobs = {"lr": 0.5, "layers": 50, "opt": "adamw", "amp": True}
    r = client.post("/jobs", json=job_spec(knobs=knobs))
    assert r.status_code == 201 and r.json()["knobs"] == knobs
    assert [type(v) for v in r.json()["knobs"].values()] == [float, int, str, bool]


def test_a_trial_stored_with_totals_beyond_the_limits_can_still_end(client: TestClient) -> None:
    """A trial whose totals were stored before the limits existed: 422 for a report, not 500 forever."""
    job = register(client)
    trial = new_trial(client, job)
    assert epoch(client, job, trial, 1).status_code == 200
    database = client.app.state.service.db  # type: ignore[attr-defined]
    with database.transaction() as s:
        s.execute(update(dbm.Trial).where(dbm.Trial.id == trial).values(time_s=1e307))
    r = epoch(client, job, trial, 2, metric=0.95)
    assert fields(r) == {"body", "time_s"} and "not be finite" in r.json()["detail"][0]["msg"]
    with database.transaction() as s:
        s.execute(update(dbm.Trial).where(dbm.Trial.id == trial).values(cost=float("inf")))
    r = client.post(f"/jobs/{job}/trials/{trial}/end", json={})
    assert r.status_code == 200 and r.json()["outcome"] == "aborted"  # nothing to learn from it
    assert client.post(f"/jobs/{job}/trials").status_code == 201
    assert client.get(f"/jobs/{job}").status_code == 200


def test_a_job_stored_with_a_spec_beyond_the_limits_is_409_naming_the_field(client: TestClient) -> None:
    job = register(client)
    service = client.app.state.service  # type: ignore[attr-defined]
    with service.db.transaction() as s:
        stored = s.get_one(dbm.Job, job).spec
        s.execute(update(dbm.Job).where(dbm.Job.id == job).values(spec={**stored, "stale_after_s": 1e300}))
    service._jobs.clear()  # as a server started after the upgrade
    for r in (client.post(f"/jobs/{job}/trials"), client.get(f"/jobs/{job}")):
        assert r.status_code == 409 and "stale_after_s" in r.json()["detail"], r.text


@pytest.mark.parametrize(("token", "problem"), [
    (" tok", "starts or ends with whitespace"), ("tok ", "starts or ends with whitespace"),
    ("tok\n", "starts or ends with whitespace"), ("", "is empty"), ("  ", "is empty"),
])
def test_a_token_no_client_can_send_is_refused(tmp_path: Any, token: str, problem: str) -> None:
    with pytest.raises(ValueError, match=f"the token {problem}"):
        create_app(f"sqlite:///{tmp_path / 'x.sqlite'}", token=token)
