"""Exact match of the final numeric answer, for GSM8K-style problems (gsm_symbolic).

The prediction's answer is the last number in the response; the reference is the answer string (a bare number, or
GSM8K's `... #### 42`, whose last number is taken too). Numbers compare by value after removing thousands separators,
currency signs and trailing zeros, so "1,234.50" matches "1234.5".
"""

import re
from decimal import Decimal, InvalidOperation

import datasets
import evaluate

_DESCRIPTION = "Exact match of the last number in each prediction with the reference answer's number."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): model responses.
    references (`list[str]`): reference answers ("42", "#### 42", "1,234").
Returns:
    exact_match (`float`): fraction of predictions whose last number equals the reference's.
    matches (`list[int]`): 1 or 0 per prediction.
Examples:
    >>> metric = evaluate.load("generation/metrics/gsm_exact_match")
    >>> metric.compute(predictions=["so the total is $1,200."], references=["1200"])["exact_match"]
    1.0
"""

# An optional sign, digits with optional thousands separators, an optional decimal part; or a bare decimal part.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def last_number(text: str | None) -> Decimal | None:
    """The value of the last number in `text`, or None when it has none."""
    matches = NUMBER.findall(text or "")
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", "")).normalize()
    except InvalidOperation:
        return None


class GsmExactMatch(evaluate.Metric):
    """Final-answer exact match for gsm_symbolic / GSM8K."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict:
        matches = []
        for prediction, reference in zip(predictions, references):
            expected, found = last_number(reference), last_number(prediction)
            matches.append(int(expected is not None and found is not None and found == expected))
        return {"exact_match": sum(matches) / len(matches) if matches else 0.0, "matches": matches}
