"""Built-in rule rewards, called as verl calls them:
``compute_score(data_source, solution_str, ground_truth, extra_info)``.

- :func:`gsm8k_score`: GSM8K's final answer, the number after ``####`` (or, failing that, the last
  number of the response), compared with the ground truth as a number.
- :func:`boxed_math_score`: the last ``\\boxed{...}`` of the response, checked against the ground
  truth by Hugging Face's ``math-verify`` (symbolic equivalence: ``0.5`` equals ``\\frac{1}{2}``).
- :func:`default_compute_score`: picks one of them by ``data_source``, as verl's default does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def _as_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def gsm8k_answer(solution_str: str) -> str | None:
    """The final answer of a GSM8K-style response: after ``####``, else the last number (None if none)."""
    found = _FINAL.findall(solution_str)
    if found:
        return found[-1]
    numbers = _NUMBER.findall(solution_str)
    return numbers[-1] if numbers else None


def gsm8k_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
) -> float:
    """1.0 when the response's final number equals the ground truth's, else 0.0."""
    answer = gsm8k_answer(solution_str)
    truth = gsm8k_answer(str(ground_truth))
    if answer is None or truth is None:
        return 0.0
    a, t = _as_number(answer), _as_number(truth)
    return float(a is not None and t is not None and abs(a - t) < 1e-6)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def boxed_math_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
) -> float:
    """1.0 when the last boxed answer is equivalent to the ground truth (``math-verify``), else 0.0."""
    from math_verify import parse, verify

    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) or truth
    return float(verify(parse(f"${truth}$"), parse(f"\\boxed{{{answer}}}")))


#: data_source substrings -> built-in reward, in the order they are tried.
BUILTIN_BY_SOURCE = (("gsm8k", gsm8k_score), ("math", boxed_math_score), ("boxed", boxed_math_score))


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None
) -> float:
    """The built-in reward for ``data_source`` (GSM8K-style or boxed math); others need a custom one."""
    source = data_source.lower()
    for needle, fn in BUILTIN_BY_SOURCE:
        if needle in source:
            return fn(data_source, solution_str, ground_truth, extra_info)
    raise NereusConfigError(
        f"custom_reward_function.path: no built-in reward for data_source {data_source!r} "
        f"(built in: data sources containing {', '.join(repr(n) for n, _ in BUILTIN_BY_SOURCE)}); "
        "write compute_score(data_source, solution_str, ground_truth, extra_info) in a file and set "
        "custom_reward_function.path=that_file.py"
    )
