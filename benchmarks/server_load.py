"""Batch-size optimizer server under load: epoch reports/s and latency, joules vs Zeus, SQLite and PostgreSQL.

``--clients`` concurrent clients (default 32, asyncio + httpx, one connection each) run
trials back to back: start a trial, report epochs until told to stop (the metric reaches the
target at epoch ``--epochs``), end the trial. Two scenarios: all clients on ONE job (every
request of the job is serialized by its row lock) and one job PER client. Measured over
``--duration`` seconds after ``--warmup``: epoch reports completed per second, their p50 and
p99 latency, and all requests per second. ``--repeat N`` measures everything N times, in
rounds (every server in turn, so that a slow spell of the machine touches all of them), and
reports each figure's median, with the range of reports/s.

Servers, each on a fresh database:

* joules: ``joules serve`` (this environment), 1 worker and ``--workers 2``;
* Zeus 0.16's batch-size optimizer server (``zeus.optimizer.batch_size.server.router:app``
  under uvicorn, one process: its per-job locks are asyncio locks of that process), from
  the virtual environment ``--zeus-venv`` (default ``.bench-venv/zeus-bso-server``), set up
  with::

      python3 -m venv .bench-venv/zeus-bso-server
      .bench-venv/zeus-bso-server/bin/pip install "zeus[bso-server]==0.16.0" aiosqlite asyncpg greenlet

  (a venv of its own: ``zeus[bso-server]`` pins pydantic<2, which joules cannot run with.)
  Its tables are created with ``Base.metadata.create_all`` (Zeus ships no migration
  versions). Left out, with the reason, when the venv is missing.

PostgreSQL: a temporary database on ``JOULES_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/test``); skipped when none answers.

Run: ``.venv/bin/python benchmarks/server_load.py`` (~4 min; ``--quick``: ~1.5 min).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from joules.testing.bso_server import (
    ServerProcess,
    postgres_available,
    temporary_postgres_database,
)
from joules.testing.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ZEUS_VENV = ROOT / ".bench-venv" / "zeus-bso-server"
BATCH_SIZES = [32, 64, 128, 256, 512]
TIME_PER_EPOCH_S, ENERGY_PER_EPOCH_J = 60.0, 12_000.0  # the same for every batch size: nobody stops early

ZEUS_CREATE_TABLES = """
import asyncio, sys
from sqlalchemy.ext.asyncio import create_async_engine
from zeus.optimizer.batch_size.server.database.schema import Base
async def main(url):
    engine = create_async_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    await engine.dispose()
asyncio.run(main(sys.argv[1]))
"""


# -- the two APIs ----------------------------------------------------------------------------

class JoulesApi:
    """joules' wire format (``joules.servers.batch_size.schemas``)."""

    name = "joules"

    async def register(self, c: httpx.AsyncClient, name: str, epochs: int) -> str:
        r = await c.post("/jobs", json={
            "name": name, "batch_sizes": BATCH_SIZES, "default_batch_size": 128, "target_metric": 1.0,
            "max_epochs": epochs + 5, "max_power_w": 300.0, "eta": 0.5, "beta": 2.0, "seed": 1})
        r.raise_for_status()
        return r.json()["job_id"]

    async def start(self, c: httpx.AsyncClient, job: str) -> tuple[httpx.Response, Any]:
        r = await c.post(f"/jobs/{job}/trials", json={"client": "bench"})
        return r, r.json()["trial_id"] if r.status_code < 300 else None

    async def report(self, c: httpx.AsyncClient, job: str, trial: Any, epoch: int, metric: float,
                     ) -> tuple[httpx.Response, bool]:
        r = await c.post(f"/jobs/{job}/trials/{trial}/epochs", json={
            "epoch": epoch, "time_s": TIME_PER_EPOCH_S, "energy_j": ENERGY_PER_EPOCH_J, "metric": metric})
        return r, r.status_code < 300 and r.json()["stop"]

    async def end(self, c: httpx.AsyncClient, job: str, trial: Any) -> httpx.Response:
        return await c.post(f"/jobs/{job}/trials/{trial}/end", json={"status": "completed"})


