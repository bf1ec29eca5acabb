"""Built-in graders, each on correct, wrong, malformed and equivalent-form answers (hand-checked)."""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace

import pytest

from slime.errors import DataFormatError
from slime.rollout.rewards import compute_reward
from slime.rollout.rewards.boxed import boxed_answer, last_boxed
from slime.rollout.rewards.dapo import dapo_reward, normalize_answer
from slime.rollout.rewards.deepscaler import deepscaler_reward
from slime.rollout.rewards.f1 import f1_reward
from slime.rollout.rewards.gpqa import gpqa_reward
from slime.rollout.rewards.math_rm import math_reward, math_verify_reward
from slime.types import Sample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # last box, nested braces
        ("\\fbox{7}", "7"),
        ("\\boxed 5 done", "5"),
        ("no box here", None),
        ("\\boxed{\\frac{1}{2}", None),  # unclosed: a truncated response has no answer
        ("", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{3} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\boxed{5}}", "5"),  # the last `\\boxed` is the inner one
        ("\\fbox{7}", None),  # slime reads only \\boxed{...}
        ("\\boxed 5 done", None),
        ("\\boxed{5} and later \\boxed 7", None),  # the last \\boxed opens no brace: no answer at all
        ("\\boxed{\\frac{1}{2}", None),
        ("no box", None),
        ("", None),
    ],
)
def test_boxed_answer_reads_as_slime(text, expected):
    assert boxed_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("19<|im_end|>", "19", 1.0),  # the tiny kit's answer format: bare number + end token
        ("19", 19, 1.0),  # numeric label
        ("18<|im_end|>", "19", 0.0),
        ("190", "19", 0.0),
        ("1/2", "0.5", 1.0),  # equivalent forms
        ("\\frac{1}{2}", "1/2", 1.0),
        ("The answer is \\boxed{\\frac{2}{4}}.", "0.5", 1.0),
        ("first \\boxed{3}, finally \\boxed{4}", "4", 1.0),  # the last box is the answer
        ("first \\boxed{4}, finally \\boxed{3}", "4", 0.0),
        ("", "19", 0.0),  # malformed: empty, no number, garbage
        ("<|im_end|>", "19", 0.0),
        ("abc", "19", 0.0),
        ("19", "", 0.0),  # no label: nothing is correct
        ("19", None, 0.0),
        ("x", "\\boxed{19}", 0.0),
        ("19", "\\boxed{19}", 1.0),  # a boxed label is unboxed
    ],
)
def test_math_verify(response, label, expected):
    assert math_verify_reward(response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("19<|im_end|>", "19", 0.0),  # slime's math needs a boxed answer
        ("so \\boxed{19}<|im_end|>", "19", 1.0),
        ("\\boxed{19}", 19, 1.0),
        ("\\boxed{0}", 0, 1.0),  # departure: slime's `if not ground_truth` drops a numeric 0 label
        ("\\boxed{0}", "0", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),  # sympy grader: unreduced fractions do not count
        ("\\boxed{\\sqrt{16}}", "4", 0.0),  # an integer label needs an integer answer
        ("\\boxed{19}", "", 0.0),
        ("\\boxed{19}", None, 0.0),
        ("\\boxed{19}", "\\boxed{19}", 1.0),
        ("\\boxed{19}", "\\boxed{19", 0.0),  # an unclosed boxed label has no answer
    ],
)
def test_math(response, label, expected):
    assert math_reward(response, label) == expected


def test_math_verify_scores_tiny_kit_answers(tiny_kit):
    """Every tiny-kit label, written the way its SFT data teaches (number then <|im_end|>), scores 1;
    an off-by-one answer scores 0."""
    rows = [json.loads(line) for line in tiny_kit.train.read_text().splitlines()[:50]]
    sft = [json.loads(line) for line in tiny_kit.sft.read_text().splitlines()[:5]]
    assert all(r["messages"][-1]["content"].lstrip("-").isdigit() for r in sft)  # bare numbers, as assumed
    for row in rows:
        assert math_verify_reward(f"{row['label']}<|im_end|>", row["label"]) == 1.0, row
        assert math_verify_reward(f"{int(row['label']) + 1}<|im_end|>", row["label"]) == 0.0, row


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("think... </think> so \\boxed{12}", "12", 1.0),
        ("think </think> \\boxed{0.5}", "1/2", 1.0),
        ("think </think> \\boxed{13}", "12", 0.0),
        ("\\boxed{12}", "12", 0.0),  # reasoning never closed
        ("</think> 12", "12", 0.0),  # no boxed answer
        ("\\boxed{12} </think> nothing", "12", 0.0),  # the box must be after </think>
        ("###Response \\boxed{12}", "12", 1.0),
        ("</think> \\boxed{12}", "", 0.0),
    ],
)
def test_deepscaler(response, label, expected):
    assert deepscaler_reward(response, label) == expected


