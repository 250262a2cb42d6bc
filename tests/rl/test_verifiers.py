"""The built-in GSM8K reward reads the answer as the README says: after ``####``, else the last number."""

from __future__ import annotations

from nereus_lightning.rl.verifiers import gsm8k_score


def test_the_answer_after_the_marks_else_the_last_number():
    assert gsm8k_score("gsm8k", "3 + 4 = 7 apples\n#### 7", "#### 7") == 1.0
    assert gsm8k_score("gsm8k", "#### 7, not the 9 I first wrote", "7") == 1.0  # the marked one wins
    assert gsm8k_score("gsm8k", "3 + 4 makes 7", "7") == 1.0  # no ####: the last number
    assert gsm8k_score("gsm8k", "7 ... or 8", "7") == 0.0
    assert gsm8k_score("gsm8k", "no number at all", "1,000") == 0.0
    assert gsm8k_score("gsm8k", "it is 1,000.", "1000") == 1.0