class ZeusApi:
    """Zeus 0.16's batch-size optimizer server (``zeus.optimizer.batch_size.common``)."""

    name = "Zeus"

    async def register(self, c: httpx.AsyncClient, name: str, epochs: int) -> str:
        r = await c.post("/jobs", json={
            "job_id": None, "job_id_prefix": name, "batch_sizes": BATCH_SIZES, "default_batch_size": 128,
            "eta_knob": 0.5, "beta_knob": 2.0, "target_metric": 1.0, "higher_is_better_metric": True,
            "max_epochs": epochs + 5, "num_pruning_rounds": 2, "window_size": 0, "mab_prior_mean": 0.0,
            "mab_prior_precision": 0.0, "mab_num_explorations": 2, "mab_seed": 1, "max_power": 300.0,
            "number_of_gpus": 1, "gpu_model": "A100"})
        r.raise_for_status()
        return r.json()["job_id"]

    async def start(self, c: httpx.AsyncClient, job: str) -> tuple[httpx.Response, Any]:
        r = await c.get("/jobs/batch_size", params={"job_id": job})
        return r, r.json() if r.status_code < 300 else None

    async def report(self, c: httpx.AsyncClient, job: str, trial: Any, epoch: int, metric: float,
                     ) -> tuple[httpx.Response, bool]:
        r = await c.post("/report", json={**trial, "time": TIME_PER_EPOCH_S * epoch,  # Zeus: totals so far
                                          "energy": ENERGY_PER_EPOCH_J * epoch, "metric": metric,
                                          "current_epoch": epoch})
        return r, r.status_code < 300 and r.json()["stop_train"]

    async def end(self, c: httpx.AsyncClient, job: str, trial: Any) -> httpx.Response:
        return await c.patch("/trials", json=trial)


# -- load ------------------------------------------------------------------------------------

@dataclass
class Result:
    """One server, backend and scenario under load."""

    server: str
    backend: str
    scenario: str
    reports_per_s: float = 0.0
    requests_per_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    errors: int = 0
    trials: int = 0
    client_cpu_s: float = 0.0
    note: str = ""
    error_samples: list[str] = field(default_factory=list)
    runs_reports_per_s: list[float] = field(default_factory=list)  # each run's, with --repeat


def median_result(runs: list[Result]) -> Result:
    """One result for several runs of one server, backend and scenario: medians (errors: their total)."""
    med = statistics.median
    first = runs[0]
    return Result(
        first.server, first.backend, first.scenario,
        reports_per_s=med(r.reports_per_s for r in runs), requests_per_s=med(r.requests_per_s for r in runs),
        p50_ms=med(r.p50_ms for r in runs), p99_ms=med(r.p99_ms for r in runs),
        errors=sum(r.errors for r in runs), trials=round(med(r.trials for r in runs)),
        client_cpu_s=med(r.client_cpu_s for r in runs),
        error_samples=[e for r in runs for e in r.error_samples][:5],
        runs_reports_per_s=[r.reports_per_s for r in runs])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


async def load(api: Any, url: str, headers: dict[str, str], jobs: list[str], clients: int, epochs: int,
               warmup_s: float, duration_s: float, result: Result) -> None:
    """Run the clients; fill ``result`` with what completed inside the measurement window."""
    start = time.perf_counter()
    begin, stop = start + warmup_s, start + warmup_s + duration_s
    report_lat: list[float] = []
    requests = [0]
    trials = [0]

    def count(r: httpx.Response, t0: float, t1: float, is_report: bool) -> None:
        if r.status_code >= 300:
            result.errors += 1
            if len(result.error_samples) < 5:
                result.error_samples.append(
                    f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:200]}")
        if begin <= t1 <= stop:
            requests[0] += 1
            if is_report and r.status_code < 300:
                report_lat.append(t1 - t0)

    async def client(i: int) -> None:
        job = jobs[i % len(jobs)]
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60.0, limits=limits) as c:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                r, trial = await api.start(c, job)
                count(r, t0, time.perf_counter(), False)
                if trial is None:
                    await asyncio.sleep(0.01)
                    continue
                for epoch in range(1, epochs + 1):
                    t0 = time.perf_counter()
                    r, done = await api.report(c, job, trial, epoch, epoch / epochs)
                    count(r, t0, time.perf_counter(), True)
                    if done or r.status_code >= 300 or time.perf_counter() >= stop:
                        break
                t0 = time.perf_counter()
                r = await api.end(c, job, trial)
                count(r, t0, time.perf_counter(), False)
                trials[0] += 1

    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*(client(i) for i in range(clients)))
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    result.reports_per_s = len(report_lat) / duration_s
    result.requests_per_s = requests[0] / duration_s
    result.p50_ms = percentile(report_lat, 50) * 1000
    result.p99_ms = percentile(report_lat, 99) * 1000
    result.trials = trials[0]
    result.client_cpu_s = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)


