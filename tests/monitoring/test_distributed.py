"""Combining measurements across torch.distributed ranks.

Run as a script (``python test_distributed.py --launch WORLD PORT OUTDIR``), this file also
starts the ranks of the real multi-process test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from joules.monitoring.distributed import collect, combine, gather, per_host
from joules.monitoring.measurement import DeviceEnergy, Measurement, Source
from joules.testing.processes import free_port, run_forked

UUID_A = "GPU-aaaa"
UUID_B = "GPU-bbbb"
UUID_C = "GPU-cccc"


def dev(energy: float, device_id: str, unc: float = 0.0) -> DeviceEnergy:
    return DeviceEnergy(energy, Source.COUNTER, unc, False, device_id)


def meas(
    host: str,
    gpu: dict[int, tuple[float, str]],
    cpu: dict[int, float] | None = None,
    dram: dict[int, float] | None = None,
    start: float = 10.0,
    elapsed: float = 2.0,
    name: str = "step",
) -> Measurement:
    cpu = cpu or {}
    dram = dram or {}
    return Measurement(
        name=name,
        start_time=start,
        elapsed_s=elapsed,
        gpu={k: dev(e, uid) for k, (e, uid) in gpu.items()},
        cpu={k: dev(e, f"{host}/cpu{k}") for k, e in cpu.items()},
        dram={k: dev(e, f"{host}/dram{k}") for k, e in dram.items()},
        host=host,
    )


# -- combine ---------------------------------------------------------------------------------


def test_two_ranks_one_host_count_cpu_and_dram_once():
    # Both ranks read the same two sockets; their readings differ a little (own windows).
    r0 = meas("n0", {0: (300.0, UUID_A)}, cpu={0: 100.0, 1: 90.0}, dram={0: 20.0, 1: 18.0})
    r1 = meas("n0", {1: (250.5, UUID_B)}, cpu={0: 100.5, 1: 90.25}, dram={0: 20.5, 1: 18.5})
    c = combine([r0, r1])
    assert c.gpu_energy_j == {0: 300.0, 1: 250.5}
    assert [d.device_id for d in c.gpu.values()] == [UUID_A, UUID_B]
    assert c.cpu_energy_j == {0: 100.0, 1: 90.0}  # rank 0's reading, once
    assert [d.device_id for d in c.cpu.values()] == ["n0/cpu0", "n0/cpu1"]
    assert c.dram_energy_j == {0: 20.0, 1: 18.0}
    assert c.total_energy_j == 300.0 + 250.5 + 100.0 + 90.0 + 20.0 + 18.0
    assert c.host == "n0"
    assert c.name == "step"


def test_two_hosts_count_cpu_per_host():
    # Same GPU UUID on both hosts (e.g. index-derived ids): different hosts, different devices.
    r0 = meas("n0", {0: (300.0, UUID_A)}, cpu={0: 100.0}, dram={0: 20.0})
    r1 = meas("n1", {0: (200.0, UUID_A)}, cpu={0: 80.0}, dram={0: 16.0})
    c = combine([r0, r1])
    assert c.gpu_energy_j == {0: 300.0, 1: 200.0}
    assert c.cpu_energy_j == {0: 100.0, 1: 80.0}
    assert [d.device_id for d in c.cpu.values()] == ["n0/cpu0", "n1/cpu0"]
    assert c.dram_energy_j == {0: 20.0, 1: 16.0}
    assert c.total_energy_j == 300.0 + 200.0 + 100.0 + 80.0 + 20.0 + 16.0
    assert c.host == "n0,n1"


def test_gpu_measured_by_two_ranks_counted_once():
    # Rank 1 sees both GPUs and measures both; GPU A is also rank 0's.
    r0 = meas("n0", {0: (300.0, UUID_A)}, cpu={0: 100.0})
    r1 = meas("n0", {0: (301.0, UUID_A), 1: (250.0, UUID_B)}, cpu={0: 100.0})
    c = combine([r0, r1])
    assert c.gpu_energy_j == {0: 300.0, 1: 250.0}  # rank 0's reading of A
    assert [d.device_id for d in c.gpu.values()] == [UUID_A, UUID_B]
    assert c.total_energy_j == 300.0 + 250.0 + 100.0


def test_keys_renumbered_in_host_then_rank_order():
    ranks = [
        meas("nB", {0: (1.0, UUID_A)}, cpu={0: 10.0}),
        meas("nA", {0: (2.0, UUID_B)}, cpu={0: 20.0}),
        meas("nB", {0: (3.0, UUID_C)}, cpu={0: 10.5}),
        meas("nA", {0: (4.0, UUID_C)}, cpu={0: 20.5}),
    ]
    c = combine(ranks)
    # Hosts in order of their first rank (nB: rank 0, nA: rank 1), then ranks in order.
    assert c.gpu_energy_j == {0: 1.0, 1: 3.0, 2: 2.0, 3: 4.0}
    assert [d.device_id for d in c.gpu.values()] == [UUID_A, UUID_C, UUID_B, UUID_C]
    assert c.cpu_energy_j == {0: 10.0, 1: 20.0}
    assert c.host == "nB,nA"


def test_a_combined_total_combines_again_without_counting_a_device_twice_or_dropping_one():
    # Two subgroups' totals (as gathered with group=), then the total of those: a GPU and a
    # host's CPU that both subgroups saw count once, and GPUs whose ids repeat across hosts
    # (index-derived, as the simulator's) all count.
    ranks = [
        meas("n0", {0: (100.0, UUID_A)}, cpu={0: 10.0}),
        meas("n0", {0: (100.0, UUID_A)}, cpu={0: 10.0}),  # another rank seeing the same GPU
        meas("n1", {0: (200.0, UUID_C)}, cpu={0: 20.0}),
        meas("n0", {0: (50.0, UUID_C)}, cpu={0: 10.0}),
    ]
    flat = combine(ranks)
    hierarchical = combine([combine([ranks[0], ranks[2]]), combine([ranks[1], ranks[3]])])
    assert flat.total_energy_j == hierarchical.total_energy_j == 100 + 200 + 50 + 10 + 20
    assert sorted(d.energy_j for d in hierarchical.gpu.values()) == [50.0, 100.0, 200.0]
    assert combine([flat]).total_energy_j == flat.total_energy_j
    again = Measurement.from_dict(json.loads(json.dumps(flat.to_dict())))  # via a log
    assert again == flat and combine([again, ranks[0]]).total_energy_j == flat.total_energy_j
    # A subgroup total written before entries recorded their host: its CPU packages are still
    # told by their ids (they were counted twice, under the joined host names).
    # (Here two GPUs on each host, one per subgroup.)
    ranks[1] = meas("n0", {0: (100.0, UUID_B)}, cpu={0: 10.0})
    old = combine([ranks[0], ranks[2]]).to_dict()
    for zone in ("gpu", "cpu", "dram"):
        for entry in old[zone].values():
            entry.pop("host", None)
    older = Measurement.from_dict(json.loads(json.dumps(old)))
    assert combine([older, combine([ranks[1], ranks[3]])]).total_energy_j == combine(ranks).total_energy_j


def test_uncertainty_and_sources_kept_per_device():
    r0 = Measurement("w", 0.0, 1.0, gpu={0: DeviceEnergy(10.0, Source.SAMPLED, 0.5, True, UUID_A)}, host="h")
    r1 = Measurement(
        "w", 0.0, 1.0, gpu={0: DeviceEnergy(20.0, Source.COUNTER, 0.25, False, UUID_B)}, host="h"
    )
    c = combine([r0, r1])
    assert c.uncertainty_j == 0.75
    assert c.sources == {"gpu0": "sampled+corrected", "gpu1": "counter"}


def test_elapsed_is_span_per_host_by_default():
    ranks = [
        meas("n0", {}, start=2.0, elapsed=3.0),  # [2, 5]
        meas("n0", {}, start=2.25, elapsed=3.5),  # [2.25, 5.75]
        meas("n1", {}, start=1002.0, elapsed=4.0),  # other node's monotonic clock
        meas("n1", {}, start=1002.25, elapsed=4.5),  # [1002.25, 1006.75]
    ]
    c = combine(ranks)
    assert c.elapsed_s == 4.75  # longest per-host span
    assert c.start_time == 2.0  # on the first host's clock
    shared = combine(ranks, shared_clock=True)
    assert shared.start_time == 2.0
    assert shared.elapsed_s == 1006.75 - 2.0
    one_host = combine(ranks[:2], shared_clock=True)
    assert one_host.elapsed_s == combine(ranks[:2]).elapsed_s == 3.75


def test_average_power_uses_combined_span():
    c = combine(
        [
            meas("n0", {0: (30.0, UUID_A)}, start=0.0, elapsed=2.0),
            meas("n0", {0: (30.0, UUID_B)}, start=1.0, elapsed=2.0),
        ]
    )
    assert c.elapsed_s == 3.0
    assert c.average_power_w == 20.0


def test_empty_and_bad_inputs():
    with pytest.raises(ValueError, match="at least one Measurement"):
        combine([])
    with pytest.raises(ValueError, match="at least one Measurement"):
        per_host([])
    with pytest.raises(TypeError, match="item 1 is a dict"):
        combine([meas("n0", {}), {"name": "x"}])  # type: ignore[list-item]


def test_mismatched_names_warn_unless_name_given():
    a = meas("n0", {0: (1.0, UUID_A)}, name="fwd")
    b = meas("n0", {0: (2.0, UUID_B)}, name="bwd")
    with pytest.warns(UserWarning, match="different names"):
        c = combine([a, b])
    assert c.name == "fwd+bwd"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert combine([a, b], name="step").name == "step"
        assert combine([a, a]).name == "fwd"


def test_devices_without_id():
    # GPU indices are per process: without an id two GPUs are never taken for one.
    # CPU packages are numbered alike by all processes of a host: the index identifies them.
    r0 = Measurement("w", 0.0, 1.0, gpu={0: dev(5.0, "")}, cpu={0: dev(7.0, "")}, host="h")
    r1 = Measurement("w", 0.0, 1.0, gpu={0: dev(6.0, "")}, cpu={0: dev(7.5, "")}, host="h")
    c = combine([r0, r1])
    assert c.gpu_energy_j == {0: 5.0, 1: 6.0}
    assert c.cpu_energy_j == {0: 7.0}
    # Renumbered in a total of two hosts, a package keeps its identity: combined again with
    # a rank that the total already holds, it still counts once.
    r2 = Measurement("w", 0.0, 1.0, cpu={0: dev(80.0, "")}, host="g")
    r2b = Measurement("w", 0.0, 1.0, cpu={0: dev(80.5, "")}, host="g")
    total = combine([r0, r2])
    assert total.cpu[1].device_id == "g/cpu0"
    assert combine([total, r2b]).total_energy_j == combine([r0, r2, r2b]).total_energy_j == 5.0 + 87.0


def test_per_host_breakdown():
    ranks = [
        meas("n0", {0: (300.0, UUID_A)}, cpu={0: 100.0}, start=0.0, elapsed=2.0),
        meas("n0", {1: (250.0, UUID_B)}, cpu={0: 101.0}, start=0.5, elapsed=2.0),
        meas("n1", {0: (200.0, UUID_A)}, cpu={0: 80.0}, start=50.0, elapsed=1.0),
    ]
    hosts = per_host(ranks)
    assert list(hosts) == ["n0", "n1"]
    assert hosts["n0"].gpu_energy_j == {0: 300.0, 1: 250.0}
    assert hosts["n0"].cpu_energy_j == {0: 100.0}
    assert hosts["n0"].elapsed_s == 2.5
    assert hosts["n1"].gpu_energy_j == {0: 200.0}
    assert hosts["n1"].elapsed_s == 1.0
    assert sum(m.total_energy_j for m in hosts.values()) == combine(ranks).total_energy_j


def test_combined_round_trips_through_dict():
    c = combine(
        [
            meas("n0", {0: (1.5, UUID_A)}, cpu={0: 2.0}, dram={0: 0.5}),
            meas("n1", {0: (2.5, UUID_A)}, cpu={0: 3.0}, dram={0: 0.25}),
        ]
    )
    assert Measurement.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# -- gather without a process group ----------------------------------------------------------


def test_gather_without_initialized_process_group_returns_measurement():
    m = meas("n0", {0: (1.0, UUID_A)})
    assert gather(m) is m
    assert gather(m, dst=0) is m
    assert collect(m) == [m]


def test_gather_without_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    m = meas("n0", {0: (1.0, UUID_A)})
    assert gather(m) is m
    with pytest.raises(ImportError, match="torch is not installed"):
        gather(m, group=object())


# -- real processes: 2 hosts x 2 ranks, gloo over 127.0.0.1 -----------------------------------

WORLD = 2 * 2
WARMUP_S = 2.0


def _window(rank: int) -> tuple[float, float]:
    """(delay before begin, duration) of rank's window: windows overlap but differ."""
    return 0.25 * (rank % 2), 3.0 + 0.5 * rank


