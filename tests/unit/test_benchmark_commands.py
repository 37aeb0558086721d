"""Every benchmark command that README.md or docs/ print runs, at a tiny size, and prints its table.

The commands are found in the documents (inline code and code blocks naming
``benchmarks/<script>.py``), not listed here, so a documented command that breaks (a renamed flag,
a crash such as bench_mtp_head.py's ``_Unhooked`` wrapper past the deferred output layer) fails
here. Each keeps its documented flags but its sizes, which :data:`TINY` replaces: fewer tokens, a
small vocabulary and hidden size, one iteration, tp 1. ``--results``, ``--append``, ``--out`` and
the output files of ``gpu_model.py`` are pointed at a temporary directory, never the committed
tables.

Each command runs in its own process: the script's driver as documented, but its worker in the
same process (rank 0 of a world of 1) instead of a torchrun launch, which would cost another
interpreter start per command. That process is a fork of one server process (``python THIS_FILE
--serve``, started once per pytest process) that has imported torch, megatron-core and the
package, what every command imports first (several seconds each on a loaded machine); the child
then runs as ``python THIS_FILE SCRIPT ARGS`` would, its output to files, under a timeout (on
expiry its process group is killed and only its test fails). The server does no tensor work and
starts no thread before it forks (one intra-op thread, ``OMP_NUM_THREADS=1``, as before).

``gpu_model.py`` (a static model that needs no GPU) runs its torch-path scenarios only: the
Triton ones compile kernels for sm_90, which ``test_triton_compile.py`` covers. A benchmark that
needs a GPU would be skipped here with the reason; none of the documented ones does.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import IO

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(
    os.path.join(ROOT, "docs")) if f.endswith(".md"))]

# Per script, the flags that make a documented command tiny (they replace the documented values).
TINY = {
    "bench_vocab_parallel": {"--tokens": "64", "--tp": "1", "--vocab": "1000", "--iters": "1"},
    "bench_fused_linear": {"--tokens": "64", "--tp": "1", "--hidden": "32", "--vocab": "1000",
                           "--iters": "1", "--warmup": "0"},
    "bench_topk": {"--tokens": "64", "--tp": "1", "--hidden": "32", "--vocab": "1000",
                   "--k": "8", "--iters": "1"},
    "bench_sampling": {"--tokens": "64", "--tp": "1", "--hidden": "32", "--vocab": "1000",
                       "--iters": "1", "--warmup": "0"},
    "bench_mtp_head": {"--tokens": "64", "--tp": "1", "--hidden": "32", "--vocab": "2000",
                       "--chunk": "16", "--iters": "1"},
    "bench_verl": {"--tokens": "64", "--hidden": "32", "--vocab": "1000"},
    "bench_integrations": {"--tokens": "64", "--hidden": "32", "--vocab": "1000"},
    "gpu_model": {"--tokens": "256", "--hidden": "64", "--vocab": "1000", "--jobs": "1",
                  "--scenario": "ours logprob ("},
}
# Flags naming where results go (with their value, if any): sent to the test's directory.
OUTPUT_FLAGS = {"--results": False, "--append": False, "--out": True, "--json": True,
                "--speed-rows": True}
# What each script prints once its table is there.
TABLE = {"gpu_model": "| scenario | fwd ms |", "bench_verl": "| T | provider | path |",
         "bench_integrations": "| framework | path | peak |"}
# The scripts that are their own worker (no driver, no --out: they print their table).
SINGLE = ("bench_verl", "bench_integrations", "gpu_model")
NEEDS_GPU: dict[str, str] = {}  # script -> reason (none of the documented ones needs a GPU)


def _snippets(text: str) -> list[str]:
    """Code in ``text`` naming a benchmark script: fenced blocks (``\\`` continuations joined),
    then inline code spans (which may wrap onto the next line)."""
    out = []
    fence = r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```"  # indented fences too (in lists)
    for block in re.findall(fence, text, flags=re.S | re.M):
        out += block.replace("\\\n", " ").splitlines()
    text = re.sub(fence, "", text, flags=re.S | re.M)
    out += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", text)]
    return [s for s in out if re.search(r"benchmarks/\w+\.py", s)
            and re.match(r"(\S+=\S+ )*(\S*python\S* |torchrun )", s.strip())]


def documented_commands() -> dict[str, tuple[str, list[str]]]:
    """``{id: (script, documented args)}`` of every benchmark command the documents print,
    optional ``[...]`` groups of a synopsis left out."""
    found = {}
    for doc in DOCS:
        with open(os.path.join(ROOT, doc)) as f:
            for snippet in _snippets(f.read()):
                words = shlex.split(re.sub(r"\[[^\]]*\]", "", snippet), comments=True)
                at = next(i for i, w in enumerate(words) if re.search(r"benchmarks/\w+\.py", w))
                script = os.path.basename(words[at])[:-3]
                args = words[at + 1:]
                found.setdefault(f"{script} {' '.join(args)}".strip(), (script, args))
    return found


def _distinct(commands: dict) -> dict:
    """One command per distinct tiny form (the documents print some twice, or differing only
    in sizes)."""
    seen, out = set(), {}
    for name, (script, args) in commands.items():
        key = (script, *tiny_args(script, args, "TMP")) if script in TINY else name
        if key not in seen:
            seen.add(key)
            out[name] = (script, args)
    return out


DOCUMENTED = documented_commands()


def tiny_args(script: str, args: list[str], tmp: str) -> list[str]:
    """``args`` with :data:`TINY`'s sizes and every output flag pointed into ``tmp``."""
    out, words = [], list(args)
    while words:
        flag = words.pop(0)
        values = []
        while words and not words[0].startswith("--"):
            values.append(words.pop(0))
        if flag not in TINY[script] and flag not in OUTPUT_FLAGS:
            out += [flag, *values]
    for flag, value in TINY[script].items():
        out += [flag, value]
    if script == "gpu_model":
        return out + ["--json", os.path.join(tmp, "model.json"),
                      "--speed-rows", os.path.join(tmp, "speed.json")]
    return out + (["--out", os.path.join(tmp, script)] if script not in SINGLE else [])