async def register_jobs(api: Any, url: str, headers: dict[str, str], n: int, epochs: int) -> list[str]:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60.0) as c:
        return [await api.register(c, f"bench-{uuid.uuid4().hex[:8]}", epochs) for _ in range(n)]


# -- servers ---------------------------------------------------------------------------------

class ZeusServer:
    """Zeus' server under uvicorn, in its own virtual environment."""

    def __init__(self, venv: Path, db_url: str, log: Path) -> None:
        self.python = venv / "bin" / "python"
        self.db_url = db_url
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ZeusServer:
        subprocess.run([str(self.python), "-c", ZEUS_CREATE_TABLES, self.db_url], check=True,
                       capture_output=True, timeout=120)
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZEUS_")}
        env.update(ZEUS_BSO_DATABASE_URL=self.db_url, ZEUS_BSO_LOG_LEVEL="WARN", ZEUS_BSO_ECHO_SQL="false")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(self.python), "-m", "uvicorn", "zeus.optimizer.batch_size.server.router:app",
                 "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir(),
                start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Zeus' server exited: {self.log.read_text()[-2000:]}")
            try:
                httpx.get(f"{self.url}/docs", timeout=1.0)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("Zeus' server did not start in 60 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def zeus_problem(venv: Path) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return f"no Zeus server environment at {venv} (see this script's docstring to set it up)"
    env = {**os.environ, "ZEUS_BSO_DATABASE_URL": "sqlite+aiosqlite:///:memory:"}
    r = subprocess.run([str(python), "-c", "import zeus.optimizer.batch_size.server.router, aiosqlite"],
                       capture_output=True, text=True, timeout=120, env=env)
    if r.returncode != 0:
        return f"Zeus' server does not import in {venv}: {r.stderr.strip().splitlines()[-1]}"
    return None


@contextlib.contextmanager
def database(backend: str, tmp: Path, async_driver: bool) -> Iterator[str]:
    if backend == "sqlite":
        path = tmp / f"{uuid.uuid4().hex[:8]}.sqlite"
        yield f"sqlite+aiosqlite:///{path}" if async_driver else f"sqlite:///{path}"
        return
    with temporary_postgres_database("joules_bench") as url:
        yield url.replace("postgresql+psycopg://", "postgresql+asyncpg://") if async_driver else url


# -- main ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> list[Result]:
    console = Console(width=150)
    backends = ["sqlite"]
    pg = postgres_available()
    if pg is None:
        backends.append("postgresql")
    else:
        console.print(f"[yellow]PostgreSQL left out: {pg}")
    zeus = zeus_problem(args.zeus_venv)
    if zeus is not None:
        console.print(f"[yellow]Zeus left out: {zeus}")
    servers: list[tuple[str, int]] = [("joules", 1), ("joules", 2)] + ([] if zeus else [("Zeus", 1)])
    scenarios = [("one job", 1), (f"{args.clients} jobs", args.clients)]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="joules-server-load-") as tmpdir:
        tmp = Path(tmpdir)
        # Rounds of every server in turn, so that a slow spell of the machine is shared.
        for round_ in range(args.repeat):
            if args.repeat > 1:
                console.print(f"round {round_ + 1} of {args.repeat}")
            results += one_round(args, console, tmp, backends, servers, scenarios)
    groups: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.server, r.backend, r.scenario), []).append(r)
    return [median_result(runs) for runs in groups.values()]


