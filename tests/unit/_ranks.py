"""Launch a torchrun script's ranks from a process that has already imported torch and Megatron.

A plain ``python -m torch.distributed.run`` launch spends most of a small test's time importing:
the launcher imports torch, and every rank imports torch, megatron-core and the package again
(about 5 s of CPU per process on this machine, against well under a second of test). Here one
server process per pytest worker imports them once; each launch forks it, and the fork becomes
torchrun's agent: it forks the ranks, hosts the rendezvous store (``TORCHELASTIC_USE_AGENT_STORE``,
as torchrun's agent does) and gives each rank torchrun's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ...). A rank runs the script as ``__main__``
with its arguments, in a fresh fork, so no state passes from one launch to the next; as a fresh
process it gets the caller's environment of the moment, random seeds of its own, an empty
stdin, and at its end its exit handlers run. The scripts are unchanged torchrun scripts, and
``test_dist_launcher.py`` runs one under ``torchrun`` itself.

The forks happen before anything in their parent starts a thread (the agent creates its store
only after forking the ranks), so no lock is inherited held. When a rank exits with an error the
agent ends the others, as torchrun does, and what the ranks left running is ended with the
launch. A launch that outlives ``timeout`` ends the server, its agent and ranks (one session),
and the next launch starts a new server; a server whose pytest worker dies mid-launch ends
itself and the launch.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

# What every rank of the launched scripts imports and a fresh process takes seconds to import.
# Nothing here may apply a patch or decorate one of the package's Triton kernels. (Megatron
# imports triton: a launch that needs TRITON_INTERPRET passes it as ``env``, which its server
# imports with.)
PRELOAD = (
    "torch",
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.models.gpt",
    "megatron_vocabstats.ops.stats.from_logits",
)


class LaunchError(AssertionError):
    """A launch that did not finish: the server died or the launch outlived its timeout."""


class _Server:
    def __init__(self, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, start_new_session=True, text=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, req: dict, timeout: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
        except BaseException:  # pytest-timeout, KeyboardInterrupt: the launch may still run
            self.close()
            raise
        if not line:
            self.close()
            why = f"took over {timeout:.0f} s" if not ready else "lost its server"
            raise LaunchError(f"launch of {' '.join(req['argv'])} x{req['nproc']} {why}")
        return json.loads(line)

    def close(self) -> None:
        _kill_session(self.proc.pid)  # the server, its agent, the ranks and their children
        self.proc.wait()


def _kill_session(sid: int, but: int | None = None) -> None:
    """SIGKILL every process of session ``sid`` (the server's) but ``but``, and wait (up to a
    minute) until each has ended: a signalled process takes a moment to."""
    killed = []
    for pid, stat in _processes():
        if pid != but and int(stat[3]) == sid and stat[0] != "Z":
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    deadline = time.monotonic() + 60
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if running(pid)]
        if killed:
            time.sleep(0.01)


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _processes():
    """``(pid, stat fields after the command name)`` of every process (Linux ``/proc``)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    yield int(entry), f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                pass


_SERVERS: dict[tuple, _Server] = {}


def launch(argv: list[str], nproc: int, *, cwd: str | None = None, env: dict | None = None,
           timeout: float = 570.0) -> tuple[int, str]:
    """Run ``argv`` (``[script, *args]``, or ``["-m", module, *args]``) on ``nproc`` ranks as
    ``torchrun --standalone --nproc-per-node=nproc`` would; ``(exit code, output of every rank)``.

    The ranks get this process's environment at the call, with ``OMP_NUM_THREADS=1``,
    ``PYTHONWARNINGS=ignore`` and ``env``. ``env`` is for the variables read at import time
    (``TRITON_INTERPRET``): each distinct ``env`` has its own server, which imports with it.
    Raises :class:`LaunchError` when the launch outlives ``timeout`` seconds (its ranks are
    ended); the default is under pytest-timeout's 600 s, so that the launch's own error, with
    the ranks' output, is the one reported."""
    key = tuple(sorted((env or {}).items()))
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **dict(key)}
    server = _SERVERS.get(key)
    if server is None or not server.alive():
        server = _SERVERS[key] = _Server(environ)
    with tempfile.TemporaryDirectory() as logs:
        req = {"argv": argv, "nproc": nproc, "cwd": os.path.abspath(cwd or os.getcwd()),
               "logs": logs, "environ": environ,
               "run_id": str(uuid.uuid4())}
        try:
            reply = server.request(req, timeout)
        except LaunchError as exc:
            raise LaunchError(f"{exc}\n{_read_logs(logs, nproc)[-12000:]}") from None
        return reply["rc"], _read_logs(logs, nproc)


