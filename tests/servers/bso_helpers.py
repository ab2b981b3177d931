"""Helpers of the batch-size server tests: job specs, a retrying client, looking into the database."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from joules.servers.batch_size.db import Database, EpochReportRow, Job, Trial
from joules.testing.batch_size_policy import COUNTING_SEED
from joules.testing.bso_server import ServerProcess

TOKEN = "bso-test-token"
TEST_POLICY = "joules.testing.batch_size_policy:make_test_policy"
COUNTING_POLICY = "joules.testing.batch_size_policy:make_counting_policy"


def spec(name: str | None = None, counting: bool = True, **kw: Any) -> dict[str, Any]:
    """A job spec; ``counting``: the test server gives it the counting policy, else joules' policy."""
    s: dict[str, Any] = {
        "name": name or f"job-{uuid.uuid4().hex[:10]}", "batch_sizes": [32, 64, 128, 256],
        "default_batch_size": 128, "target_metric": 0.9, "max_epochs": 6, "max_power_w": 300.0,
        "eta": 0.5, "beta": 2.0, "seed": COUNTING_SEED + 7 if counting else 7,
    }
    s.update(kw)
    return s


@dataclass
class Served:
    """A running test server and its database."""

    backend: str
    db_url: str
    server: ServerProcess
    _db: Database | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def headers(self) -> dict[str, str]:
        return self.server.headers

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30.0, **kw)

    @property
    def db(self) -> Database:
        if self._db is None:
            self._db = Database(self.db_url, pool_size=2)
        return self._db

    def close(self) -> None:
        if self._db is not None:
            self._db.dispose()


def register(c: httpx.Client, body: dict[str, Any]) -> str:
    r = c.post("/jobs", json=body)
    assert r.status_code in (200, 201), r.text
    return r.json()["job_id"]


def call_with_retry(make: Any, deadline_s: float = 60.0) -> httpx.Response:
    """``make()`` until it gets an answer that is not a transport error or a 503 (server restarting)."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            r = make()
            if r.status_code != 503:
                return r
        except httpx.TransportError:
            pass
        if time.monotonic() > end:
            raise TimeoutError("the server did not come back")
        time.sleep(0.05)


@dataclass
class DbView:
    """What the database holds for one job."""

    job: Job
    state: dict[str, Any]
    trials: list[Trial]
    reports: dict[str, list[EpochReportRow]]

    def outcomes(self) -> Counter[str]:
        return Counter(t.outcome for t in self.trials if t.outcome is not None)


def db_view(db: Database, job_id: str) -> DbView:
    from sqlalchemy import select

    with db.transaction(write=False) as s:
        job = s.get(Job, job_id)
        assert job is not None
        trials = list(s.execute(select(Trial).where(Trial.job_id == job_id).order_by(Trial.seq)).scalars())
        reports: dict[str, list[EpochReportRow]] = {t.id: [] for t in trials}
        rows = s.execute(select(EpochReportRow).join(Trial).where(Trial.job_id == job_id)
                         .order_by(EpochReportRow.trial_id, EpochReportRow.epoch)).scalars()
        for r in rows:
            reports[r.trial_id].append(r)
        return DbView(job=job, state=json.loads(job.policy_state), trials=trials, reports=reports)


def check_policy_consistent(view: DbView) -> None:
    """The policy's state agrees with the trials table: each trial handed out once, each ending seen once."""
    ended = [t for t in view.trials if t.status == "ended"]
    running = [t for t in view.trials if t.status == "running"]
    if "started" in view.state:  # the counting policy
        assert view.state["started"] == len(view.trials) == view.job.trials_started
        assert view.state["observed"] + view.state["aborted"] == len(ended)
        assert view.state["outcomes"] == dict(view.outcomes())
    else:  # joules' policy: one history row per ending but aborted or failed, in_flight = running trials
        assert sorted(view.state["in_flight"]) == sorted(t.batch_size for t in running)
        history = Counter((b, o) for b, o, _, _ in view.state["history"])
        assert history == Counter((t.batch_size, t.outcome) for t in ended
                                  if t.outcome not in ("aborted", "failed"))
    assert [t.seq for t in view.trials] == list(range(1, len(view.trials) + 1))
    for t in view.trials:
        rows = view.reports[t.id]
        assert [r.epoch for r in rows] == list(range(1, t.epochs + 1)), t.id
        assert t.time_s == sum_in_order(r.time_s for r in rows)
        assert t.energy_j == sum_in_order(r.energy_j for r in rows)


def sum_in_order(values: Any) -> float:
    total = 0.0
    for v in values:
        total += v
    return total


def metric_value(text: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus exposition (0 when absent)."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0