def one_round(args: argparse.Namespace, console: Console, tmp: Path, backends: list[str],
              servers: list[tuple[str, int]], scenarios: list[tuple[str, int]]) -> list[Result]:
    """Every server, backend and scenario once, each server on a fresh database."""
    results: list[Result] = []
    for backend in backends:
        for kind, workers in servers:
            label = kind if kind == "Zeus" else f"joules ({workers} worker{'s' if workers > 1 else ''})"
            with database(backend, tmp, async_driver=kind == "Zeus") as db_url:
                if kind == "Zeus":
                    server: Any = ZeusServer(args.zeus_venv, db_url, tmp / "zeus.log").start()
                    api: Any = ZeusApi()
                    headers: dict[str, str] = {}
                else:
                    server = ServerProcess(db_url, tmp / "joules.log", workers=workers, token="bench")
                    server.start()
                    api = JoulesApi()
                    headers = server.headers
                try:
                    for scenario, n_jobs in scenarios:
                        result = Result(label, backend, scenario)
                        jobs = asyncio.run(register_jobs(api, server.url, headers, n_jobs, args.epochs))
                        asyncio.run(load(api, server.url, headers, jobs, args.clients, args.epochs,
                                         args.warmup, args.duration, result))
                        results.append(result)
                        console.print(f"{backend:10} {label:20} {scenario:8}: "
                                      f"{result.reports_per_s:7.0f} reports/s,"
                                      f" p50 {result.p50_ms:6.1f} ms, p99 {result.p99_ms:6.1f} ms,"
                                      f" {result.errors} errors, client CPU {result.client_cpu_s:.1f} s")
                        for sample in result.error_samples:
                            console.print(f"  [red]{sample}")
                finally:
                    server.stop()
    return results


def table(results: list[Result], clients: int) -> Table:
    labels = list(dict.fromkeys(r.server for r in results))
    t = Table(title=f"Batch-size optimizer server: {clients} concurrent clients, epoch reports")
    t.add_column("database")
    t.add_column("jobs")
    for label in labels:
        t.add_column(f"{label}\nreports/s", justify="right")
        t.add_column(f"{label}\np50 / p99 ms", justify="right")
    for key in dict.fromkeys((r.backend, r.scenario) for r in results):
        row = [key[0], key[1]]
        for label in labels:
            r = next((x for x in results if (x.backend, x.scenario, x.server) == (*key, label)), None)
            if r is None:
                row += ["—", "—"]
            else:
                err = f" ({r.errors} err)" if r.errors else ""
                spread = (f" ({min(r.runs_reports_per_s):.0f}-{max(r.runs_reports_per_s):.0f})"
                          if len(r.runs_reports_per_s) > 1 else "")
                row += [f"{r.reports_per_s:.0f}{spread}{err}", f"{r.p50_ms:.1f} / {r.p99_ms:.1f}"]
        t.add_row(*row)
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32, help="default: %(default)s")
    ap.add_argument("--epochs", type=int, default=10, help="epochs per trial; default: %(default)s")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds; default: %(default)s")
    ap.add_argument("--warmup", type=float, default=2.0,
                    help="seconds before measuring; default: %(default)s")
    ap.add_argument("--zeus-venv", type=Path, default=DEFAULT_ZEUS_VENV, help="default: %(default)s")
    ap.add_argument("--quick", action="store_true", help="3 s per run after 1 s of warm-up")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="run every measurement N times, in rounds, and report medians; default: %(default)s")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup = 3.0, 1.0
    results = run(args)
    Console(width=150).print(table(results, args.clients))
    if args.json:
        args.json.write_text(json.dumps({
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "platform": platform.platform()},
            "settings": {k: str(v) for k, v in vars(args).items()},
            "results": [asdict(r) for r in results],
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
