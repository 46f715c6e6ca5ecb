"""A throwaway PostgreSQL server for tests: a real `postgres` from the distribution's package (Debian:
`apt-get install postgresql`, binaries in /usr/lib/postgresql/NN/bin), a fresh cluster in a temp dir,
listening on a loopback port only, trust auth, no Unix socket. Never a mock.

initdb and postgres refuse to run as root, so under root the cluster belongs to `nobody` and the server is
started as that user (runuser); the temp dir is made traversable for it. The server is stopped by the PID
it wrote to postmaster.pid (a fast shutdown, then SIGKILL if it lingers), and the temp dir removed.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60
"""initdb + start on a loaded 2-core machine takes a few seconds; this bounds a broken install."""


def find_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None when no server is installed."""
    candidates: list[str] = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
        candidates.append(out.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)  # newest major first
    if shutil.which("initdb"):
        candidates.append(str(Path(shutil.which("initdb") or "").resolve().parent))
    for c in candidates:
        if c and all((Path(c) / exe).exists() for exe in ("initdb", "postgres")):
            return Path(c)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    root: Path
    port: int
    pid: int
    launcher: subprocess.Popen[bytes]

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A fresh, empty database (so tests never see each other's rows); returns its URL."""
        import psycopg

        with psycopg.connect(self.admin_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGINT)  # postgres: SIGINT = fast shutdown
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _alive(self.pid):
                time.sleep(0.1)
            if _alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.launcher.wait(timeout=20)  # runuser (or postgres itself) exits with the server
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our own child that exited) counts as gone
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False


def start(bindir: Path) -> PgServer:
    """initdb a cluster in a new temp dir and start postgres on a free loopback port."""
    root = Path(tempfile.mkdtemp(prefix="maxkernel-pg-"))
    data = root / "data"
    as_user: list[str] = []
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "nobody", "--"]
        root.chmod(0o755)
        data.mkdir(mode=0o700)
        shutil.chown(data, "nobody")
        log = root / "server.log"
        log.touch()
        shutil.chown(log, "nobody")
    env = dict(os.environ, LC_ALL="C", LANG="C")
    subprocess.run(
        [*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
         "--no-sync"],
        cwd=root, env=env, check=True, capture_output=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    port = _free_port()
    proc = subprocess.Popen(
        [*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
         "-k", "", "-c", "fsync=off", "-c", "max_connections=200"],
        cwd=root, env=env, stdout=open(root / "server.log", "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    pid_file = data / "postmaster.pid"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("postgres exited:\n" + (root / "server.log").read_text()[-3000:])
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            if pid_file.exists() and len(pid_file.read_text().splitlines()) >= 8:
                # line 8 is the server's status: "ready" once it accepts connections
                if "ready" in pid_file.read_text().splitlines()[7]:
                    return PgServer(
                        root=root, port=port, pid=int(pid_file.read_text().split()[0]), launcher=proc
                    )
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("postgres did not come up:\n" + (root / "server.log").read_text()[-3000:])