def _worker(rank: int, world: int, port: int, out: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from joules.clock import VirtualClock
    from joules.devices.sim import Constant, Simulator
    from joules.monitoring.monitor import EnergyMonitor

    node, local_rank = divmod(rank, 2)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        # Each "node" has its own host name and its own monotonic clock origin.
        host = f"node{node}"
        socket.gethostname = lambda: host  # read by EnergyMonitor
        sim = Simulator("A100x2,XEON6248", clock=VirtualClock(start=1000.0 * node))
        sim.set_workload(Constant(0.3 + 0.4 * node), gpus=False)  # node-wide CPU load
        sim.gpus[local_rank].set_workload(Constant(0.2 + 0.2 * rank))  # this rank's GPU
        mon = EnergyMonitor(gpu_indices=[local_rank], devices=sim.devices())
        sim.advance(WARMUP_S)
        delay, duration = _window(rank)
        sim.advance(delay)
        mon.begin_window("train")
        sim.advance(duration)
        m = mon.end_window("train")
        mon.close()

        everyone = gather(m)
        at_zero = gather(m, dst=0)
        (out / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "measurement": m.to_dict(),
                    "all": everyone.to_dict() if everyone is not None else None,
                    "dst_is_none": at_zero is None,
                }
            )
        )
        if rank == 0:
            assert at_zero is not None
            (out / "combined.json").write_text(json.dumps(at_zero.to_dict()))
    finally:
        dist.destroy_process_group()