def test_deepscaler_label_of_another_type_is_a_data_error():
    with pytest.raises(DataFormatError, match="deepscaler: the label must be a string or a number, not list"):
        deepscaler_reward("</think> \\boxed{1}", [1])


@pytest.mark.parametrize(
    ("response", "label", "score", "pred"),
    [
        ("work...\nAnswer: 42", "42", 1.0, "42"),
        ("Answer: 1,000 dollars", "1000", 1.0, "1000"),  # thousands separator and unit dropped
        ("Answer: x = 7", "7.0", 1.0, "7"),  # after '=', integral label
        ("Answer: $\\boxed{9}$", "9", 1.0, "9"),
        ("Answer: 41", "42", -1.0, "41"),
        ("Answer: 3\nmore\nAnswer: 42", "42", 1.0, "42"),  # the last Answer: line counts
        ("the result is 42", "42", -1.0, "[INVALID]"),  # no Answer: line
        ("", "42", -1.0, "[INVALID]"),
    ],
)
def test_dapo(response, label, score, pred):
    assert dapo_reward(response, label) == {"score": score, "acc": score == 1.0, "pred": pred}


@pytest.mark.parametrize(("response", "label", "score"), [
    ("Answer: 0.5", "0.5", 1.0),  # slime truncates the label to "0": the right answer would score -1
    ("Answer: 0", "0.5", -1.0),
    ("Answer: \\frac{1}{2}", "\\frac12", 1.0),  # slime raises ValueError on a label that is no number
])
def test_dapo_departs_where_slime_truncates_or_raises(response, label, score):
    assert dapo_reward(response, label)["score"] == score


@pytest.mark.parametrize("label", [None, "", "  "])
def test_dapo_without_label_is_a_data_error(label):
    with pytest.raises(DataFormatError, match="rm_type dapo needs a label"):
        dapo_reward("Answer: 1", label)


def test_dapo_reads_only_the_tail():
    early = "Answer: 42\n" + "x" * 400
    assert dapo_reward(early, "42")["score"] == -1.0


def test_dapo_normalisation():
    assert normalize_answer("\\text{5} inches") == "5"
    assert normalize_answer("\\frac12") == "\\frac{1}{2}"


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower", 1.0),  # articles, case
        ("Paris, France", "Paris", 2 * 0.5 * 1 / 1.5),  # precision 1/2, recall 1 -> 2/3
        ("London", "Paris", 0.0),
        ("yes", "no", 0.0),
        ("yes", "yes", 1.0),
        ("no idea", "no", 0.0),  # 'no' must match exactly
        ("", "Paris", 0.0),
        (None, "Paris", 0.0),
    ],
)
def test_f1(response, label, expected):
    assert f1_reward(response, label) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("response", "label", "metadata", "expected"),
    [
        ("The answer is C", "C", {}, 1.0),
        ("The answer is B", "C", {}, 0.0),
        ("<think>maybe A</think> Final answer: D", "D", {}, 1.0),  # thinking is ignored
        ("I pick (B).", 1, {"choices": ["x", "y", "z"]}, 1.0),  # integer label = option index
        ("answer: A", "blue", {"choices": ["red", "blue"]}, 0.0),  # label text -> letter B
        ("answer: B", "blue", {"choices": ["red", "blue"]}, 1.0),
        ("It is blue, clearly", "blue", {"choices": ["red", "blue"]}, 1.0),  # no letter: option text
        ("Option E", "A", {"choices": ["red", "green", "blue", "black"]}, 0.0),  # E is no option here
        ("answer: b", "x", {"correct_letter": "B"}, 1.0),  # metadata's correct letter wins
        ("", "C", {}, 0.0),
        (None, "C", {}, 0.0),
    ],
)
def test_gpqa(response, label, metadata, expected):
    assert gpqa_reward(response, label, metadata) == expected


async def _score(rm_type, response, label):
    return await compute_reward(Namespace(rm_type=rm_type), Sample(response=response, label=label))


@pytest.mark.parametrize(
    ("rm_type", "response", "label", "expected"),
    [
        ("boxed_math", "I think 5. \\boxed{4}", "4", 1.0),  # departure: slime's boxed_math always gives 0
        ("boxed_math", "4", "4", 0.0),  # no box: the graded text is empty
        ("boxed_math_verify", "5 \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("boxed_f1", "blah \\boxed{eiffel tower}", "The Eiffel Tower", 1.0),
        ("math", "\\boxed{4} then 5", "4", 1.0),
        ("math_verify", "\\boxed{4} then 5", "4", 1.0),  # math-verify prefers the boxed answer too
    ],
)
def test_boxed_prefix_grades_only_the_last_box(rm_type, response, label, expected):
    assert asyncio.run(_score(rm_type, response, label)) == expected


def test_random_gives_zero_or_one():
    values = {asyncio.run(_score("random", "x", "y")) for _ in range(60)}
    assert values == {0.0, 1.0}  # 60 fair coin flips all equal: probability 2**-59
