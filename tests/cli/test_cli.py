"""The joules command line, through its real entry points."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from joules.cli import main
from joules.cli.demo import run_demo
from joules.devices.base import DeviceSet
from joules.testing.processes import sim_child_env

JOULES = str(Path(sys.executable).parent / "joules")


def joules(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([JOULES, *args], capture_output=True, text=True, timeout=timeout)


def test_info_json_lists_simulated_devices() -> None:
    r = joules("info", "--json", "--sim", "A100x2,EPYC7763")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backend"] == "sim:A100x2,EPYC7763"
    assert [g["name"] for g in info["gpus"]] == ["NVIDIA A100-SXM4-40GB"] * 2
    assert info["gpus"][0]["power_limit_range_w"] == [100.0, 400.0]
    assert info["gpus"][0]["energy_counter"] is True
    assert info["cpus"][0]["dram"] is False  # AMD packages have no DRAM zone


def test_info_times_a_counter_read_and_shows_milliseconds_where_it_is_slow() -> None:
    from joules.cli.info import counter_read_us, render
    from joules.devices.nvidia import discover_nvml
    from joules.devices.sim import Simulator
    from joules.testing import fake_pynvml

    r = joules("info", "--json", "--sim", "A100,P100")
    gpus = json.loads(r.stdout)["gpus"]
    assert 0 < gpus[0]["energy_counter_read_us"] < 1000 and gpus[1]["energy_counter_read_us"] is None
    sim = Simulator("H100,nocpu")
    with fake_pynvml.installed(sim, call_latency_s=0.003):  # as slow as an H200's counter
        gpus, _ = discover_nvml({})
        assert counter_read_us(gpus[0]) >= 3000
        console = Console(record=True, width=200)
        render(DeviceSet(gpus=gpus, cpus=[], clock=sim.clock), console)
    assert re.search(r"yes \(read [34]\.\d ms\)", console.export_text())


def test_info_reports_problem_with_fix_for_gpu_without_counter() -> None:
    r = joules("info", "--json", "--sim", "P100")
    problems = json.loads(r.stdout)["problems"]
    assert any("no energy counter" in p["message"] and p["fix"] for p in problems)


def test_info_without_hardware_lists_problems(capsys: pytest.CaptureFixture[str]) -> None:
    # This machine (and CI) has no GPU and no RAPL: info still works and says why.
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    if not info["gpus"]:
        assert info["problems"], "no GPU found must come with a reason"


def test_measure_json_reports_energy_per_device() -> None:
    r = joules("measure", "--json", "--sim", "H100", "--", sys.executable, "-c",
               "import time; time.sleep(0.4)")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"command", "exit_code", "time_s", "gpu_energy_j", "cpu_energy_j",
                        "dram_energy_j", "total_energy_j", "uncertainty_j", "sources", "missing"}
    assert out["exit_code"] == 0 and out["missing"] == []
    assert 0.4 <= out["time_s"] < 3.0
    # An idle simulated H100 draws 70 W; the Xeon 8480 package 95 W and its DRAM 12 W.
    assert out["gpu_energy_j"]["0"] == pytest.approx(70 * out["time_s"], rel=0.25)
    assert out["cpu_energy_j"]["0"] == pytest.approx(95 * out["time_s"], rel=0.1)
    assert out["dram_energy_j"]["0"] == pytest.approx(12 * out["time_s"], rel=0.1)
    assert out["total_energy_j"] == pytest.approx(
        out["gpu_energy_j"]["0"] + out["cpu_energy_j"]["0"] + out["dram_energy_j"]["0"])
    assert out["sources"]["gpu0"].startswith("counter")


def test_measure_table_goes_to_stderr_and_exit_code_passes_through() -> None:
    r = joules("measure", "--sim", "A100", "--", "sh", "-c", "echo child-output; exit 3")
    assert r.returncode == 3
    assert r.stdout == "child-output\n"
    assert "GPU 0" in r.stderr and "total" in r.stderr


def table_rows(text: str) -> dict[str, list[str]]:
    """The body rows of a rich table in ``text``: first cell -> the other cells."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("\u2502")[1:-1]]
        if len(cells) == 5 and cells[0] and cells[0] != "device":
            rows[cells[0]] = cells[1:]
    return rows