def _launch(world: int, port: int, out: Path) -> int:
    import torch.distributed  # noqa: F401 - imported once here, inherited by every rank

    return run_forked(_worker, [(r, world, port, out) for r in range(world)], timeout_s=45)


def _run_world(tmp_path: Path) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "JOULES_SIM": ""}
    for _attempt in range(2):  # a second try in case another process took the free port
        cmd = [sys.executable, __file__, "--launch", str(WORLD), str(free_port()), str(tmp_path)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
        if proc.returncode == 0:
            return
    pytest.fail(f"distributed workers failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def test_gather_across_real_processes(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("torch.distributed")
    _run_world(tmp_path)

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    per_rank = [Measurement.from_dict(d["measurement"]) for d in ranks]
    combined = Measurement.from_dict(json.loads((tmp_path / "combined.json").read_text()))

    # Each rank measured its own GPU, both sockets' package and DRAM of its "node".
    for r, m in enumerate(per_rank):
        assert m.host == f"node{r // 2}"
        assert list(m.gpu) == [r % 2]
        assert len(m.cpu) == 1 and len(m.dram) == 1
        assert m.cpu[0].device_id == f"node{r // 2}/cpu0"
    # GPU energies differ per rank (own workload); a node's two ranks read its CPU over other windows.
    assert len({m.gpu_energy_j[r % 2] for r, m in enumerate(per_rank)}) == WORLD

    # Ground truth: all four GPUs, the package and DRAM of each node counted once (first rank).
    # (each entry of a multi-host total records its host, so that it can be combined again)
    gpu_truth = [replace(per_rank[r].gpu[r % 2], host=f"node{r // 2}") for r in range(WORLD)]
    cpu_truth = [replace(per_rank[r].cpu[0], host=f"node{r // 2}") for r in (0, 2)]
    dram_truth = [replace(per_rank[r].dram[0], host=f"node{r // 2}") for r in (0, 2)]
    assert combined.gpu == dict(enumerate(gpu_truth))
    assert combined.cpu == dict(enumerate(cpu_truth))
    assert combined.dram == dict(enumerate(dram_truth))
    expected_total = sum(d.energy_j for d in gpu_truth + cpu_truth + dram_truth)
    assert combined.total_energy_j == pytest.approx(expected_total, rel=1e-12)
    naive = sum(m.total_energy_j for m in per_rank)
    assert naive - combined.total_energy_j == pytest.approx(
        per_rank[1].cpu_energy_j[0]
        + per_rank[1].dram_energy_j[0]
        + per_rank[3].cpu_energy_j[0]
        + per_rank[3].dram_energy_j[0],
        rel=1e-12,
    )

    # Elapsed: longest per-node span on each node's own clock (origins 1000 s apart).
    spans = []
    for node in range(2):
        ms = per_rank[2 * node : 2 * node + 2]
        spans.append(max(m.start_time + m.elapsed_s for m in ms) - min(m.start_time for m in ms))
    assert combined.elapsed_s == max(spans)
    expected_spans = []
    for node in range(2):
        (d0, t0), (d1, t1) = _window(2 * node), _window(2 * node + 1)
        expected_spans.append(max(d0 + t0, d1 + t1) - min(d0, d1))
    assert spans == pytest.approx(expected_spans, abs=1e-9)
    assert combined.start_time == pytest.approx(WARMUP_S, abs=1e-9)
    assert combined.name == "train"
    assert combined.host == "node0,node1"

    # all_gather gives every rank the same total; gather to dst=0 gives None elsewhere.
    for r, d in enumerate(ranks):
        assert Measurement.from_dict(d["all"]) == combined
        assert d["dst_is_none"] == (r != 0)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--launch":
    sys.exit(_launch(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])))


def test_devices_left_out_by_ranks_are_named_once_and_only_if_no_rank_measured_them():
    """A CPU package one rank could not read but another measured was named missing while
    counted; two ranks' own GPU 0, both unreadable, were one "gpu0"."""
    r0 = replace(meas("n1", {}, cpu={0: 950.0}), missing=())
    r1 = replace(meas("n1", {}), missing=("cpu0",))  # the same package, unread by this rank
    r2 = replace(meas("n1", {0: (1000.0, UUID_A)}), missing=())
    r3 = replace(meas("n1", {}), missing=("gpu0",))
    r4 = replace(meas("n1", {}), missing=("gpu0", "dram0"))
    total = combine([r0, r1, r2, r3, r4])
    assert total.cpu_energy_j == {0: 950.0} and total.total_energy_j == 1950.0
    assert total.missing == ("n1/3/gpu0", "n1/4/gpu0", "n1/dram0")
    assert combine([total]).missing == total.missing  # combined again: as they are
    # Subgroups' totals combined: a package one subgroup could not read and the other measured.
    unread = combine([replace(meas("n1", {}), missing=("cpu0",))])
    assert unread.missing == ("n1/cpu0",)
    assert combine([unread, combine([r0])]).missing == ()
