"""``joules serve``: one-line errors on bad input, the default database, the token from the environment."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from joules.cli import main
from joules.testing.bso_server import ServerProcess
from joules.testing.processes import free_port


def serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``joules serve ARGS`` in this process (only for runs that fail before serving)."""
    code = main(["serve", *args])
    return code, capsys.readouterr().err


def test_an_empty_token_variable_is_refused_not_taken_for_no_token(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # A deployment whose secret failed to load must not serve /jobs to anyone.
    monkeypatch.setenv("JOULES_SERVER_TOKEN", "")
    code, err = serve(capsys, "--port", str(free_port()))
    assert code == 2 and "--token (or $JOULES_SERVER_TOKEN) is empty" in err
    from joules.servers.batch_size.app import app_from_env

    monkeypatch.setenv("JOULES_SERVER_DB", "postgresql://u@nowhere.invalid/db")
    with pytest.raises(ValueError, match="the token is empty"):
        app_from_env()


@pytest.mark.parametrize(("args", "message"), [
    (["--db", "mysql://u@localhost/db"], "unsupported database 'mysql'"),
    (["--db", "sqlite://"], "in-memory SQLite"),
    (["--db", "not a url://x"], "bad database URL"),
    (["--db", "postgresql://postgres@127.0.0.1:{free}/test"], "cannot use database postgresql+psycopg://"),
    (["--policy-factory", "nowhere_module:make"], "No module named 'nowhere_module'"),
    (["--log-level", "loud"], "bad --log-level"),
    (["--token", " "], "--token (or $JOULES_SERVER_TOKEN) is empty"),
    (["--token", " tok"], "--token (or $JOULES_SERVER_TOKEN) starts or ends with whitespace"),
    (["--token", "tok\n"], "--token (or $JOULES_SERVER_TOKEN) starts or ends with whitespace"),
    (["--token", "sécret"], "--token (or $JOULES_SERVER_TOKEN) has characters other than printable ASCII"),
    (["--token", "a\tb"], "--token (or $JOULES_SERVER_TOKEN) has characters other than printable ASCII"),
    (["--port", "0"], "--port"),
    (["--db", "postgresql://u:s3cret@host:abc/db"], "bad database URL 'postgresql://u:***@host:abc/db'"),
])
def test_bad_input_is_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = [a.replace("{free}", str(free_port())) for a in args]
    if "--port" not in args:
        args += ["--port", str(free_port())]
    code, err = serve(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


def test_port_in_use_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = serve(capsys, "--db", str(tmp_path / "x.sqlite"), "--port", str(port))
    assert code == 2 and err.startswith(f"joules: error: cannot listen on 127.0.0.1:{port}")
    assert len(err.strip().splitlines()) == 1


def test_without_the_server_extra_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi -> ImportError
    code, err = serve(capsys)
    assert code == 2
    assert err.strip() == "joules: error: joules serve needs fastapi: pip install 'joules[server]'"


def test_other_commands_do_not_import_the_server() -> None:
    code = ("import sys; from joules.cli import main; main(['info', '--json', '--sim', 'A100']); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'sqlalchemy', 'alembic', 'prometheus_client') "
            "if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_default_database_and_token_from_environment(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {"JOULES_STATE_DIR": str(state), "JOULES_SERVER_TOKEN": "env-token"}
    with ServerProcess(None, tmp_path / "server.log", env=env) as server:  # no --db, no --token
        assert (state / "batch-size.sqlite").is_file()
        assert httpx.get(f"{server.url}/jobs/x").status_code == 401
        right = httpx.get(f"{server.url}/jobs/x", headers={"Authorization": "Bearer env-token"})
        assert right.status_code == 404


def test_start_up_line_names_the_address_and_the_database(tmp_path: Path) -> None:
    db = tmp_path / "bso.sqlite"
    with ServerProcess(str(db), tmp_path / "server.log") as server:  # --log-level warning
        lines = server.log().splitlines()
    assert lines[:1] == [f"joules serve: listening on {server.url}, database sqlite:///{db}"]


def test_start_up_line_hides_the_password() -> None:
    from joules.cli.serve import start_line

    line = start_line("postgresql+psycopg://bso:s3cret@db.internal:5432/bso", "::1", 8000)
    assert line == ("joules serve: listening on http://[::1]:8000, "
                    "database postgresql+psycopg://bso:***@db.internal:5432/bso")
