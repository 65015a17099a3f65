"""Quality metrics (local evaluate modules): gsm_symbolic final-answer exact match and sandboxed HumanEval pass@1."""

import pytest

from domino_spec.generation.quality import extract_code, humaneval_pass_at_1, score_outputs, score_report

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


def test_humaneval_pass_at_1_runs_each_completion_in_a_sandbox():
    texts = [CORRECT_BODY, WRONG_BODY, LOOPING_BODY, CHAT_ANSWER]
    result = humaneval_pass_at_1(texts, [PROBLEM] * 4, timeout=1.0)
    assert result["per_item"] == [1, 0, 0, 1]
    assert result["score"] == 0.5
    assert result["results"][1] == "AssertionError" and result["results"][2] == "timed out"


def test_sandbox_blocks_processes_and_network():
    body = "    import {module}\n    {call}\n    return numbers\n"
    texts = [body.format(module="os", call="os.system('true')"), body.format(module="socket", call="socket.socket()")]
    result = humaneval_pass_at_1(texts, [PROBLEM] * 2, timeout=2.0)
    assert result["per_item"] == [0, 0]
    assert all("PermissionError" in line for line in result["results"])


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
