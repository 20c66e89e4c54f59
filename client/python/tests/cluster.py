"""Starts a shardd-coordinator and CPU workers on loopback for tests.

Every wait is bounded; stop() sends SIGTERM, waits up to 10 s and then sends
SIGKILL, workers first. The children also get SIGKILL when this process dies
(PR_SET_PDEATHSIG), so a test killed mid-way leaves none behind.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

# Paths inside the Bazel runfiles tree (the test's working directory).
COORDINATOR_BINARY = "server/shardd-coordinator"
WORKER_BINARY = "worker/shardd-worker"

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, which should do as little as it can.
_LIBC = ctypes.CDLL("libc.so.6", use_errno=True)


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the test process exits."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


def binary(relative: str) -> str:
    """A shardd binary: $SHARDD_BIN_DIR/<relative>, the runfiles path, or
    bazel-bin/<relative> when run from the repository root."""
    base = os.environ.get("SHARDD_BIN_DIR")
    candidates = [os.path.join(base, relative)] if base else []
    candidates += [relative, os.path.join("bazel-bin", relative)]
    for path in candidates:
        if os.access(path, os.X_OK) and os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"{relative}: not found in {candidates}; build it with bazel build")


class Cluster:
    """A coordinator and `workers` CPU workers on 127.0.0.1 with free ports.

    The coordinator gets --workers=`workers`; start_workers=False starts
    none of them (tests of the coordinator alone).

    Attributes:
        address: the coordinator's host:port once started.
        dir: where logs and the coordinator's data directory live.
    """

    def __init__(self, workers: int = 2, *, start_workers: bool = True,
                 coordinator_flags: Sequence[str] = (),
                 worker_flags: Sequence[str] = ()) -> None:
        self.workers = workers
        self.start_workers = start_workers
        self.coordinator_flags = list(coordinator_flags)
        self.worker_flags = list(worker_flags)
        base = os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix="shardd_py_", dir=base)
        self.address = ""
        self._coordinator: Optional[subprocess.Popen] = None
        self._workers: List[subprocess.Popen] = []
        self._logs: List[object] = []

    def _spawn(self, argv: List[str], log_name: str) -> subprocess.Popen:
        log = open(os.path.join(self.dir, log_name), "wb")
        self._logs.append(log)
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)

    def log(self, name: str, lines: int = 30) -> str:
        """The last lines of one log ("coordinator", "worker0", ...)."""
        path = pathlib.Path(self.dir, f"{name}.log")
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def logs(self) -> str:
        """Tails of every log, for failure messages."""
        names = ["coordinator"] + [f"worker{i}" for i in range(len(self._workers))]
        return "\n".join(f"---- {name} ----\n{self.log(name)}" for name in names)

    def start(self, timeout: float = 30.0) -> "Cluster":
        """Starts the coordinator, waits for its port, starts the workers.

        Does not wait for the workers to register: see wait_for_workers.

        Raises:
            RuntimeError: a process exited or the port did not appear within
                `timeout` seconds (the message has the coordinator's log).
        """
        data_dir = os.path.join(self.dir, "data")
        self._coordinator = self._spawn(
            [binary(COORDINATOR_BINARY), "--listen=127.0.0.1:0",
             f"--data-dir={data_dir}", f"--workers={self.workers}",
             "--heartbeat-timeout=2s", "--collective-timeout=20s",
             *self.coordinator_flags], "coordinator.log")
        port_file = pathlib.Path(data_dir, "coordinator.port")
        deadline = time.monotonic() + timeout
        port = 0
        while time.monotonic() < deadline:
            if self._coordinator.poll() is not None:
                raise RuntimeError("the coordinator exited:\n" + self.log("coordinator"))
            try:
                port = int(port_file.read_text().strip())
            except (OSError, ValueError):
                port = 0
            if port > 0:
                break
            time.sleep(0.02)
        if port <= 0:
            raise RuntimeError(f"no {port_file} within {timeout} s:\n"
                               + self.log("coordinator"))
        self.address = f"127.0.0.1:{port}"
        for rank in range(self.workers if self.start_workers else 0):
            self._workers.append(self._spawn(
                [binary(WORKER_BINARY), f"--coordinator={self.address}",
                 "--listen=127.0.0.1:0", "--device=cpu",
                 f"--requested-rank={rank}", *self.worker_flags],
                f"worker{rank}.log"))
        return self

    def check_running(self) -> None:
        """Raises RuntimeError when a started process has exited."""
        processes = [("coordinator", self._coordinator)] + [
            (f"worker{i}", p) for i, p in enumerate(self._workers)]
        for name, process in processes:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}:\n"
                                   + self.log(name))

    def wait_for_workers(self, coordinator, timeout: float = 30.0) -> None:
        """Waits until every worker is registered and alive.

        `coordinator` is a shardd.Coordinator connected to this cluster.
        """
        deadline = time.monotonic() + timeout
        alive = 0
        while time.monotonic() < deadline:
            self.check_running()
            alive = coordinator.live_workers(timeout=5)
            if alive == self.workers:
                return
            time.sleep(0.05)
        raise RuntimeError(f"{alive} of {self.workers} workers alive after "
                           f"{timeout} s:\n" + self.logs())

    def stop(self) -> None:
        """Stops every process (workers first), then closes the logs."""
        for group in (self._workers, [self._coordinator]):
            running = [p for p in group if p is not None and p.poll() is None]
            for process in running:
                process.terminate()
            deadline = time.monotonic() + 10
            for process in running:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    print(f"cluster: pid {process.pid} ignored SIGTERM; killing it",
                          file=sys.stderr)
                    process.kill()
                    process.wait()
        for log in self._logs:
            log.close()
        self._logs = []

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def exit_on_sigterm() -> None:
    """Bazel ends a test past its timeout with SIGTERM: turn it into
    SystemExit so the `finally`/`with` blocks stop the cluster."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, handler)