COMMANDS = _distinct(DOCUMENTED)


def test_the_documents_print_benchmark_commands_each_with_a_tiny_size():
    scripts = {script for script, _ in DOCUMENTED.values()}
    # The README's MTP table and the fused head's table are among them.
    assert {"bench_mtp_head", "bench_fused_linear", "gpu_model"} <= scripts, scripts
    assert not scripts - set(TINY), f"give these documented benchmarks a tiny size: " \
                                    f"{sorted(scripts - set(TINY))}"


@pytest.mark.parametrize("name", sorted(COMMANDS), ids=lambda n: n.replace("/", "_"))
def test_documented_command_prints_its_table(name, tmp_path):
    if importlib.util.find_spec("megatron.core") is None:  # the benchmarks compare with it
        pytest.skip("could not import 'megatron.core'")
    script, args = COMMANDS[name]
    if script in NEEDS_GPU and not _cuda():
        pytest.skip(f"{script} needs a GPU: {NEEDS_GPU[script]}")
    argv = tiny_args(script, args, str(tmp_path))
    code, stdout, stderr = _run(script, argv, str(tmp_path))
    assert code == 0, f"exit {code}: {shlex.join(argv)}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    if script in TABLE:
        assert TABLE[script] in stdout, stdout[-3000:]
        rows = [line for line in stdout.splitlines() if line.startswith("| ")]
        assert len(rows) > 2, stdout[-3000:]  # header, rule and at least one row
    else:
        with open(tmp_path / f"{script}.md") as f:
            table = f.read()
        assert "|---" in table and table.count("\n| ") >= 2, table


# ---------------------------------------------------------------------------------------------
# The server: imports once, forks a child per command

TIMEOUT_S = 300  # per command
# What every command imports first (the scripts import megatron-core's modules when they run).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
           "megatron.core.tensor_parallel", "megatron_vocabstats",
           "megatron_vocabstats.profiling")