def check_energy_table(text: str, idle_w: dict[str, float]) -> float:
    """The energy table's numbers agree with each other and with the idle powers; its time, s."""
    rows = table_rows(text)
    assert set(rows) == {*idle_w, "total"}, text
    seconds = float(rows["total"][3].removeprefix("time ").removesuffix(" s"))
    for name, watts in idle_w.items():
        energy, bound, power, source = rows[name]
        assert float(power) == pytest.approx(watts, rel=0.1), (name, text)
        assert float(energy) == pytest.approx(float(power) * seconds, rel=0.01, abs=0.01), (name, text)
        assert 0 <= float(bound) < 0.2 * float(energy) and source == "counter", (name, text)
    for column, digit in enumerate((0.01, 0.01, 0.1)):  # energy, bound, power: they add up, as printed
        parts = sum(float(rows[name][column]) for name in idle_w)
        assert float(rows["total"][column]) == pytest.approx(parts, abs=0.6 * digit * len(idle_w)), text
    return seconds


def test_measure_table_numbers_add_up_and_match_the_devices() -> None:
    r = joules("measure", "--sim", "A100", "--", "sh", "-c", "sleep 0.5")
    assert r.returncode == 0, r.stderr
    # An idle simulated A100 draws 55 W; the Xeon 8480 package 95 W and its DRAM 12 W.
    seconds = check_energy_table(r.stderr, {"GPU 0": 55.0, "CPU 0": 95.0, "DRAM 0": 12.0})
    assert 0.5 <= seconds < 3.0


def test_power_table_numbers_add_up_and_match_the_devices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["power", "--sim", "V100", "--interval", "0.1", "--duration", "0.35"]) == 0
    out = capsys.readouterr().out
    readings = [line for line in out.splitlines() if line.endswith(" W")]
    assert len(readings) >= 2 and all("gpu0 40.0 W" in line for line in readings), out  # idle V100
    seconds = check_energy_table(out, {"GPU 0": 40.0, "CPU 0": 95.0, "DRAM 0": 12.0})
    assert seconds == pytest.approx(0.35, abs=0.2)


def test_measure_command_killed_by_signal() -> None:
    r = joules("measure", "--sim", "A100", "--", "sh", "-c", "kill -TERM $$")
    assert r.returncode == 128 + 15


