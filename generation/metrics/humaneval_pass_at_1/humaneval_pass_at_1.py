"""HumanEval pass@1 with `code_eval` semantics: a candidate passes when `program + test + check(entry_point)` runs
to completion, each in a sandboxed subprocess.

The sandbox: a fresh `python -I` (isolated: no user site, no PYTHON* variables, script folder not on sys.path) in a
temporary working folder, stdin closed, a minimal environment, a wall-clock timeout (the whole process group is
killed), `resource.setrlimit` caps on CPU time, memory, file size and open files, and a prelude that disables
sockets, subprocesses, forking and file deletion. It keeps honest mistakes (infinite loops, huge allocations, stray
`rm`) from hurting the machine; it is not a security boundary against hostile code: run untrusted outputs in a
container or VM.
"""

import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import datasets
import evaluate

_DESCRIPTION = "Fraction of programs that pass their unit tests (one sample per problem: pass@1)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): candidate programs (HumanEval: the problem's prompt followed by the completion).
    references (`list[str]`): test code, ending with the call that runs it (HumanEval: `test + "check(entry_point)"`).
    timeout (`float`): wall-clock seconds per program (default 3).
    num_workers (`int`): programs run at once (default 2).
Returns:
    pass@1 (`float`): fraction of predictions that passed.
    passed (`list[int]`): 1 or 0 per prediction.
    results (`list[str]`): "passed", "timed out", or the failure's last line.
"""

MEMORY_LIMIT_BYTES = 2 << 30
FILE_SIZE_LIMIT_BYTES = 16 << 20
OPEN_FILES_LIMIT = 64

# Runs before the candidate: honest-mistake guards, not a security boundary (see the module docstring).
SANDBOX_PRELUDE = """
import os as _os, resource as _resource, shutil as _shutil, socket as _socket, subprocess as _subprocess

_LIMITS = (
    (_resource.RLIMIT_CPU, {cpu_seconds}),
    (_resource.RLIMIT_AS, {memory}),
    (_resource.RLIMIT_FSIZE, {file_size}),
    (_resource.RLIMIT_NOFILE, {open_files}),
    (_resource.RLIMIT_CORE, 0),
)
for _limit, _value in _LIMITS:
    _hard = _resource.getrlimit(_limit)[1]
    _value = _value if _hard == _resource.RLIM_INFINITY else min(_value, _hard)
    _resource.setrlimit(_limit, (_value, _value))

def _blocked(*args, **kwargs):
    raise PermissionError("not allowed in the HumanEval sandbox")

for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
    setattr(_socket, _name, _blocked)
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "execv", "execve", "execvp", "execvpe",
              "spawnv", "spawnve", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
              "truncate", "chmod", "chown", "setuid", "putenv"):
    if hasattr(_os, _name):
        setattr(_os, _name, _blocked)
_subprocess.Popen = _subprocess.run = _subprocess.call = _blocked
_shutil.rmtree = _shutil.move = _shutil.chown = _blocked
del _name, _limit, _value, _hard, _LIMITS
"""


def sandbox_prelude(timeout: float) -> str:
    """The prelude with its resource limits: CPU seconds, address space, file size, open files; no core dumps.

    Set by the child itself (not a `preexec_fn`, which is unsafe with the worker threads of `_compute`).
    """
    return SANDBOX_PRELUDE.format(
        cpu_seconds=int(timeout) + 1,
        memory=MEMORY_LIMIT_BYTES,
        file_size=FILE_SIZE_LIMIT_BYTES,
        open_files=OPEN_FILES_LIMIT,
    )


def run_program(program: str, timeout: float = 3.0) -> str:
    """Run `program` in the sandbox; returns "passed", "timed out" or the failure's last stderr line."""
    with tempfile.TemporaryDirectory(prefix="humaneval_") as workdir:
        path = os.path.join(workdir, "candidate.py")
        with open(path, "w", encoding="utf-8") as file:
            file.write(sandbox_prelude(timeout) + "\n" + program)
        environment = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        process = subprocess.Popen(
            [sys.executable, "-I", path],
            cwd=workdir,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, killed as a whole on timeout
        )
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return "timed out"
    if process.returncode == 0:
        return "passed"
    lines = stderr.decode("utf-8", "replace").strip().splitlines()
    return lines[-1] if lines else f"exit status {process.returncode}"


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
        self, predictions: list[str], references: list[str], timeout: float = 3.0, num_workers: int = 2
    ) -> dict:
        programs = [f"{program}\n\n{test}\n" for program, test in zip(predictions, references)]
        with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
            results = list(pool.map(lambda program: run_program(program, timeout), programs))
        passed = [int(result == "passed") for result in results]
        return {"pass@1": sum(passed) / len(passed) if passed else 0.0, "passed": passed, "results": results}
