"""HumanEval pass@1 with `code_eval` semantics: a candidate passes when `program + test + check(entry_point)` runs
to completion, each in a sandboxed child process.

This runs model-written programs on this machine, so it runs only when asked to (`allow_code_execution=True`). Each
program runs in:
- a child `python -I` (isolated: no user site, no PYTHON* variables; `-B`: no .pyc writes) in a scratch folder of
  its own, with an environment of HOME and TMPDIR only (both the scratch folder), stdin closed, a wall-clock timeout
  (its process group is killed);
- `setrlimit` caps: CPU time, 2 GiB address space, 16 MiB file size, 64 open files, no core dumps, no new processes
  (RLIMIT_NPROC, which root ignores);
- on Linux, a network namespace of its own (no interface up, so no network), through `unshare(CLONE_NEWNET)` as root
  or `unshare(CLONE_NEWUSER | CLONE_NEWNET)` where unprivileged user namespaces are allowed; where neither is (a
  container's seccomp filter often refuses both), the host's network, and the results say so (`isolation`);
- a Python audit hook, which the program cannot remove, refusing process creation (os.system, os.posix_spawn,
  os.exec*, os.spawn*, os.fork, subprocess), signals, sockets, ctypes, rlimit changes, changing the working folder,
  and opening directories or writing, removing, renaming or linking files outside the scratch folder.
The kernel enforces the limits and the namespace. The audit hook checks what the interpreter reports, with Python
helpers (`os.path.realpath`) that the program runs beside: it stops mistakes and plain attempts, not code written to
subvert the interpreter. This is not a security boundary against hostile code: run untrusted outputs in a container
or VM.
"""

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import datasets
import evaluate

logger = logging.getLogger(__name__)

_DESCRIPTION = "Fraction of programs that pass their unit tests (one sample per problem: pass@1)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): candidate programs (HumanEval: the problem's prompt followed by the completion).
    references (`list[str]`): test code, ending with the call that runs it (HumanEval: `test + "check(entry_point)"`).
    timeout (`float`): wall-clock seconds per program (default 3).
    num_workers (`int`): programs run at once (default 2).
    allow_code_execution (`bool`): must be True: the predictions run on this machine, in the sandbox described above.
Returns:
    pass@1 (`float`): fraction of predictions that passed.
    passed (`list[int]`): 1 or 0 per prediction.
    results (`list[str]`): "passed", "timed out", or the failure's last line.
    isolation (`str`): the isolation the programs ran under.
"""

MEMORY_LIMIT_BYTES = 2 << 30
FILE_SIZE_LIMIT_BYTES = 16 << 20
OPEN_FILES_LIMIT = 64
CLONE_NEWNET = 0x40000000  # from <sched.h>
CLONE_NEWUSER = 0x10000000
PROGRAM_NAME = "candidate.py"
STDERR_NAME = "stderr.txt"

# The child's code: isolate, limit, install the audit hook, then run the candidate. Its settings come as JSON in argv.
SANDBOX_RUNNER = r"""
import json, os, resource, sys

settings = json.loads(sys.argv[1])
if settings["unshare_flags"]:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(settings["unshare_flags"]) != 0:
        raise OSError(ctypes.get_errno(), "unshare: the sandbox could not leave the host's network")
for name, value in settings["limits"].items():
    if hasattr(resource, name):  # RLIMIT_NPROC is not on every OS
        limit = getattr(resource, name)
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))


def sandbox_audit_hook(scratch):
    # Paths are checked against the working folder, so it stays the scratch folder (no os.chdir), and directory
    # handles, against which os.open(..., dir_fd=) resolves a path unseen by the hook, come from the scratch only.
    refused = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen",
               "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
               "os.chdir"}
    refused_prefixes = ("socket.", "ctypes.", "gc.get_")  # gc.get_*: a way to this hook's own state
    # _posixsubprocess.fork_exec starts processes without an audit event of its own.
    refused_imports = {"_posixsubprocess"}
    path_events = {"os.remove", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime",
                   "shutil.rmtree", "os.setxattr", "os.removexattr"}
    two_path_events = {"os.rename", "os.link", "os.symlink"}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    realpath, isdir, fsdecode, sep = os.path.realpath, os.path.isdir, os.fsdecode, os.sep

    def inside(path):  # a file descriptor (int) is not a path we can check: refused
        return isinstance(path, (str, bytes, os.PathLike)) and (realpath(fsdecode(path)) + sep).startswith(scratch)

    def audit(event, args):
        if event == "open":
            path, _, flags = args
            allowed = not (flags & write_flags or isdir(path)) or inside(path)
        elif event == "import":
            allowed = args[0] not in refused_imports
        elif event in path_events or event in two_path_events:
            allowed = all(inside(path) for path in args[: 2 if event in two_path_events else 1])
        else:
            allowed = event not in refused and not event.startswith(refused_prefixes)
        if not allowed:
            what = f"{event} {args[0]!r}" if args and isinstance(args[0], (str, bytes)) else event
            raise PermissionError(f"{what} is not allowed in the HumanEval sandbox")

    return audit


