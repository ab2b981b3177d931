"""Run Zeus' original NSDI'23 trace simulator (``zeus._legacy``) on one job; print JSON.

Run by ``benchmarks/recurring.py`` with ``.bench-venv/bin/python`` (Zeus 0.16 lives there):

    .bench-venv/bin/python benchmarks/_zeus_recurring.py '{"traces": DIR, "gpu": "v100", ...}'

The argument is one JSON object: ``traces``, ``gpu``, ``dataset``, ``network``, ``optimizer``,
``target_metric``, ``max_epochs``, ``default_batch_size``, ``eta``, ``beta``, ``recurrences``
(``null``: Zeus' own 2 x |B| x |P|) and ``seeds`` (a list). For each seed, Zeus is set up as
its own ``run_single.py`` example does: ``PruningGTSBatchSizeOptimizer(seed=seed)``,
``JITPowerLimitOptimizer()``, ``Simulator(train, power, bso, plo, seed=seed)`` and
``simulate_one_job(job, recurrences, beta, eta)``. Totals over the returned history (every
trial that ran) are printed as one JSON line: ``{"seed": {"energy_j", "time_s", "cost",
"trials", "recurrences", "wall_s"}}``, the cost being Zeus' own ``zeus_cost`` with the
simulator's max power.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import time
from pathlib import Path

import pandas as pd
from zeus._legacy.job import Job
from zeus._legacy.policy import JITPowerLimitOptimizer, PruningGTSBatchSizeOptimizer
from zeus._legacy.simulate import Simulator
from zeus.utils.metric import zeus_cost


def main() -> int:
    args = json.loads(sys.argv[1])
    traces = Path(args["traces"])
    train = pd.read_csv(traces / "summary_train.csv")
    power = pd.read_csv(traces / f"summary_power_{args['gpu']}.csv")
    job = Job(args["dataset"], args["network"], args["optimizer"], float(args["target_metric"]),
              int(args["max_epochs"]), int(args["default_batch_size"]))
    out = {}
    for seed in args["seeds"]:
        t0 = time.perf_counter()
        sim = Simulator(train, power, PruningGTSBatchSizeOptimizer(seed=seed, verbose=False),
                        JITPowerLimitOptimizer(verbose=False), seed=seed, verbose=False)
        n = args["recurrences"]
        if n is None:
            rows = job.filter_df(sim.df)
            n = 2 * rows.batch_size.nunique() * rows.power_limit.nunique()
        # Zeus prints some messages even when not verbose.
        with contextlib.redirect_stdout(io.StringIO()):
            history = sim.simulate_one_job(job, n, args["beta"], args["eta"])
        max_power = float(sim.df.power_limit.max())
        energy = float(sum(h.energy for h in history))
        time_s = float(sum(h.time for h in history))
        out[str(seed)] = {
            "energy_j": energy,
            "time_s": time_s,
            "cost": zeus_cost(energy, time_s, args["eta"], max_power),
            "trials": len(history),
            "recurrences": int(n),
            "max_power_w": max_power,
            "wall_s": time.perf_counter() - t0,
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