def _read_logs(logs: str, nproc: int) -> str:
    out = ""
    for name in ["agent", *(f"rank{r}" for r in range(nproc))]:
        path = os.path.join(logs, f"{name}.log")
        if os.path.exists(path):
            with open(path, errors="replace") as f:
                out += f"--- {name}\n" + f.read()
    return out


# ------------------------------------------------------------------------------ server side


def _rank(req: dict, rank: int, port_fd: int) -> None:
    """A rank: wait for the store's port, take torchrun's environment, run the script."""
    port = os.read(port_fd, 16).decode()
    if not port:  # the agent died before its store was up
        os._exit(1)
    os.close(port_fd)
    os.close(_PROTOCOL_FD)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    nproc = req["nproc"]
    os.environ.clear()
    os.environ.update(req["environ"])
    import torch

    torch.seed()  # a fresh process's generators are seeded at random, each its own
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1", ROLE_NAME="default", MASTER_ADDR="localhost", MASTER_PORT=port,
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=req["run_id"],
        TORCHELASTIC_ERROR_FILE=os.path.join(req["logs"], f"error{rank}.json"),
        TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
    log = os.open(os.path.join(req["logs"], f"rank{rank}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(req["cwd"])
    import runpy

    argv = req["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = req["cwd"]  # as ``python -m`` sets it
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as ``python script``
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported in the rank's log, as torchrun's child does
        traceback.print_exc()
        code = 1
    import atexit
    import threading

    threading._shutdown()  # what the interpreter's exit does: join non-daemon threads
    atexit._run_exitfuncs()  # and run the exit handlers (a file left open is not flushed)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _agent(req: dict) -> int:
    """torchrun's agent for one launch: fork the ranks, then host their store, then wait."""
    pids, port_fds = [], []
    for rank in range(req["nproc"]):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            for fd in port_fds:
                os.close(fd)
            _rank(req, rank, read_fd)
        os.close(read_fd)
        pids.append(pid)
        port_fds.append(write_fd)
    import torch.distributed as dist

    store = dist.TCPStore("localhost", 0, req["nproc"], True,
                          datetime.timedelta(seconds=900), wait_for_workers=False)
    for fd in port_fds:
        os.write(fd, str(store.port).encode())
        os.close(fd)
    rc, running = 0, set(pids)
    while running:
        pid, status = os.wait()
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            with open(os.path.join(req["logs"], "agent.log"), "a") as f:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
                f.write(f"rank {pids.index(pid)} (pid {pid}) exited with {how}\n")
        if code != 0 and rc == 0:
            rc = code if code > 0 else 1
            for other in running:  # as torchrun: one failed rank ends the launch
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + 5
            while running and time.monotonic() < deadline:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid:
                    running.discard(pid)
                else:
                    time.sleep(0.05)
            for other in running:
                os.kill(other, signal.SIGKILL)
    return rc


_PROTOCOL_FD = -1


def _serve() -> None:
    global _PROTOCOL_FD
    import importlib

    _PROTOCOL_FD = os.dup(1)
    protocol = os.fdopen(_PROTOCOL_FD, "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nothing but replies on the protocol's stream, whatever an import prints
    os.close(null)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a leg without it: its scripts import what they can
            pass
    for line in sys.stdin:
        req = json.loads(line)
        if os.path.isdir("/proc/self/task") and len(os.listdir("/proc/self/task")) > 1:
            # A thread (started by an import above) could hold a lock that a fork inherits held.
            with open(os.path.join(req["logs"], "agent.log"), "w") as f:
                f.write(f"{__file__}: the server has threads and forks only single-threaded\n")
            reply = {"rc": 1}
        else:
            reply = {"rc": _fork_agent(req)}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()
    os._exit(0)  # the client is gone; skip the seconds of torch's finalization


def _fork_agent(req: dict) -> int:
    pid = os.fork()
    if pid == 0:
        try:
            code = _agent(req)
        except BaseException:  # noqa: BLE001 - the launch's error, in its log
            with open(os.path.join(req["logs"], "agent.log"), "w") as f:
                traceback.print_exc(file=f)
            code = 1
        os._exit(code)
    pidfd = os.pidfd_open(pid)
    ready, _, _ = select.select([0, pidfd], [], [])
    if pidfd not in ready:
        # stdin readable mid-launch: the client closed it (it sends nothing while it waits):
        # it died (SIGTERM, SIGKILL, pytest-timeout's thread method). End the launch and the
        # server, which nothing would end otherwise (a session of its own).
        _kill_session(os.getpid(), but=os.getpid())
        os._exit(1)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    _kill_session(os.getpid(), but=os.getpid())  # what the ranks left running, as torchrun
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    _serve()