def test_measure_cpus_none_and_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "runs.csv"
    code = main(["measure", "--sim", "A100x2", "--json", "--gpus", "1", "--cpus", "none",
                 "--log", str(log), "--", "true"])
    assert code == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out["gpu_energy_j"]) == ["1"]
    assert out["cpu_energy_j"] is None and out["dram_energy_j"] is None
    lines = log.read_text().splitlines()
    assert lines[0].startswith("name,host,start_time,elapsed_s,total_energy_j")
    assert len(lines) == 2 and "gpu1_energy_j" in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["measure", "--sim", "A100"], "no command given"),
        (["measure", "--sim", "A100", "--gpus", "5", "--", "true"], "GPU index 5 not found"),
        (["measure", "--sim", "A100", "--gpus", "a,b", "--", "true"], "bad GPU list"),
        (["measure", "--sim", "Z900", "--", "true"], "unknown model 'Z900'"),
        (["measure", "--sim", "A100", "--", "no-such-command-xyz"], "command not found"),
        (["info", "--sim", ""], "empty simulated-hardware SPEC"),
        (["power", "--sim", "A100", "--interval", "0"], "--interval must be a positive number of seconds"),
        (["power", "--sim", "A100", "--duration", "nan"], "--duration must be a positive number of seconds"),
        (["measure", "--sim", "A100", "--timeline", "no-such-dir/t.csv", "--", "true"],
         "directory 'no-such-dir' does not exist"),
        (["measure", "--sim", "A100", "--log", "/etc/passwd/w.csv", "--", "true"],
         "directory '/etc/passwd' is a file, not a directory"),
        (["measure", "--sim", "A100", "--timeline", ".csv", "--", "true"],
         "needs a .csv or .jsonl file name"),
        (["info", "--bogus"], "No such option"),
        (["restore", "--sim", "A100", "--journal-dir", "/etc/passwd"], "is not a directory"),
    ],
)
def test_bad_input_gets_one_line_error(args: list[str], message: str) -> None:
    r = joules(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("joules: error:") and message in lines[0]
    assert "Traceback" not in r.stderr


def test_power_json_reports_readings_then_totals() -> None:
    r = joules("power", "--sim", "A100x2", "--interval", "0.1", "--duration", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.strip().splitlines()]
    readings, total = rows[:-1], rows[-1]
    assert 3 <= len(readings) <= 6
    assert set(readings[0]["power_w"]) == {"gpu0", "gpu1", "cpu0", "dram0"}
    assert readings[-1]["power_w"]["gpu0"] == pytest.approx(55.0, abs=1.0)  # idle A100
    assert total["time_s"] == pytest.approx(0.5, abs=0.3)
    assert total["energy_j"]["gpu0"] == pytest.approx(55.0 * total["time_s"], rel=0.3)


def test_power_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["power", "--sim", "V100", "--interval", "0.1", "--duration", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "energy" in out and "GPU 0" in out


def test_demo_measures_epochs_close_to_truth() -> None:
    rows = run_demo("A100x2", epochs=2, steps=10, optimize=False, real_seconds=0)["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["time_s"] == pytest.approx(10 * 0.35 + 6.0, rel=0.01)  # 0.94-0.96 busy: no throttling
        assert row["gpu_energy_j"] == pytest.approx(row["true_gpu_energy_j"], rel=0.005)
        assert row["cpu_dram_energy_j"] > 0
        assert row["limits_w"] == [400.0]


def test_demo_optimizer_converges_saves_energy_and_restores() -> None:
    out = run_demo("A100x2", epochs=7, steps=60, selector="energy", real_seconds=0,
                   console=Console(file=io.StringIO()))
    assert out["chosen_limit_w"] is not None and 100.0 < out["chosen_limit_w"] < 400.0
    assert out["rows"][-1]["limits_w"] == [out["chosen_limit_w"]]
    assert 0.05 < out["saved_fraction"] < 0.5  # against the same job at the default limit
    assert out["limits_after_w"] == [400.0, 400.0]
    for row in out["rows"]:
        assert row["gpu_energy_j"] == pytest.approx(row["true_gpu_energy_j"], rel=0.005)


def test_demo_command_runs() -> None:
    r = joules("demo", "--fast", "--epochs", "1", "--steps", "5", "--sim", "H100,V100")
    assert r.returncode == 0, r.stderr
    assert "per-epoch energy" in r.stdout and "Total GPU energy" in r.stdout
    r = joules("demo", "--fast", "--epochs", "1", "--steps", "5", "--selector", "cost:7")
    assert r.returncode != 0 and "eta" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_no_arguments_prints_help() -> None:
    r = joules()
    assert "measure" in r.stdout and "info" in r.stdout


def test_measure_writes_power_timeline(tmp_path: Path) -> None:
    out = tmp_path / "power.csv"
    r = joules("measure", "--sim", "A100x2", "--timeline", str(out), "--", sys.executable, "-c",
               "import time; time.sleep(0.5)")
    assert r.returncode == 0, r.stderr
    rows = out.read_text().splitlines()
    assert rows[0] == "time_s,device,power_w"
    devices = {row.split(",")[1] for row in rows[1:]}
    assert devices == {"gpu0", "gpu1"}
    assert len(rows) > 2 * 10  # ~29 ms sampling over 0.5 s, two GPUs
    assert all(float(row.split(",")[2]) == pytest.approx(55.0, abs=1.0) for row in rows[1:])


@pytest.mark.parametrize(("command", "code", "message"), [
    (["no-such-command-xyz"], 127, "command not found"),
    (["/etc/passwd"], 126, "command not executable"),
])
def test_measure_exits_as_a_shell_when_the_command_cannot_run(command: list[str], code: int,
                                                               message: str) -> None:
    r = joules("measure", "--sim", "A100", "--", *command)
    assert r.returncode == code
    assert r.stderr.strip().splitlines() == [f"joules: error: {message}: {command[0]}"]


def test_measure_refuses_an_empty_command_name_as_a_shell_does() -> None:
    r = joules("measure", "--sim", "A100", "--", "")
    assert r.returncode == 127  # bash -c '""' and sh -c '""' say 127 too
    assert r.stderr.strip().splitlines() == ["joules: error: command not found: '' (an empty command name)"]


def test_measure_passes_on_an_exit_code_of_130_without_dying_of_sigint() -> None:
    # Only a command that died of Ctrl-C makes joules die of SIGINT; exiting with 130 is a code.
    r = joules("measure", "--sim", "A100", "--json", "--", "sh", "-c", "exit 130")
    assert r.returncode == 130
    assert json.loads(r.stdout.strip().splitlines()[-1])["exit_code"] == 130


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_info_whose_reader_goes_early_ends_with_0(args: list[str]) -> None:
    # `joules info | head -1` under `set -o pipefail`: a closed stdout is not a failure.
    p = subprocess.Popen([JOULES, "info", "--sim", "A100x64,V100x64,H100x64", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()
    p.stdout.close()
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert b"Traceback" not in err


def test_json_commands_whose_reader_is_gone_end_with_their_own_code(tmp_path: Path) -> None:
    # The reader closes the pipe before the command writes: the command's work is done, and
    # its exit code is its own (restore's 1 means a GPU was not put back), not 1 for the pipe.
    profile = tmp_path / "A100+toy+gpu0.csv"
    profile.write_text("start_time,window_name,elapsed_time,gpu0_energy\n"
                       "0,__GlobalPowerLimitOptimizer_400,2.0,700\n"
                       "3,__GlobalPowerLimitOptimizer_300,2.5,600\n")
    for args in (["restore", "--sim", "A100", "--journal-dir", str(tmp_path / "none"), "--json"],
                 ["simulate", "power-limit", "--profile", str(profile), "--json"]):
        p = subprocess.Popen([JOULES, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout is not None
        p.stdout.close()
        _, err = p.communicate(timeout=60)
        assert p.returncode == 0, (args, err)
        assert b"Traceback" not in err


def test_measure_after_a_terminal_hang_up_still_ends_with_the_commands_code(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # After SIGHUP the terminal is gone: writing the table fails with EIO.
    import errno

    import joules.cli.measure  # noqa: F401 - the module whose Console is patched
    from joules import cli

    def hung_up(*args: object, **kwargs: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(cli.measure.Console, "print", hung_up)
    assert main(["measure", "--sim", "A100", "--", "sh", "-c", "exit 3"]) == 3


def test_measure_warns_when_no_device_is_found() -> None:
    r = joules("measure", "--sim", "nocpu", "--json", "--", "true")
    assert r.returncode == 0
    assert "no GPU or CPU energy readings found" in r.stderr
    assert json.loads(r.stdout)["total_energy_j"] == 0


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_to_joules_reaches_the_command_and_still_reports(signame: str) -> None:
    import os
    import signal
    import time

    signum = getattr(signal, signame)
    p = subprocess.Popen([JOULES, "measure", "--sim", "A100", "--json", "--", "sleep", "30"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.0)
    os.kill(p.pid, signum)  # joules alone, not its process group
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signum, err  # sleep ended by the forwarded signal
    report = json.loads(out.strip().splitlines()[-1])
    assert report["exit_code"] == 128 + signum and 0.5 < report["time_s"] < 10


def test_timeline_needs_known_format() -> None:
    r = joules("power", "--sim", "A100", "--duration", "0.1", "--timeline", "x.txt")
    assert r.returncode == 2
    assert r.stderr.startswith("joules: error: --timeline needs a .csv or .jsonl")


def _interrupt_after(args: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
    """Run joules in its own process group and press Ctrl-C (SIGINT to the group)."""
    import os
    import signal
    import time

    p = subprocess.Popen([JOULES, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    time.sleep(seconds)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=30)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_power_ctrl_c_prints_totals() -> None:
    r = _interrupt_after(["power", "--sim", "A100", "--interval", "0.2", "--json"], 2.0)
    assert r.returncode == 0, r.stderr
    total = json.loads(r.stdout.strip().splitlines()[-1])
    assert total["energy_j"]["gpu0"] == pytest.approx(55.0 * total["time_s"], rel=0.3)


def test_power_to_a_file_prints_one_line_per_reading_then_totals(tmp_path: Path) -> None:
    _, env = sim_child_env(tmp_path)
    out = tmp_path / "power.txt"
    with out.open("w") as f:
        r = subprocess.run([JOULES, "power", "--sim", "A100", "--interval", "0.2", "--duration", "1.1"],
                           stdout=f, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if line.strip() == "energy")  # a line of its own
    readings = lines[:title]
    assert 4 <= len(readings) <= 7
    for line in readings:
        assert re.fullmatch(r"\d+\.\d s: gpu0 55\.0 W, cpu0 \d+\.\d W, dram0 \d+\.\d W", line), line
    assert float(readings[-1].split(" s:")[0]) == pytest.approx(1.1, abs=0.3)
    assert any(line.startswith("│ GPU 0") for line in lines[title:])
    assert lines[-1].startswith("└")  # the totals table ends the output


def _terminate_after_first_reading(args: list[str], tmp_path: Path) -> tuple[int, str, str]:
    """Start joules with stdout to a file, send it SIGTERM once a reading is out; (code, out, err)."""
    import os
    import signal
    import time

    _, env = sim_child_env(tmp_path)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as o, err.open("w") as e:
        p = subprocess.Popen([JOULES, *args], stdout=o, stderr=e, env=env)
    deadline = time.monotonic() + 20
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGTERM)
    code = p.wait(timeout=30)
    return code, out.read_text(), err.read_text()


@pytest.mark.parametrize("as_json", [True, False])
def test_sigterm_to_power_prints_totals_and_writes_the_timeline(as_json: bool, tmp_path: Path) -> None:
    timeline = tmp_path / "power.jsonl"
    args = ["power", "--sim", "A100", "--interval", "0.1", "--timeline", str(timeline)]
    code, out, err = _terminate_after_first_reading([*args, "--json"] if as_json else args, tmp_path)
    assert code == 0, err  # as after Ctrl-C
    if as_json:
        total = json.loads(out.splitlines()[-1])
        assert total["energy_j"]["gpu0"] == pytest.approx(55.0 * total["time_s"], rel=0.3)
    else:
        assert out.endswith("\n") and "energy" in out and "│ total" in out
    samples = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert samples and all(s["device"] == "gpu0" for s in samples)


def test_python_m_joules_is_the_command_line() -> None:
    r = subprocess.run([sys.executable, "-m", "joules", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "measure" in r.stdout and "power" in r.stdout


def test_measure_ctrl_c_reaches_the_command_and_still_reports() -> None:
    r = _interrupt_after(["measure", "--sim", "A100", "--json", "--", "sleep", "30"], 2.0)
    # sleep was interrupted by the same Ctrl-C, and joules, once it has reported, ends of it too.
    assert r.returncode == -2, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["exit_code"] == 130 and 0.5 < out["time_s"] < 10
    assert out["gpu_energy_j"]["0"] > 0


def test_restore_puts_back_what_a_dead_job_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    from joules.devices.sim import Simulator

    state, jdir = tmp_path / "state.json", tmp_path / "journals"
    monkeypatch.setenv("JOULES_SIM", "A100x2")  # put back after the test (--sim sets it)
    monkeypatch.setenv("JOULES_SIM_STATE", str(state))
    gpu = Simulator("A100x2", state_file=state).gpus[1]
    gpu.set_power_limit_w(150.0)  # before the command's (cached) simulated GPUs read the file
    assert main(["restore", "--sim", "A100x2", "--journal-dir", str(jdir)]) == 0
    assert capsys.readouterr().out == f"nothing to restore (no journal directory {jdir})\n"

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    jdir.mkdir()
    (jdir / "job.json").write_text(json.dumps({
        "host": socket.gethostname(), "pid": dead.pid, "process_start_time": None,
        "gpus": [{"uuid": gpu.uuid, "index": 1, "name": gpu.name, "power_limit_w": 260.0,
                  "sm_clock_locked": False}]}))
    assert main(["restore", "--sim", "A100x2", "--journal-dir", str(jdir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["restored"] == 1 and out["ok"] is True
    assert "GPU 1" in out["actions"][0]["message"] and "150 W -> 260 W" in out["actions"][0]["message"]
    assert json.loads(state.read_text())["gpus"]["1"]["power_limit_w"] == 260.0
    assert not (jdir / "job.json").exists()

    (jdir / "bad.json").write_text("{")
    assert main(["restore", "--sim", "A100x2", "--journal-dir", str(jdir)]) == 1
    assert "unreadable restore journal" in capsys.readouterr().out


def test_restore_fails_when_a_gpu_left_changed_is_out_of_reach(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Where finding GPUs failed (no NVML library, after a driver mismatch), a dead job's locked
    GPU was "kept ... not visible here" with exit code 0 and "ok": true, the failure unsaid."""
    import socket

    from joules.cli import restore as restore_cli
    from joules.devices.base import DeviceSet, Problem

    nothing = DeviceSet(problems=[Problem("nvml", "the NVML library (libnvidia-ml.so.1) was not found"),
                                  Problem("CPU", "no RAPL"), Problem("GPU 0", "persistence mode is off")])
    monkeypatch.setattr(restore_cli, "discover", lambda: nothing)
    jdir = tmp_path / "journals"
    jdir.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    (jdir / "job.json").write_text(json.dumps({
        "host": socket.gethostname(), "pid": dead.pid, "process_start_time": None,
        "gpus": [{"uuid": "GPU-1234", "index": 0, "name": "A100", "power_limit_w": None,
                  "sm_clock_locked": True}]}))
    assert main(["restore", "--journal-dir", str(jdir), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["actions"][0]["kind"] == "kept"
    assert out["problems"] == ["nvml: the NVML library (libnvidia-ml.so.1) was not found"]
    assert main(["restore", "--journal-dir", str(jdir)]) == 1
    out, err = capsys.readouterr()
    assert "not visible here" in out and "may be out of reach: nvml: the NVML library" in err
    assert (jdir / "job.json").exists()  # kept for a later run
    monkeypatch.setattr(restore_cli, "discover", lambda: DeviceSet(problems=[
        Problem("GPU 0", "AMD GPU 0 could not be opened: amdsmi error 10")]))
    assert main(["restore", "--journal-dir", str(jdir), "--json"]) == 1  # an AMD GPU that cannot be opened
    capsys.readouterr()
    # A GPU that is found, with a warning of its own, says nothing about one that is not.
    monkeypatch.setattr(restore_cli, "discover", lambda: DeviceSet(problems=[
        Problem("GPU 0", "persistence mode is off"), Problem("GPU 1", "Tesla P100 has no energy counter")]))
    assert main(["restore", "--journal-dir", str(jdir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["problems"] == []


def test_ctrl_c_stops_a_shell_loop_of_measured_commands(tmp_path: Path) -> None:
    """A shell goes on after a command that exits 130; it stops when the command died of SIGINT."""
    import os
    import signal
    import time

    script = tmp_path / "loop.sh"
    script.write_text(f"for i in 1 2 3; do {JOULES} measure --sim A100 -- sleep 30; echo iteration $i; done\n"
                      "echo loop finished\n")
    p = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    time.sleep(2.0)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert "iteration" not in out and "loop finished" not in out, out
    assert p.returncode == -2
    assert "total" in err  # the measurement was still reported


def test_measure_title_with_brackets_is_not_markup() -> None:
    r = joules("measure", "--sim", "A100", "--", "sh", "-c", "exit 4", "data.paths=[/data/a]", "x[i]")
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr
    assert "data.paths=[/data/a]" in r.stderr and "x[i]" in r.stderr


def test_measure_runs_a_script_without_a_shebang_line(tmp_path: Path) -> None:
    script = tmp_path / "noshebang.sh"
    script.write_text('echo "hi from $1"\nexit 5\n')
    script.chmod(0o755)
    r = joules("measure", "--sim", "A100", "--", str(script), "arg")
    assert r.returncode == 5, r.stderr
    assert r.stdout == "hi from arg\n"


def test_measure_log_that_cannot_be_written_fails_before_the_command_runs(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").mkdir()
    marker = tmp_path / "ran"
    r = joules("measure", "--sim", "A100", "--log", str(tmp_path / "d.jsonl"), "--", "touch", str(marker))
    assert r.returncode == 2 and "--log" in r.stderr and "cannot be written" in r.stderr
    assert not marker.exists()
    # Missing folders are made, as the window log does.
    r = joules("measure", "--sim", "A100", "--log", str(tmp_path / "new" / "runs.jsonl"), "--", "true")
    assert r.returncode == 0, r.stderr
    assert len((tmp_path / "new" / "runs.jsonl").read_text().splitlines()) == 1


def test_power_huge_interval_is_a_clear_error() -> None:
    r = joules("power", "--sim", "A100", "--interval", "1e10")
    assert r.returncode == 2 and r.stderr.startswith("joules: error: --interval must be at most")


def test_power_on_a_dumb_terminal_prints_one_line_per_reading(tmp_path: Path) -> None:
    """TERM=dumb cannot redraw a live table, which would show nothing until the end."""
    import os

    _, env = sim_child_env(tmp_path)
    env = {**env, "TERM": "dumb", "TTY_COMPATIBLE": "1"}  # a terminal, but a dumb one
    r = subprocess.run([JOULES, "power", "--sim", "A100", "--interval", "0.2", "--duration", "0.9"],
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
    assert r.returncode == 0, r.stderr
    readings = [line for line in r.stdout.splitlines() if re.fullmatch(r"\d+\.\d s: gpu0 55\.0 W.*", line)]
    assert len(readings) >= 3, r.stdout


def test_a_reader_gone_early_still_gets_the_exit_code_and_the_timeline(tmp_path: Path) -> None:
    # `joules measure --json ... | head -1`: the pipe closes before the report is written.
    timeline = tmp_path / "tl.csv"
    script = (f"( {JOULES} measure --sim H100 --json --timeline {timeline} -- "
              "sh -c 'sleep 0.3; exit 4'; echo rc=$? >&2 ) | true")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert "rc=4" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert timeline.read_text().startswith("time_s")
    timeline = tmp_path / "power.csv"
    script = (f"( {JOULES} power --sim A100 --json --interval 0.1 --duration 3 --timeline {timeline}; "
              "echo rc=$? >&2 ) | head -1")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout)["power_w"]["gpu0"] > 0
    assert "rc=0" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert timeline.read_text().startswith("time_s")


def test_a_long_command_does_not_bury_the_numbers() -> None:
    r = joules("measure", "--sim", "H100", "--", "python3", "-c", "x=1;" * 5000)
    assert r.returncode == 0
    assert len(r.stderr.splitlines()) < 20 and "total" in r.stderr


@pytest.mark.parametrize("failures", [1, 10])
def test_measure_keeps_the_commands_exit_code_when_the_last_read_fails(
        failures: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A device read failing as the command ended lost the report and replaced the command's
    exit code with 2: the read is tried again, and if it keeps failing the code still passes."""
    from joules.errors import JoulesError
    from joules.monitoring.monitor import EnergyMonitor

    real_end = EnergyMonitor.end_window
    left = [failures]

    def end_window(self: EnergyMonitor, name: str, partial: bool = False):  # type: ignore[no-untyped-def]
        if left[0] > 0:
            left[0] -= 1
            raise JoulesError("GPU 0 (sim): NVML error trying to read the energy counter: Timeout")
        return real_end(self, name, partial=partial)

    monkeypatch.setattr(EnergyMonitor, "end_window", end_window)
    assert main(["measure", "--json", "--sim", "A100", "--", "sh", "-c", "exit 3"]) == 3
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["exit_code"] == 3
    if failures == 1:  # tried again: measured
        assert result["gpu_energy_j"]["0"] > 0 and "warning" not in err
    else:
        assert "nothing was measured" in result["error"] and "gpu_energy_j" not in result
        assert "joules: warning: the devices could not be read as the command ended" in err
        assert "Timeout" in err


@pytest.mark.parametrize("as_json", [True, False])
def test_measure_reports_what_it_can_read_when_a_device_stays_unreadable(
        as_json: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU counter and a DRAM zone that cannot be read as the command ends lost every device's
    totals: the GPU is measured from its power samples, the DRAM zone is left out and named."""
    import threading
    import time

    from joules.devices.sim.cpu import SimCPU
    from joules.devices.sim.gpu import SimGPU
    from joules.errors import JoulesError

    calls = {"energy_j": 0, "dram_energy_j": 0}
    began: list[float] = []

    def failing(name: str, real):  # type: ignore[no-untyped-def]
        def read(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread() and not began:
                began.append(time.monotonic())  # the begin edge
            elif began and time.monotonic() > began[0] + 0.3:  # from then on, every read fails
                calls[name] += 1
                raise JoulesError(f"{name} (sim): read failed: Unknown Error")
            return real(self)
        return read

    monkeypatch.setattr(SimGPU, "energy_j", failing("energy_j", SimGPU.energy_j))
    monkeypatch.setattr(SimCPU, "dram_energy_j", failing("dram_energy_j", SimCPU.dram_energy_j))
    args = ["measure", "--sim", "H100", "--", sys.executable, "-c", "import time; time.sleep(0.5); exit(5)"]
    assert main(["measure", "--json", *args[1:]] if as_json else args) == 5
    out, err = capsys.readouterr()
    assert calls["energy_j"] >= 3 and calls["dram_energy_j"] >= 1  # tried three times, then a lenient end
    assert "joules: warning: a device could not be read as the command ended" in err
    assert "left out of the totals: dram0" in err and "Unknown Error" in err
    if as_json:
        r = json.loads(out.strip().splitlines()[-1])
        assert r["missing"] == ["dram0"] and r["dram_energy_j"] == {}
        assert r["sources"]["gpu0"] == "sampled"  # from the power samples
        # An idle simulated H100 draws 70 W; the Xeon 8480 package 95 W.
        assert r["gpu_energy_j"]["0"] == pytest.approx(70 * r["time_s"], rel=0.25)
        assert r["cpu_energy_j"]["0"] == pytest.approx(95 * r["time_s"], rel=0.1)
        assert r["total_energy_j"] == pytest.approx(r["gpu_energy_j"]["0"] + r["cpu_energy_j"]["0"])
    else:
        rows = {line.split("│")[1].strip(): line for line in err.splitlines() if line.count("│") > 4}
        assert "not read at the end" in rows["DRAM 0"] and "sampled" in rows["GPU 0"]


def test_measure_with_every_device_unreadable_at_the_end_says_nothing_was_measured(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every device left out by the partial end: an ordinary report of exactly 0 J, exit 0."""
    import threading

    from joules.devices.sim.cpu import SimCPU
    from joules.errors import JoulesError

    began: list[bool] = []

    def failing(real):  # type: ignore[no-untyped-def]
        def read(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is threading.main_thread():
                if began:
                    raise JoulesError("CPU 0 (sim): read failed")
            return real(self)
        return read

    monkeypatch.setattr(SimCPU, "package_energy_j", failing(SimCPU.package_energy_j))
    monkeypatch.setattr(SimCPU, "dram_energy_j", failing(SimCPU.dram_energy_j))
    from joules.monitoring.monitor import EnergyMonitor

    real_begin = EnergyMonitor.begin_window

    def begin_window(self, name):  # type: ignore[no-untyped-def]
        real_begin(self, name)
        began.append(True)  # from now on every read of the package fails

    monkeypatch.setattr(EnergyMonitor, "begin_window", begin_window)
    assert main(["measure", "--json", "--sim", "XEON8480", "--", "sh", "-c", "exit 4"]) == 4
    out, err = capsys.readouterr()
    result = json.loads(out.strip().splitlines()[-1])
    assert "nothing was measured" in result["error"] and "total_energy_j" not in result
    assert "nothing was measured" in err and "power samples" not in err


def test_power_leaves_out_a_reading_that_fails_and_still_prints_totals(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One failed reading ended `joules power` with exit code 2 and no totals."""
    import threading

    from joules.devices.sim.gpu import SimGPU
    from joules.errors import JoulesError

    real = SimGPU.power_w
    calls = [0]

    def power_w(self: SimGPU) -> float:
        if threading.current_thread() is threading.main_thread():
            calls[0] += 1
            if calls[0] in (2, 3):
                raise JoulesError("GPU 0 (sim): NVML error trying to read the power: Timeout")
        return real(self)

    monkeypatch.setattr(SimGPU, "power_w", power_w)
    assert main(["power", "--sim", "V100", "--interval", "0.1", "--duration", "0.65", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.strip().splitlines()]
    readings, total = rows[:-1], rows[-1]
    assert err.count("joules: warning: GPU 0 cannot be read") == 1 and "Timeout" in err, err
    assert any("gpu0" not in r["power_w"] for r in readings)  # left out while it failed
    assert readings[-1]["power_w"]["gpu0"] == pytest.approx(40.0, abs=1.0)  # and back after
    assert total["energy_j"]["gpu0"] == pytest.approx(40.0 * total["time_s"], rel=0.3)
