"""Expiry of trials whose client died (``stale_after_s``) and paging of the trial list."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from bso_helpers import Served, check_policy_consistent, db_view, metric_value, register, spec
from sqlalchemy import text

from joules.servers.batch_size import db as dbm
from joules.servers.batch_size.schemas import JobCreate
from joules.servers.batch_size.service import BatchSizeService

ENDED = "joules_bso_trials_ended_total"


def report(c: httpx.Client, job: str, trial: str, epoch: int, metric: float = 0.1) -> httpx.Response:
    return c.post(f"/jobs/{job}/trials/{trial}/epochs",
                  json={"epoch": epoch, "time_s": 10.0, "energy_j": 2000.0, "metric": metric})


def test_stale_trial_is_aborted_and_frees_its_batch_size(bso_server: Served) -> None:
    """joules' policy: the dead client's batch size is in flight until the trial expires."""
    with bso_server.client() as c:
        aborted_before = metric_value(c.get("/metrics").text, ENDED, 'outcome="aborted"')
        job = register(c, spec(counting=False, default_batch_size=64, stale_after_s=1.0))
        t1 = c.post(f"/jobs/{job}/trials").json()
        assert t1["batch_size"] == 64
        assert report(c, job, t1["trial_id"], 1).status_code == 200
        assert c.get(f"/jobs/{job}").json()["trials"] == {"running": 1, "ended": 0}
        assert db_view(bso_server.db, job).state["in_flight"] == [64]
        time.sleep(1.3)
        state = c.get(f"/jobs/{job}").json()  # reading the state expires it
        assert state["trials"] == {"running": 0, "ended": 1, "aborted": 1}
        view = db_view(bso_server.db, job)
        assert view.state["in_flight"] == [] and view.trials[0].outcome == "aborted"
        check_policy_consistent(view)
        t2 = c.post(f"/jobs/{job}/trials").json()
        assert t2["batch_size"] == 64  # the slot is free again
        r = report(c, job, t1["trial_id"], 2)
        assert r.status_code == 409 and "has ended (aborted)" in r.json()["detail"]
        # A repeat of an epoch reported before expiry still gets its answer.
        assert report(c, job, t1["trial_id"], 1).status_code == 200
        ended = c.get(f"/jobs/{job}/trials/{t1['trial_id']}").json()
        assert (ended["status"], ended["outcome"], ended["epochs"]) == ("ended", "aborted", 1)
        aborted_after = metric_value(c.get("/metrics").text, ENDED, 'outcome="aborted"')
        assert aborted_after >= aborted_before + 1
    check_policy_consistent(db_view(bso_server.db, job))


def test_starting_a_trial_expires_stale_ones_and_reports_keep_trials_alive(bso_server: Served) -> None:
    """The counting policy sees the expired trial as an abort, once; reports refresh a trial."""
    with bso_server.client() as c:
        job = register(c, spec(stale_after_s=1.0, max_epochs=100))
        dead = c.post(f"/jobs/{job}/trials").json()
        alive = c.post(f"/jobs/{job}/trials").json()
        for e in range(1, 5):  # 1.6 s of reports, 0.4 s apart: never idle for 1 s
            time.sleep(0.4)
            assert report(c, job, alive["trial_id"], e).json()["stop"] is False
        t3 = c.post(f"/jobs/{job}/trials").json()  # expires `dead` first
        trials = {t["trial_id"]: t for t in c.get(f"/jobs/{job}/trials").json()}
        assert trials[dead["trial_id"]]["outcome"] == "aborted"
        assert trials[alive["trial_id"]]["status"] == "running"
        assert trials[t3["trial_id"]]["status"] == "running"
        assert report(c, job, dead["trial_id"], 1).status_code == 409
        view = db_view(bso_server.db, job)
        assert view.state["aborted"] == 1 and view.state["started"] == 3
        check_policy_consistent(view)
        state = c.get(f"/jobs/{job}").json()
        assert state["trials"]["aborted"] == 1


def test_stale_after_s_is_checked_and_defaults_keep_old_bodies_valid(bso_server: Served) -> None:
    with bso_server.client() as c:
        for bad in (0.5, -1, "inf", "nan"):
            r = c.post("/jobs", json=spec(stale_after_s=bad))
            assert r.status_code == 422 and "stale_after_s" in r.text
        body = spec()
        r = c.post("/jobs", json=body)
        assert r.status_code == 201 and r.json()["stale_after_s"] == 86400.0
        assert c.post("/jobs", json=body).status_code == 200
        assert c.post("/jobs", json={**body, "stale_after_s": 86400.0}).status_code == 200
        r = c.post("/jobs", json={**body, "stale_after_s": 60.0})
        assert r.status_code == 409 and "stale_after_s" in r.json()["detail"]


def test_trial_list_pages(bso_server: Served) -> None:
    with bso_server.client() as c:
        job = register(c, spec())
        ids = [c.post(f"/jobs/{job}/trials").json()["trial_id"] for _ in range(5)]
        assert [t["trial_id"] for t in c.get(f"/jobs/{job}/trials").json()] == ids

        def page(**params: Any) -> list[str]:
            r = c.get(f"/jobs/{job}/trials", params=params)
            assert r.status_code == 200, r.text
            return [t["trial_id"] for t in r.json()]

        assert page(limit=2) == ids[:2]
        assert page(offset=2, limit=2) == ids[2:4]
        assert page(offset=4) == ids[4:]
        assert page(offset=10) == []
        for bad in ({"offset": -1}, {"limit": 0}, {"limit": 1001}, {"limit": "x"}):
            assert c.get(f"/jobs/{job}/trials", params=bad).status_code == 422


def test_injected_clock_expires_trials(tmp_path: Any) -> None:
    """The service's clock is injectable: no sleeping needed."""
    db = dbm.Database(f"sqlite:///{tmp_path / 'clock.sqlite'}")
    dbm.upgrade(db)
    now = [datetime(2030, 1, 1, tzinfo=UTC)]
    service = BatchSizeService(db, clock=lambda: now[0])
    expired: list[int] = []
    service.on_expired = expired.append
    try:
        job, _ = service.register(JobCreate.model_validate(spec(counting=False, default_batch_size=64,
                                                                stale_after_s=3600.0)))
        from joules.servers.batch_size.schemas import TrialCreate
        t1, _ = service.start_trial(job.job_id, TrialCreate())
        transactions: list[bool] = []  # write flag of each transaction the service opens
        real = db.transaction
        db.transaction = lambda write=True: transactions.append(write) or real(write)  # type: ignore[method-assign]
        now[0] += timedelta(seconds=3599)
        assert service.job_state(job.job_id).trials["running"] == 1 and expired == []
        assert transactions == [False]  # nothing to expire: one read
        now[0] += timedelta(seconds=2)
        transactions.clear()
        assert service.job_state(job.job_id).trials == {"running": 0, "ended": 1, "aborted": 1}
        assert transactions == [False, True, False]  # found stale, expired under the lock, read again
        assert expired == [1]
        assert service.trial(job.job_id, t1.trial_id).ended_at == now[0]
    finally:
        db.dispose()


