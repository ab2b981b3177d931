"""Many clients, several server processes, and a server killed mid-trial: nothing lost or counted twice."""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from bso_helpers import (
    TEST_POLICY,
    TOKEN,
    Served,
    call_with_retry,
    check_policy_consistent,
    db_view,
    metric_value,
    register,
    spec,
)

from joules.testing.bso_server import ServerProcess

EPOCHS_TO_TARGET = {32: 3, 64: 2, 128: 4, 256: 99}  # 256 never reaches the target


def metric(batch_size: int, epoch: int) -> float:
    return 0.95 if epoch >= EPOCHS_TO_TARGET[batch_size] else 0.1 * epoch


def run_clients(urls: list[str], job: str, clients: int, trials_each: int, max_epochs: int,
                retry: bool = False, progress: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """``clients`` threads, each running ``trials_each`` trials; each request goes to the next URL in turn.

    Every epoch report is sent twice (a client's retry); every third client aborts its
    second trial after one epoch. Returns what each trial sent and was answered.
    """
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        rng = random.Random(i)
        turn = [i]

        def post(c: httpx.Client, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
            def once() -> httpx.Response:
                turn[0] += 1
                return c.post(urls[turn[0] % len(urls)] + path, json=body)
            r = call_with_retry(once) if retry else once()
            assert r.status_code < 400, (path, r.status_code, r.text)
            return r

        try:
            with httpx.Client(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30.0) as c:
                start.wait()
                for k in range(trials_each):
                    body = {"client": f"c{i}", "request_id": f"c{i}-t{k}"}
                    trial = post(c, f"/jobs/{job}/trials", body).json()
                    tid, bs = trial["trial_id"], trial["batch_size"]
                    sent, answers = [], []
                    for e in range(1, max_epochs + 1):
                        body = {"epoch": e, "time_s": rng.uniform(1, 5), "energy_j": rng.uniform(100, 900),
                                "metric": metric(bs, e)}
                        a = post(c, f"/jobs/{job}/trials/{tid}/epochs", body).json()
                        assert post(c, f"/jobs/{job}/trials/{tid}/epochs", body).json() == a
                        sent.append(body)
                        answers.append(a)
                        if progress is not None:
                            progress()
                        if a["stop"] or (k == 1 and i % 3 == 0):
                            break
                    status = "aborted" if (k == 1 and i % 3 == 0 and not answers[-1]["stop"]) else "completed"
                    end = post(c, f"/jobs/{job}/trials/{tid}/end", {"status": status}).json()
                    with lock:
                        results.append({"trial": trial, "sent": sent, "answers": answers, "end": end})
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            with lock:
                errors.append(e)
            start.abort()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "clients hung"
    return results


def check_accounted(db: Any, job: str, results: list[dict[str, Any]]) -> None:
    """The database holds exactly what the clients sent, once, and the policy saw every trial once."""
    view = db_view(db, job)
    assert len(view.trials) == len(results)
    assert {t.id for t in view.trials} == {r["trial"]["trial_id"] for r in results}
    assert all(t.status == "ended" for t in view.trials)
    for r in results:
        rows = view.reports[r["trial"]["trial_id"]]
        assert [(x.epoch, x.time_s, x.energy_j, x.metric) for x in rows] == [
            (s["epoch"], s["time_s"], s["energy_j"], s["metric"]) for s in r["sent"]]
        answers = [{"stop": x.stop, "reason": x.reason, "cost": x.cost, "stop_cost": x.stop_cost}
                   for x in rows]
        assert answers == r["answers"]
        assert r["end"]["epochs"] == len(r["sent"])
    check_policy_consistent(view)


@pytest.mark.parametrize("policy", ["counting", "joules"])
def test_32_concurrent_clients_on_one_job(bso_server: Served, policy: str) -> None:
    with bso_server.client() as c:
        job = register(c, spec(counting=policy == "counting", max_epochs=5))
        before = c.get("/metrics").text
    t0 = time.monotonic()
    results = run_clients([bso_server.url], job, clients=32, trials_each=2, max_epochs=5)
    elapsed = time.monotonic() - t0
    check_accounted(bso_server.db, job, results)
    reports = sum(len(r["sent"]) for r in results)
    with bso_server.client() as c:
        after = c.get("/metrics").text
    assert metric_value(after, "joules_bso_epoch_reports_total", 'kind="new"') - \
        metric_value(before, "joules_bso_epoch_reports_total", 'kind="new"') == reports
    assert metric_value(after, "joules_bso_epoch_reports_total", 'kind="repeated"') - \
        metric_value(before, "joules_bso_epoch_reports_total", 'kind="repeated"') == reports
    assert metric_value(after, "joules_bso_trials_started_total") - \
        metric_value(before, "joules_bso_trials_started_total") == 64
    print(f"{bso_server.backend}/{policy}: {2 * reports} reports from 32 clients in {elapsed:.2f} s")


def test_two_servers_share_one_database(bso_backend: str, bso_databases: Callable[[str], str],
                                        tmp_path: Path) -> None:
    """Two independent server processes on one database; every client alternates between them."""
    db_url = bso_databases(bso_backend)
    a = ServerProcess(db_url, tmp_path / "a.log", token=TOKEN, policy_factory=TEST_POLICY)
    b = ServerProcess(db_url, tmp_path / "b.log", token=TOKEN, policy_factory=TEST_POLICY)
    threads = [threading.Thread(target=s.start) for s in (a, b)]  # both migrate at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert a.proc is not None and b.proc is not None, a.log() + b.log()
        with httpx.Client(base_url=a.url, headers=a.headers) as c:
            job = register(c, spec(max_epochs=4))
        results = run_clients([a.url, b.url], job, clients=8, trials_each=2, max_epochs=4)
        served = Served(bso_backend, db_url, a)
        check_accounted(served.db, job, results)
        served.close()
    finally:
        a.stop()
        b.stop()


def test_server_killed_mid_trial_loses_no_report(bso_backend: str, bso_databases: Callable[[str], str],
                                                 tmp_path: Path) -> None:
    """kill -9 while 8 clients are reporting; a new server on the same port; the clients retry and finish."""
    db_url = bso_databases(bso_backend)
    server = ServerProcess(db_url, tmp_path / "server.log", token=TOKEN, policy_factory=TEST_POLICY).start()
    acknowledged = [0]
    lock = threading.Lock()
    killed = threading.Event()

    def progress() -> None:
        with lock:
            acknowledged[0] += 1
        if not killed.is_set():
            time.sleep(0.01)  # keep the clients mid-trial until the kill

    try:
        with httpx.Client(base_url=server.url, headers=server.headers) as c:
            job = register(c, spec(name=f"restart-{uuid.uuid4().hex[:6]}", max_epochs=6))
        out: list[list[dict[str, Any]]] = []
        runner = threading.Thread(target=lambda: out.append(run_clients(
            [server.url], job, clients=8, trials_each=2, max_epochs=6, retry=True, progress=progress)))
        runner.start()
        deadline = time.monotonic() + 30
        while acknowledged[0] < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.kill()
        killed.set()
        at_kill = acknowledged[0]
        time.sleep(0.3)  # the clients see refused connections meanwhile
        server.start()
        runner.join(timeout=90)
        assert not runner.is_alive() and out, server.log()
        results = out[0]
        assert 0 < at_kill < sum(len(r["sent"]) for r in results)  # it was killed mid-way
        served = Served(bso_backend, db_url, server)
        check_accounted(served.db, job, results)
        served.close()
    finally:
        server.stop()


def test_postgres_reports_lock_their_trial_and_the_job_only_to_end_it(
        bso_databases: Callable[[str], str]) -> None:
    """While another transaction holds the job's row, a report that does not end its trial goes
    through; one that ends it waits for the job; expiry skips a trial whose row is held."""
    from sqlalchemy import text

    from joules.servers.batch_size import db as dbm
    from joules.servers.batch_size.schemas import EpochReport, JobCreate, TrialCreate
    from joules.servers.batch_size.service import BatchSizeService

    db = dbm.Database(bso_databases("postgresql"))
    dbm.upgrade(db)
    service = BatchSizeService(db)
    holder = db.engine.connect()
    try:
        job, _ = service.register(JobCreate.model_validate(spec(max_epochs=10, stale_after_s=1.0)))
        t1, _ = service.start_trial(job.job_id, TrialCreate())
        t2, _ = service.start_trial(job.job_id, TrialCreate())

        def report(trial: str, epoch: int, metric: float) -> threading.Thread:
            thread = threading.Thread(target=service.report, args=(job.job_id, trial, EpochReport(
                epoch=epoch, time_s=1.0, energy_j=100.0, metric=metric)))
            thread.start()
            return thread

        holder.execute(text("SELECT id FROM bso_jobs WHERE id = :j FOR UPDATE"), {"j": job.job_id})
        quiet = report(t1.trial_id, 1, 0.1)
        quiet.join(timeout=10)
        assert not quiet.is_alive()  # did not wait for the job's row
        ending = report(t1.trial_id, 2, 0.95)  # reaches the target: the policy must learn
        ending.join(timeout=0.5)
        assert ending.is_alive()  # waits for the job's row
        holder.rollback()
        ending.join(timeout=10)
        assert not ending.is_alive()
        assert service.trial(job.job_id, t1.trial_id).outcome == "reached"

        time.sleep(1.2)  # t2 is now stale; while its row is held, expiry leaves it alone
        holder.execute(text("SELECT id FROM bso_trials WHERE id = :t FOR UPDATE"), {"t": t2.trial_id})
        assert service.job_state(job.job_id).trials["running"] == 1
        holder.rollback()
        assert service.job_state(job.job_id).trials["running"] == 0
        assert service.trial(job.job_id, t2.trial_id).outcome == "aborted"
    finally:
        holder.close()
        db.dispose()


async def _request_threads() -> int:
    from anyio import to_thread

    return int(to_thread.current_default_thread_limiter().total_tokens)


def test_requests_take_as_many_threads_as_the_pool_keeps_connections(
        bso_backend: str, bso_databases: Callable[[str], str]) -> None:
    """One thread per pooled connection (SQLite 1, PostgreSQL 4), not the default 40."""
    from fastapi.testclient import TestClient

    from joules.servers.batch_size.app import create_app

    app = create_app(bso_databases(bso_backend), token=TOKEN)
    with TestClient(app) as c:
        threads = c.portal.call(_request_threads)  # type: ignore[union-attr]
        service = app.state.service
        assert threads == service.db.concurrency == {"sqlite": 1, "postgresql": 4}[bso_backend]
        # Twice as many concurrent reports as threads all get their answers.
        auth = {"Authorization": f"Bearer {TOKEN}"}
        job = c.post("/jobs", json=spec(), headers=auth).json()["job_id"]
        trials = [c.post(f"/jobs/{job}/trials", headers=auth).json()["trial_id"] for _ in range(2 * threads)]
        answers: list[int] = []

        def report(trial: str) -> None:
            r = c.post(f"/jobs/{job}/trials/{trial}/epochs", headers=auth,
                       json={"epoch": 1, "time_s": 1.0, "energy_j": 10.0, "metric": 0.1})
            answers.append(r.status_code)

        workers = [threading.Thread(target=report, args=(t,)) for t in trials]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=60)
        assert answers == [200] * len(trials)