def _run(script: str, argv: list[str], tmp: str) -> tuple[int | str, str, str]:
    """``python THIS_FILE script argv`` in a child of the server: (exit code, or why there is
    none, stdout, stderr)."""
    server, errors = _server()
    request = {"script": script, "argv": argv, "tmp": tmp, "timeout": TIMEOUT_S}
    try:
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        reply = server.stdout.readline()
    except OSError:
        reply = ""
    if not reply:
        errors.seek(0)
        pytest.fail(f"the command server exited {server.poll()}:\n{errors.read()[-6000:]}")
    out = {}
    for stream in ("stdout", "stderr"):
        with open(os.path.join(tmp, f"command.{stream}"), errors="replace") as f:
            out[stream] = f.read()
    return json.loads(reply), out["stdout"], out["stderr"]


@functools.cache
def _server() -> tuple[subprocess.Popen, IO[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("LOCAL_RANK", None)
    errors = tempfile.TemporaryFile("w+")
    server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve"], cwd=ROOT,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=errors, text=True)
    atexit.register(_stop, server)
    return server, errors


def _stop(server: subprocess.Popen) -> None:
    server.stdin.close()  # the server's loop ends
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _serve() -> None:
    """Read requests (JSON lines) from stdin; per request fork a child that runs the command and
    answer its exit code, or ``"timed out after N s"``."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else this process prints goes to its stderr
    for module in PRELOAD:
        importlib.import_module(module)
    assert threading.active_count() == 1, threading.enumerate()  # forking is safe
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(_fork(replies.fileno(), **request)) + "\n")
        replies.flush()


def _fork(replies: int, script: str, argv: list[str], tmp: str, timeout: float) -> int | str:
    """Run the command in a child (``replies``: the server's answer pipe, closed there); its exit
    code, or ``"timed out after N s"`` when it ran past ``timeout`` seconds (then its process
    group is killed)."""
    pid = os.fork()
    if pid == 0:  # the child: what `python THIS_FILE script argv` would do
        code = 1
        try:
            os.setpgid(0, 0)
            os.close(replies)
            for fd, stream in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(os.path.join(tmp, f"command.{stream}"),
                                os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            sys.stdin = open(os.devnull)
            os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
            _run_in_process(script, argv)
            code = 0
        except SystemExit as exc:  # as the interpreter treats it
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
            if code is not exc.code and exc.code is not None:
                print(exc.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        os.setpgid(pid, pid)  # (also done by the child: whichever runs first)
    except OSError:
        pass
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"timed out after {timeout} s"
        time.sleep(0.05)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _run_in_process(script: str, argv: list[str]) -> None:
    """Run ``benchmarks/<script>.py argv``: its driver, and each worker launch in this process
    as rank 0 of a world of 1 (the torchrun launch replaced; ``--tp 1``)."""
    import json
    import runpy
    import tempfile

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    # MASTER_PORT 0: rank 0 of a world of 1 binds a port of the system's choice and connects to
    # nobody. (A port probed free and then named here could meanwhile be taken by a concurrent
    # torchrun job's gloo listener, which this process would then connect to: that hung the
    # profile cases of the other xdist worker until the gloo timeout.)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    path = os.path.join(ROOT, "benchmarks", f"{script}.py")
    if script in SINGLE:  # no driver: the script itself
        os.environ["LOCAL_RANK"] = "0"
        sys.argv = [path, *argv]
        runpy.run_path(path, run_name="__main__")
        return
    import _runner

    module = __import__(script)

    def launch(_script, tp, args):
        assert tp == 1, f"the in-process launch runs tp 1, not {tp}"
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            os.environ["LOCAL_RANK"] = "0"
            sys.argv = [path, *args, "--worker-out", out]
            try:
                module.main()
            finally:
                del os.environ["LOCAL_RANK"]
            with open(out) as f:
                return [_runner.Measurement(**row) for row in json.load(f)]

    _runner.launch = launch
    sys.argv = [path, *argv]
    module.main()


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        _run_in_process(sys.argv[1], sys.argv[2:])
