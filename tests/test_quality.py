"""Quality metrics (local evaluate modules): gsm_symbolic final-answer exact match and sandboxed HumanEval pass@1."""

import socket
import sys

import pytest

from domino_spec import cli
from domino_spec.generation import bench_command
from domino_spec.generation.quality import (
    ALLOW_CODE_EVAL_ENV,
    extract_code,
    humaneval_pass_at_1,
    load_metric,
    score_outputs,
    score_report,
)

# A HumanEval-style problem, written here so the tests need no dataset package.
PROMPT = """from typing import List


def running_max(numbers: List[int]) -> List[int]:
    \"\"\"Running maximum.
    >>> running_max([1, 3, 2])
    [1, 3, 3]
    \"\"\"
"""
TEST = """def check(candidate):
    assert candidate([]) == []
    assert candidate([1, 3, 2, 5]) == [1, 3, 3, 5]
    assert candidate([-2, -5]) == [-2, -2]
"""
PROBLEM = {"task_id": "Test/0", "prompt": PROMPT, "entry_point": "running_max", "test": TEST}
CORRECT_BODY = """    result, best = [], None
    for n in numbers:
        best = n if best is None else max(best, n)
        result.append(best)
    return result
"""
WRONG_BODY = "    return sorted(numbers)\n"
LOOPING_BODY = "    while True:\n        pass\n"
COMMON_IMPORTS_BODY = (
    "    import bisect, collections, datetime, decimal, fractions, functools, hashlib, heapq, itertools, json, math\n"
    "    import random, re, statistics, string, tempfile, typing\n"
    "    with tempfile.TemporaryFile() as scratch:  # a file in the scratch folder\n"
    "        scratch.write(hashlib.sha256(re.sub('a', 'b', 'abc').encode()).digest())\n" + CORRECT_BODY
)
# The names of this process's network interfaces (as Python source, to run in the sandbox too).
INTERFACES = "{line.split(':')[0].strip() for line in open('/proc/self/net/dev').read().splitlines()[2:]}"
CHAT_ANSWER = (
    "Here is the function:\n\n```python\nfrom typing import List\n\ndef running_max(numbers: List[int]) -> List[int]:\n"
    "    out = []\n    for i in range(len(numbers)):\n        out.append(max(numbers[: i + 1]))\n    return out\n```\n"
    "It keeps the largest value so far."
)


def test_gsm_exact_match_compares_the_last_number():
    texts = [
        "He earns 195 * 6 * 2 * 12 = 28,080 pounds. The answer is 28080.",
        "So the total is $1,200.",
        "Half of 7 is 3.50",
        "The answer is 44, not 45.",  # the last number counts
        "I cannot tell.",
        "It drops to -4 degrees.",
    ]
    references = ["28080", "1200", "#### 3.5", "44", "2", "-4"]
    result = score_outputs("gsm-symbolic", texts, references)
    assert result["per_item"] == [1, 1, 1, 0, 0, 1]
    assert result["metric"] == "exact_match" and result["score"] == pytest.approx(4 / 6) and result["count"] == 6


def test_humaneval_pass_at_1_runs_each_completion_in_a_sandbox(caplog):
    texts = [CORRECT_BODY, WRONG_BODY, LOOPING_BODY, CHAT_ANSWER, COMMON_IMPORTS_BODY]
    result = humaneval_pass_at_1(texts, [PROBLEM] * 5, timeout=1.0, allow_code_execution=True)
    assert result["per_item"] == [1, 0, 0, 1, 1], result["results"]
    assert result["score"] == 0.6
    assert result["results"][1] == "AssertionError" and result["results"][2] == "timed out"
    assert "running 5 model-written program(s) on this machine, each in a child `python -I`" in caplog.text
    assert "audit hook" in result["isolation"]


def _escape(code: str) -> str:
    """A correct completion that first tries `code`: it passes only if the attempt goes through unnoticed."""
    return "".join(f"    {line}\n" for line in code.splitlines()) + CORRECT_BODY


@pytest.mark.parametrize(
    "attempt",
    [
        "import os\nos.system('touch {marker}')",
        "import os, sys\nos.posix_spawn(sys.executable, [sys.executable, '-c', WRITE_ARGV1, {marker!r}], {{}})",
        "import subprocess, sys\nsubprocess.run([sys.executable, '-c', WRITE_ARGV1, {marker!r}])",
        "import ctypes\nctypes.CDLL(None).system(b'touch {marker}')",
        "open({marker!r}, 'w').write('written outside the scratch folder')",
        "import os\nos.close(os.open({marker!r}, os.O_CREAT | os.O_WRONLY))",
    ],
    ids=["os.system", "os.posix_spawn", "subprocess.run", "ctypes", "open", "os.open"],
)
def test_sandbox_refuses_processes_and_writes_outside_its_scratch_folder(tmp_path, attempt):
    marker = tmp_path / "escaped"
    attempt = "WRITE_ARGV1 = 'import sys; open(sys.argv[1], \"w\")'\n" + attempt.format(marker=str(marker))
    result = humaneval_pass_at_1([_escape(attempt)], [PROBLEM], allow_code_execution=True)
    assert result["per_item"] == [0] and "PermissionError" in result["results"][0], result["results"]
    assert not marker.exists()


