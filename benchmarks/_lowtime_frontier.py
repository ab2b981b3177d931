"""Run lowtime (Perseus' solver) on a pipeline profile and print its frontier as JSON.

Runs in ``.bench-venv`` (``pip install lowtime==0.3.0``); ``benchmarks/pipeline_frontier.py``
calls it. The DAG, cost model and solver are set up as in lowtime's own Perseus example
(``Synchronous1F1B`` instructions, one ``ExponentialModel`` per stage and instruction fitted
to the effective energy ``energy - p2p_power * time``, ``PhillipsDessouky``).

Usage: ``python _lowtime_frontier.py PROFILE.csv STAGES MICROBATCHES UNIT_TIME P2P_POWER``

Prints ``{"solve_time_s": ..., "iterations": ..., "plans": [...]}``, each plan mapping a stage
(as a string) to its ``[kind, microbatch, frequency]`` list in execution order.
The solve time covers the cost model fits and the solver; recording each iteration's
frequencies is excluded.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import sys
import time
from collections import defaultdict

import networkx as nx
from lowtime.cost_model import ExponentialModel
from lowtime.graph_utils import DependencyResolver, add_sink_node, add_source_node
from lowtime.operation import CandidateExecutionOptions, ExecutionOption, OperationSpec
from lowtime.perseus.instruction import (
    Backward,
    Forward,
    Instruction,
    backward_dep,
    forward_dep,
)
from lowtime.perseus.schedule import Synchronous1F1B
from lowtime.solver import PhillipsDessouky


def main() -> None:
    path, stages, mbs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    unit, p2p = float(sys.argv[4]), float(sys.argv[5])
    logging.disable(logging.CRITICAL)
    rows: dict[tuple[int, str], list[tuple[int, float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            key = (int(r["stage"]), r["instruction"])
            rows[key].append((int(r["frequency"]), float(r["time"]), float(r["energy"])))
    excluded = 0.0
    t0 = time.perf_counter()
    specs: dict[int, dict[type, OperationSpec]] = defaultdict(dict)
    for inst in (Forward, Backward):
        for s in range(stages):
            opts = [
                ExecutionOption[int](real_time=t, unit_time=unit, cost=e, knob=fr)
                for fr, t, e in rows[(s, inst.__name__.lower())]
            ]
            cand = CandidateExecutionOptions[int](options=opts)
            for o in cand.options:
                o.cost -= p2p * o.quant_time * o.unit_time
            specs[s][inst] = OperationSpec[int](options=cand, cost_model=ExponentialModel(cand))
    dag = nx.DiGraph()
    node_id = 2
    stage_nodes: list[list[Instruction]] = []
    for s in range(stages):
        ids = []
        insts = []
        schedule = Synchronous1F1B(num_stages=stages, num_micro_batches=mbs, stage_id=s,
                                   operation_spec_map=specs[s])
        for inst in schedule:
            dag.add_node(node_id, op=inst)
            ids.append(node_id)
            insts.append(inst)
            node_id += 1
        stage_nodes.append(insts)
        for a, b in zip(ids, ids[1:], strict=False):
            dag.add_edge(a, b)
    nodes = dag.nodes(data=True)
    resolver = DependencyResolver(dependency_rules=[forward_dep, backward_dep], node_type=Instruction)
    for (a, da), (b, db) in itertools.product(nodes, nodes):
        if resolver.is_dependent(da["op"], db["op"]):
            dag.add_edge(a, b)
    add_source_node(dag, 0)
    add_sink_node(dag, 1)
    dag.graph["source_node"] = 0
    dag.graph["sink_node"] = 1
    plans = []
    iterations = 0
    for _ in PhillipsDessouky(dag).run():
        t1 = time.perf_counter()
        iterations += 1
        plans.append({
            str(s): [["forward" if isinstance(i, Forward) else "backward", i.micro_batch_id,
                      int(i.assigned_knob)]
                     for i in insts]
            for s, insts in enumerate(stage_nodes)
        })
        excluded += time.perf_counter() - t1
    solve = time.perf_counter() - t0 - excluded
    print(json.dumps({"solve_time_s": solve, "iterations": iterations, "plans": plans}))


if __name__ == "__main__":
    main()
