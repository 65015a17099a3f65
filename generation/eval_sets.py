"""Evaluation prompts of the benchmark: MT-Bench first turns, HumanEval, and a held-out gsm_symbolic set.

Training data must not contain these: `recipes/smollm2-135m/prepare_prompts.py` excludes them and checks for
overlap. Full GSM8K, MATH-500, MBPP and Alpaca are not installable offline, so they are not offered here.
"""

from .. import assets

EVAL_SETS = ("mt-bench", "humaneval", "gsm-symbolic")
# gsm_symbolic problems are generated from a seed: evaluation uses this one, training data other seeds.
GSM_EVAL_SEED = 0
GSM_EVAL_SIZE = 200


def humaneval_message(problem: dict) -> str:
    return f"Complete the following Python function.\n\n```python\n{problem['prompt']}```"


def eval_prompts(name: str, limit: int | None = None) -> list[dict]:
    """`[{"id", "messages", "reference"}]` of one evaluation set; `reference` is what quality metrics compare to."""
    if name == "mt-bench":
        items = [
            {"id": f"mt-bench-{q['question_id']}", "messages": [{"role": "user", "content": q["turns"][0]}], "reference": None}
            for q in assets.mtbench_questions()
        ]
    elif name == "humaneval":
        items = [
            {"id": p["task_id"], "messages": [{"role": "user", "content": humaneval_message(p)}], "reference": p}
            for p in assets.humaneval_problems()
        ]
    elif name == "gsm-symbolic":
        items = [
            {"id": f"gsm-eval-{i}", "messages": [{"role": "user", "content": q["question"]}], "reference": q["answer"]}
            for i, q in enumerate(assets.gsm_symbolic(GSM_EVAL_SIZE, seed=GSM_EVAL_SEED))
        ]
    else:
        raise ValueError(f"unknown evaluation set {name!r}; choose from {', '.join(EVAL_SETS)}")
    return items[:limit] if limit is not None else items