def test_sandbox_refuses_sockets(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        attempt = f"import _socket\n_socket.socket().connect(('127.0.0.1', {port}))"
        result = humaneval_pass_at_1([_escape(attempt)], [PROBLEM], allow_code_execution=True)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert result["per_item"] == [0] and "PermissionError: socket.__new__" in result["results"][0], result["results"]


def test_sandbox_runs_each_program_without_the_hosts_network():
    """Where the machine allows it, each program has a network namespace of its own: no interface but loopback."""
    if not sys.platform.startswith("linux") or eval(INTERFACES) == {"lo"}:
        pytest.skip("needs Linux and a host with a network interface besides loopback")
    attempt = f"interfaces = {INTERFACES}\nassert interfaces == {{'lo'}}, interfaces"
    result = humaneval_pass_at_1([_escape(attempt)], [PROBLEM], allow_code_execution=True)
    if "the host's network" in result["isolation"]:
        pytest.skip("this machine allows no network namespace: " + result["isolation"])
    assert result["per_item"] == [1], result["results"]


def test_code_execution_needs_an_explicit_opt_in(monkeypatch):
    monkeypatch.delenv(ALLOW_CODE_EVAL_ENV, raising=False)
    refusal = "runs the model-written programs on this machine.*--allow-code-execution.*HF_ALLOW_CODE_EVAL=1"
    with pytest.raises(ValueError, match=refusal):
        humaneval_pass_at_1([CORRECT_BODY], [PROBLEM])
    with pytest.raises(ValueError, match=refusal):
        score_outputs("humaneval", [CORRECT_BODY], [PROBLEM])
    report = {
        "texts": {"gsm-symbolic": {"plain": ["= 4"]}, "humaneval": {"plain": [CORRECT_BODY]}},
        "references": {"gsm-symbolic": ["4"], "humaneval": [PROBLEM]},
    }
    with pytest.raises(ValueError, match=refusal):
        score_report(report)
    with pytest.raises(ValueError, match="allow_code_execution=True"):  # the metric itself, used through evaluate
        load_metric("humaneval_pass_at_1").compute(predictions=["pass"], references=["pass"])
    monkeypatch.setenv(ALLOW_CODE_EVAL_ENV, "1")  # as evaluate's code_eval
    assert score_report(report)["humaneval"]["plain"]["score"] == 1.0


def test_bench_quality_refuses_humaneval_before_loading_any_model(monkeypatch, capsys):
    monkeypatch.delenv(ALLOW_CODE_EVAL_ENV, raising=False)
    monkeypatch.setattr(bench_command, "load_target", lambda name: pytest.fail("bench loaded a model before refusing"))
    monkeypatch.setattr(sys, "argv", ["domino-spec", "bench", "--eval-sets", "gsm-symbolic,humaneval", "--quality"])
    with pytest.raises(SystemExit) as stopped:
        cli.run()
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("domino-spec bench: error: scoring humaneval runs the model-written programs") and (
        "--allow-code-execution" in line and "HF_ALLOW_CODE_EVAL=1" in line
    )


def test_extract_code_prefers_the_fenced_function():
    assert extract_code(CHAT_ANSWER).startswith("from typing import List\n\ndef running_max")
    assert extract_code(CORRECT_BODY) == CORRECT_BODY
    for fence in ("```python3\n", "```py3\n", "``` Python \r\n"):  # other language tags, CRLF line ends
        assert extract_code(f"Here:\n{fence}def f():\n    return 1\n```\n") == "def f():\n    return 1\n"


def test_score_report_scores_every_method_and_open_ended_sets_are_unscored():
    report = {
        "texts": {"gsm-symbolic": {"plain": ["= 4", "= 9"], "domino": ["= 4", "= 9"]}, "mt-bench": {"plain": ["hi"]}},
        "references": {"gsm-symbolic": ["4", "8"], "mt-bench": [None]},
    }
    scores = score_report(report)
    assert scores["gsm-symbolic"]["plain"]["score"] == scores["gsm-symbolic"]["domino"]["score"] == 0.5
    assert scores["mt-bench"]["plain"]["score"] is None
    with pytest.raises(ValueError, match="no quality metric for evaluation set 'alpaca'"):
        score_outputs("alpaca", ["x"], ["y"])
    with pytest.raises(ValueError, match="2 outputs but 1 references"):
        score_outputs("gsm-symbolic", ["1", "2"], ["1"])