def test_report_to_a_stale_trial_not_yet_expired_is_taken(tmp_path: Any) -> None:
    """Reports do not expire trials: a late report revives its trial, which then does not expire."""
    from joules.servers.batch_size.schemas import EpochReport, TrialCreate

    db = dbm.Database(f"sqlite:///{tmp_path / 'late.sqlite'}")
    dbm.upgrade(db)
    now = [datetime(2030, 1, 1, tzinfo=UTC)]
    service = BatchSizeService(db, clock=lambda: now[0])
    try:
        job, _ = service.register(JobCreate.model_validate(spec(counting=False, stale_after_s=60.0)))
        trial, _ = service.start_trial(job.job_id, TrialCreate())
        now[0] += timedelta(seconds=61)  # stale, but nothing has expired it yet
        result = service.report(job.job_id, trial.trial_id,
                                EpochReport(epoch=1, time_s=10.0, energy_j=2000.0, metric=0.1))
        assert result.answer.stop is False and not result.repeated
        now[0] += timedelta(seconds=59)  # 59 s after the report: active
        assert service.job_state(job.job_id).trials == {"running": 1, "ended": 0}
        got = service.trial(job.job_id, trial.trial_id)
        assert (got.status, got.epochs) == ("running", 1)
    finally:
        db.dispose()


def test_migration_fills_last_activity_of_existing_trials(tmp_path: Any) -> None:
    db = dbm.Database(f"sqlite:///{tmp_path / 'm.sqlite'}")
    try:
        dbm.upgrade(db, "0001")
        t0 = "2030-01-01 00:00:00.000000"
        with db.engine.connect() as conn, conn.begin():
            conn.execute(text(
                "INSERT INTO bso_jobs VALUES ('j', 'n', '{}', 'joules', '{}', NULL, 1, 2, :t, :t)"),
                {"t": t0})
            for tid, seq in (("a", 1), ("b", 2)):
                conn.execute(text(
                    "INSERT INTO bso_trials VALUES (:id, 'j', :seq, 32, 'explore', NULL, 'running', NULL, "
                    "0, 0, 0, 0, NULL, NULL, :t, NULL)"), {"id": tid, "seq": seq, "t": t0})
            conn.execute(text("INSERT INTO bso_epoch_reports (trial_id, epoch, time_s, energy_j, metric, "
                              "stop, reason, cost, stop_cost, created_at) VALUES "
                              "('a', 1, 1, 1, 0.1, 0, NULL, 1, NULL, '2030-01-02 00:00:00.000000')"))
        dbm.upgrade(db)
        with db.transaction(write=False) as s:
            rows = dict(s.execute(text("SELECT id, last_activity_at FROM bso_trials")).all())
        assert rows == {"a": "2030-01-02 00:00:00.000000", "b": t0}
    finally:
        db.dispose()
