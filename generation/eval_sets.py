"""Evaluation prompts of the benchmark: MT-Bench first turns, HumanEval, a held-out gsm_symbolic set, long prompts
built from HumanEval (`humaneval-long`), and reasoning tasks no recipe trains on (`reasoning-held-out`).

Training data must not contain these: `recipes/smollm2-135m/prepare_prompts.py` excludes them and checks for
overlap. Full GSM8K, MATH-500, MBPP and Alpaca are not installable offline, so they are not offered here.
"""

from .. import assets

EVAL_SETS = ("mt-bench", "humaneval", "gsm-symbolic")  # what `bench` runs unless told
LONG_EVAL_SETS = ("humaneval-long",)  # ~1,000-1,500-token prompts: prefill and verify passes over a long context
HELD_OUT_EVAL_SETS = ("reasoning-held-out",)  # reasoning-gym tasks of another kind than any training data
ALL_EVAL_SETS = EVAL_SETS + LONG_EVAL_SETS + HELD_OUT_EVAL_SETS
# Solved code of at least this many characters before each request: with SmolLM2's tokenizer (~3.3 characters a
# token) and chat template, prompts of 956-1,532 tokens, 1,257 on average.
LONG_CONTEXT_CHARS = 3000
# gsm_symbolic problems are generated from a seed: evaluation uses this one, training data other seeds.
GSM_EVAL_SEED = 0
GSM_EVAL_SIZE = 200
HELD_OUT_TASKS = ("basic_arithmetic", "chain_sum", "leg_counting", "fraction_simplification")
HELD_OUT_SEED = 123  # any seed: no recipe trains on these tasks
HELD_OUT_TASK_SIZE = 50


def humaneval_message(problem: dict) -> str:
    return f"Complete the following Python function.\n\n```python\n{problem['prompt']}```"


def humaneval_long_messages() -> list[dict]:
    """`humaneval-long`: each prompt shows consecutive HumanEval problems with their canonical solutions, ~3,000
    characters of solved code (`LONG_CONTEXT_CHARS`), then asks to complete the next problem in the same style; its
    reference is that problem. Every problem is used once, as context or as request (164 problems: 26 prompts).
    HumanEval is evaluation data, never training data (training uses ShareGPT and gsm_symbolic of other seeds)."""
    problems = assets.humaneval_problems()
    items, start = [], 0
    while start < len(problems):
        context, end = "", start
        while end < len(problems) - 1 and len(context) < LONG_CONTEXT_CHARS:
            context += f"```python\n{problems[end]['prompt']}{problems[end]['canonical_solution']}```\n\n"
            end += 1
        if end == start:  # the last problem alone: no context left for it
            break
        request = problems[end]
        content = (
            f"Here are solved Python exercises:\n\n{context}Complete the following Python function in the "
            f"same style.\n\n```python\n{request['prompt']}```"
        )
        items.append(
            {
                "id": f"long-{request['task_id']}",
                "messages": [{"role": "user", "content": content}],
                "reference": request,
            }
        )
        start = end + 1
    return items


def eval_prompts(name: str, limit: int | None = None) -> list[dict]:
    """`[{"id", "messages", "reference"}]` of one evaluation set; `reference` is what quality metrics compare to."""
    if name == "mt-bench":
        items = [
            {
                "id": f"mt-bench-{q['question_id']}",
                "messages": [{"role": "user", "content": q["turns"][0]}],
                "reference": None,
            }
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
    elif name == "humaneval-long":
        items = humaneval_long_messages()
    elif name == "reasoning-held-out":  # the tasks in turn, so that the first N prompts hold N / 4 of each
        by_task = [assets.reasoning_gym_problems(task, HELD_OUT_TASK_SIZE, HELD_OUT_SEED) for task in HELD_OUT_TASKS]
        items = [
            {"id": f"{task}-{i}", "messages": [{"role": "user", "content": q["question"]}], "reference": q["answer"]}
            for i, problems in enumerate(zip(*by_task))
            for task, q in zip(HELD_OUT_TASKS, problems)
        ]
    else:
        raise ValueError(f"unknown evaluation set {name!r}; choose from {', '.join(ALL_EVAL_SETS)}")
    return items[:limit] if limit is not None else items
