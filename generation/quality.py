"""Quality of decoded outputs, scored with `evaluate`: speculative decoding must not change it.

Two local `evaluate` metrics (the Hub's `exact_match` / `code_eval` scripts are fetched over the network, which
offline machines cannot do): `metrics/gsm_exact_match` (last number of the response vs the reference answer) and
`metrics/humaneval_pass_at_1` (`code_eval` semantics in a sandboxed subprocess). `score_outputs` picks the metric of
an evaluation set; `score_report` scores every method of a `domino-spec bench` report, so plain and Domino outputs
can be shown to score equally.

HumanEval is scored by running the model-written programs on this machine, so, as with evaluate's `code_eval`, it
runs only when asked to: `allow_code_execution=True` (`domino-spec bench --quality --allow-code-execution`) or
`HF_ALLOW_CODE_EVAL=1`. Each program then runs in a child `python -I` in a scratch folder, with an environment of
HOME and TMPDIR only, resource limits (CPU time, memory, file size, open files, no core dumps, no new processes), a
network namespace of its own where the machine allows one (Linux, as root or with unprivileged user namespaces), and
an audit hook refusing processes, signals, sockets, ctypes and writes outside the scratch folder. The metric's
docstring has the details; it is not a security boundary against hostile code: run untrusted outputs in a container
or VM.
"""

import functools
import os
import re
from collections.abc import Iterable

METRICS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics")
GSM_SETS = ("gsm-symbolic", "gsm_symbolic", "gsm8k")
HUMANEVAL_SETS = ("humaneval", "humaneval-long")  # scored on the HumanEval problem each asks for
# MT-Bench: open-ended answers, no reference to compare with; reasoning-held-out: for speed and acceptance only
UNSCORED_SETS = ("mt-bench", "reasoning-held-out")
HUMANEVAL_TIMEOUT_S = 3.0
ALLOW_CODE_EVAL_ENV = "HF_ALLOW_CODE_EVAL"  # evaluate's code_eval reads the same variable

# A fence's info string is any language tag (python, py3, python3, ...), and lines may end in CRLF.
FENCED_CODE = re.compile(r"```[ \t]*[\w+-]*[ \t]*\r?\n(.*?)(?:```|\Z)", re.DOTALL)


@functools.cache
def load_metric(name: str):
    """A local evaluate metric from `generation/metrics/<name>` (no network)."""
    import evaluate

    return evaluate.load(os.path.join(METRICS_DIR, name), keep_in_memory=True)


def gsm_exact_match(texts: list[str], references: list[str]) -> dict:
    """Exact match of the last number of each response with its reference answer."""
    result = load_metric("gsm_exact_match").compute(predictions=texts, references=[str(r) for r in references])
    return {"metric": "exact_match", "score": result["exact_match"], "per_item": result["matches"]}


def extract_code(text: str) -> str:
    """The code of a response: its first fenced block that defines a function, else its first block, else all of it."""
    blocks = FENCED_CODE.findall(text)
    if not blocks:
        return text
    return next((block for block in blocks if re.search(r"^\s*def ", block, re.MULTILINE)), blocks[0])


def humaneval_program(completion: str, problem: dict) -> str:
    """The candidate program of a response to a HumanEval problem (`prompt`, `entry_point`).

    A response that (re)defines the entry point follows the prompt as a whole new definition (chat models usually
    answer with the full function); otherwise it continues the prompt's function body, as HumanEval completions do.
    """
    code = extract_code(completion)
    if re.search(rf"^\s*def {re.escape(problem['entry_point'])}\s*\(", code, re.MULTILINE):
        return problem["prompt"] + "\n" + code
    return problem["prompt"] + code


def require_code_execution(allow_code_execution: bool, eval_sets: Iterable[str] = HUMANEVAL_SETS) -> None:
    """Raise `ValueError` when one of `eval_sets` is scored by running model-written programs and that is not allowed:
    by `allow_code_execution`, or `HF_ALLOW_CODE_EVAL=1` in the environment."""
    code_sets = [name for name in eval_sets if name in HUMANEVAL_SETS]
    if code_sets and not (allow_code_execution or os.environ.get(ALLOW_CODE_EVAL_ENV) == "1"):
        raise ValueError(
            f"scoring {', '.join(code_sets)} runs the model-written programs on this machine (sandboxed, but not "
            f"against hostile code): pass --allow-code-execution (Python: allow_code_execution=True) or set "
            f"{ALLOW_CODE_EVAL_ENV}=1 to allow it, or leave {', '.join(code_sets)} out of the evaluation sets."
        )


def humaneval_pass_at_1(
    texts: list[str], problems: list[dict], timeout: float = HUMANEVAL_TIMEOUT_S, allow_code_execution: bool = False
) -> dict:
    """pass@1 of one response per HumanEval problem (`prompt`, `test`, `entry_point`), each run sandboxed; only when
    `allow_code_execution` (or `HF_ALLOW_CODE_EVAL=1`) allows running them."""
    require_code_execution(allow_code_execution)
    for problem in problems:
        missing = [key for key in ("prompt", "test", "entry_point") if key not in (problem or {})]
        if missing:
            raise ValueError(f"a HumanEval reference must be the problem dict; missing {missing}.")
    programs = [humaneval_program(text, problem) for text, problem in zip(texts, problems)]
    tests = [f"{problem['test']}\n\ncheck({problem['entry_point']})\n" for problem in problems]
    result = load_metric("humaneval_pass_at_1").compute(
        predictions=programs, references=tests, timeout=timeout, allow_code_execution=True
    )
    return {
        "metric": "pass@1",
        "score": result["pass@1"],
        "per_item": result["passed"],
        "results": result["results"],
        "isolation": result["isolation"],
    }


def score_outputs(eval_set: str, texts: list[str], references: list, allow_code_execution: bool = False) -> dict:
    """Score decoded `texts` of `eval_set` against its `references` (as `eval_prompts(...)[i]["reference"]`); HumanEval
    runs the texts' code, only with `allow_code_execution` (or `HF_ALLOW_CODE_EVAL=1`).

    Returns `{"metric", "score", "per_item", "count"}`; for open-ended sets (MT-Bench) `metric` and `score` are None.
    """
    if len(texts) != len(references):
        raise ValueError(f"{len(texts)} outputs but {len(references)} references for {eval_set!r}.")
    if eval_set in GSM_SETS:
        scores = gsm_exact_match(texts, references)
    elif eval_set in HUMANEVAL_SETS:
        scores = humaneval_pass_at_1(texts, references, allow_code_execution=allow_code_execution)
    elif eval_set in UNSCORED_SETS:
        scores = {"metric": None, "score": None, "per_item": []}
    else:
        known = ", ".join(GSM_SETS + HUMANEVAL_SETS + UNSCORED_SETS)
        raise ValueError(f"no quality metric for evaluation set {eval_set!r}; known sets: {known}.")
    return {**scores, "count": len(texts)}


def score_report(report: dict, allow_code_execution: bool = False) -> dict:
    """`{eval_set: {method: score_outputs(...)}}` for a `domino-spec bench` report (its `texts` and `references`)."""
    require_code_execution(allow_code_execution, report["texts"])
    scores = {}
    for eval_set, texts_by_method in report["texts"].items():
        references = report["references"][eval_set]
        scores[eval_set] = {
            method: score_outputs(eval_set, texts, references, allow_code_execution)
            for method, texts in texts_by_method.items()
        }
    return scores


__all__ = ["extract_code", "humaneval_program", "require_code_execution", "score_outputs", "score_report"]