with open(settings["program"], encoding="utf-8") as file:
    program = compile(file.read(), settings["program"], "exec")
sys.addaudithook(sandbox_audit_hook(os.path.realpath(os.getcwd()) + os.sep))
del sandbox_audit_hook, settings
exec(program, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def resource_limits(timeout: float) -> dict[str, int]:
    """The child's `resource` limits by name: CPU seconds, address space, file size, open files, core dumps, and new
    processes (RLIMIT_NPROC counts the user's processes, so 0 refuses any)."""
    return {
        "RLIMIT_CPU": int(timeout) + 1,
        "RLIMIT_AS": MEMORY_LIMIT_BYTES,
        "RLIMIT_FSIZE": FILE_SIZE_LIMIT_BYTES,
        "RLIMIT_NOFILE": OPEN_FILES_LIMIT,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": 0,
    }


def run_program(program: str, timeout: float = 3.0, unshare_flags: int | None = None) -> str:
    """Run `program` in the sandbox; returns "passed", "timed out" or the failure's last stderr line.

    `unshare_flags` (default: `network_unshare_flags()`) give the child its own namespaces; 0 keeps the host's.
    """
    if unshare_flags is None:
        unshare_flags = network_unshare_flags()
    settings = {"program": PROGRAM_NAME, "limits": resource_limits(timeout), "unshare_flags": unshare_flags}
    with tempfile.TemporaryDirectory(prefix="humaneval_") as scratch:
        with open(os.path.join(scratch, PROGRAM_NAME), "w", encoding="utf-8") as file:
            file.write(program)
        # stderr goes to a file, which RLIMIT_FSIZE caps (a pipe would fill this process's memory instead).
        with open(os.path.join(scratch, STDERR_NAME), "w+b") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-I", "-B", "-c", SANDBOX_RUNNER, json.dumps(settings)],
                cwd=scratch,
                env={"HOME": scratch, "TMPDIR": scratch},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,  # its own process group, killed as a whole on timeout
            )
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                return "timed out"
            stderr.seek(0)
            lines = stderr.read().decode("utf-8", "replace").strip().splitlines()
    if process.returncode == 0:
        return "passed"
    return lines[-1] if lines else f"exit status {process.returncode}"


@functools.cache
def network_unshare_flags() -> int:
    """The `unshare` flags that give a child a network namespace of its own here, tried on an empty program: 0 where
    the machine allows none (not Linux; not root, and no unprivileged user namespaces)."""
    if not sys.platform.startswith("linux"):
        return 0
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        if run_program("", unshare_flags=flags) == "passed":
            return flags
    return 0


def isolation(timeout: float) -> str:
    """The isolation each program runs under, in words (logged, and returned with the results)."""
    network = {
        CLONE_NEWNET: "a network namespace of its own (no network)",
        CLONE_NEWUSER | CLONE_NEWNET: "a user and network namespace of its own (no network)",
        0: "the host's network (this machine allows no network namespace; the audit hook refuses sockets)",
    }[network_unshare_flags()]
    return (
        f"a child `python -I` in a scratch folder, environment HOME and TMPDIR only, {timeout:g} s wall clock, "
        f"{int(timeout) + 1} s CPU, {MEMORY_LIMIT_BYTES >> 30} GiB address space, {FILE_SIZE_LIMIT_BYTES >> 20} MiB "
        f"files, {OPEN_FILES_LIMIT} open files, no core dumps, no new processes; an audit hook refusing processes, "
        f"signals, sockets, ctypes and writes outside the scratch folder; {network}"
    )


class HumanevalPassAt1(evaluate.Metric):
    """pass@1 of one candidate program per problem."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        timeout: float = 3.0,
        num_workers: int = 2,
        allow_code_execution: bool = False,
    ) -> dict:
        if not allow_code_execution:
            raise ValueError(
                "humaneval_pass_at_1 runs the predictions as programs on this machine: pass allow_code_execution=True "
                "once you accept that (the module docstring says what the sandbox isolates, and what it does not)."
            )
        programs = [f"{program}\n\n{test}\n" for program, test in zip(predictions, references)]
        sandbox = isolation(timeout)
        logger.warning("running %d model-written program(s) on this machine, each in %s", len(programs), sandbox)
        with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
            results = list(pool.map(lambda program: run_program(program, timeout), programs))
        passed = [int(result == "passed") for result in results]
        return {
            "pass@1": sum(passed) / len(passed) if passed else 0.0,
            "passed": passed,
            "results": results,
            "isolation": sandbox,
        }
