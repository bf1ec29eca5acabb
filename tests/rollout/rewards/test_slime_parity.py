"""Parity with slime's `rm_hub`: every built-in grader scores these cases as slime's does.

The expected rewards follow slime's documented grading (`rm_hub.math_utils.grade_answer_verl`,
`deepscaler.get_deepscaler_rule_based_reward`, `math_dapo_utils.compute_score`, `f1.f1_score`,
`gpqa.compute_gpqa_reward`): for `math` and `deepscaler` an answer is the last `\\boxed{}`, equal to the
label when Hendrycks' MATH normalisation makes the strings equal or DeepScaleR's sympy grader shows it;
that grader will not take an unreduced fraction (`2/4` for `1/2`) or a non-integer spelling of an
integer label (`\\sqrt{16}` for `4`). Labels are MATH / DAPO / DeepScaleR style LaTeX. The few places
where this project departs from slime (docs/rewards.md) are tested in test_reward_types.py, not here.

Each math case runs under `math` (the answer boxed in a solution) and `deepscaler` (the same after
`</think>`); the `math_verify` table checks the lenient reading on the same kind of labels.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace

import pytest

from slime.rollout.rewards import compute_reward
from slime.types import Sample

# (category, boxed answer, label, slime's reward)
MATH = [
    # --- the examples: right answers against LaTeX labels
    ("issue", r"\sqrt{2}", r"\sqrt 2", 1),
    ("issue", r"2\sqrt{2}", r"\sqrt{8}", 1),
    ("issue", r"\dfrac{3}{4}", r"\frac34", 1),
    ("issue", r"\infty", r"\infty", 1),
    ("issue", "(1, 2)", "(1,2)", 1),
    ("issue", "[0, 1)", "[0,1)", 1),
    ("issue", "2x+1", "1+2x", 1),
    ("issue", r"\$5", "5", 1),
    ("issue", r"\text{(B)}", "B", 1),
    # --- roots
    ("roots", r"\sqrt2", r"\sqrt{2}", 1),
    ("roots", r"\sqrt{2}", r"\sqrt2", 1),
    ("roots", r"\sqrt 2", r"\sqrt{2}", 1),
    ("roots", r"\sqrt{8}", r"2\sqrt{2}", 1),
    ("roots", r"3\sqrt{3}", r"\sqrt{27}", 1),
    ("roots", r"\sqrt{27}", r"3\sqrt{3}", 1),
    ("roots", r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt3}{2}", 1),
    ("roots", r"\frac{\sqrt3}2", r"\frac{\sqrt{3}}{2}", 1),
    ("roots", r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", 1),
    ("roots", r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}", 1),
    ("roots", r"\sqrt{3}", r"\sqrt{2}", 0),
    ("roots", r"2\sqrt{3}", r"\sqrt{8}", 0),
    ("roots", r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}", 1),
    ("roots", r"\sqrt[3]{8}", "2", 0),  # integer label: the answer must be written as an integer
    ("roots", r"\sqrt{16}", "4", 0),
    ("roots", r"4+2\sqrt{3}", r"2\sqrt{3}+4", 1),
    ("roots", r"1-\sqrt{5}", r"-\sqrt{5}+1", 1),
    ("roots", r"1+\sqrt{5}", r"1-\sqrt{5}", 0),
    # --- fractions in every spelling
    ("fractions", r"\frac{3}{4}", r"\frac34", 1),
    ("fractions", r"\tfrac{3}{4}", r"\frac{3}{4}", 1),
    ("fractions", r"\dfrac34", r"\frac{3}{4}", 1),
    ("fractions", "3/4", r"\frac{3}{4}", 1),
    ("fractions", r"\frac{3}{4}", "3/4", 1),
    ("fractions", "0.75", r"\frac{3}{4}", 1),
    ("fractions", ".75", r"\frac34", 1),
    ("fractions", "0.5", r"\frac{1}{2}", 1),
    ("fractions", r"\frac12", "0.5", 1),
    ("fractions", r"\frac{1}{2}", "1/2", 1),
    ("fractions", r"\frac{2}{4}", r"\frac{1}{2}", 0),  # unreduced
    ("fractions", "2/4", "1/2", 0),
    ("fractions", r"\frac{-1}{2}", r"-\frac{1}{2}", 1),
    ("fractions", "-1/2", r"-\frac{1}{2}", 1),
    ("fractions", r"-\dfrac{1}{2}", r"\frac{-1}{2}", 1),
    ("fractions", r"\frac{1}{-2}", "-1/2", 1),
    ("fractions", r"\frac{3}{5}", r"\frac{3}{4}", 0),
    ("fractions", r"\frac{4}{3}", r"\frac34", 0),
    ("fractions", r"\frac{1}{3}", "0.333", 0),
    ("fractions", "0.3333", r"\frac{1}{3}", 0),
    ("fractions", r"\frac{10}{4}", r"\frac{5}{2}", 0),
    ("fractions", "2.5", r"\frac{5}{2}", 1),
    ("fractions", r"\frac{5}{2}", "2.5", 1),
    ("fractions", r"\frac{7}{1}", "7", 0),
    ("fractions", r"\frac{22}{7}", r"\frac{22}{7}", 1),
    ("fractions", r"\frac{1}{2}", r"\frac{1}{3}", 0),
    # --- mixed numbers
    ("mixed numbers", r"7\frac{3}{4}", r"7\frac{3}{4}", 1),
    ("mixed numbers", "7 3/4", r"7\frac{3}{4}", 1),
    ("mixed numbers", r"\frac{31}{4}", r"7\frac{3}{4}", 1),
    ("mixed numbers", "7.75", r"7\frac{3}{4}", 1),
    ("mixed numbers", r"7\frac{1}{4}", r"7\frac{3}{4}", 0),
    # --- intervals
    ("intervals", "[0,1)", "[0, 1)", 1),
    ("intervals", r"\left[0,1\right)", "[0,1)", 1),
    ("intervals", "(0,1]", "[0,1)", 0),
    ("intervals", "[0,1]", "[0,1)", 0),
    ("intervals", "(0,1)", "[0,1)", 0),
    ("intervals", r"(-\infty, 3)", r"(-\infty,3)", 1),
    ("intervals", r"\left(-\infty,3\right)", r"(-\infty, 3)", 1),
    ("intervals", r"(-\infty, 3]", r"(-\infty,3)", 0),
    ("intervals", r"(3, \infty)", r"(3,\infty)", 1),
    ("intervals", r"[\frac{1}{2}, 2]", r"\left[\frac12,2\right]", 1),
    ("intervals", "[0.5, 2]", r"[\frac{1}{2},2]", 1),
    ("intervals", "[1, 2]", "[2, 1]", 0),
    ("intervals", r"x \in [0,1)", "[0,1)", 0),
    ("intervals", r"(-\infty, -1) \cup (1, \infty)", r"(-\infty,-1)\cup(1,\infty)", 1),
    ("intervals", r"(-\infty,-1)\cup(1,\infty)", r"(-\infty,-1)\cup(2,\infty)", 0),
    # --- tuples and lists
    ("tuples", "(1,2)", "(1, 2)", 1),
    ("tuples", r"\left(1,2\right)", "(1,2)", 1),
    ("tuples", r"\left( 1, 2 \right)", "(1, 2)", 1),
    ("tuples", "(2,1)", "(1,2)", 0),
    ("tuples", "(1,2,3)", "(1,2)", 0),
    ("tuples", "(3, -1)", "(3,-1)", 1),
    ("tuples", r"(\frac{1}{2}, 3)", "(0.5, 3)", 1),
    ("tuples", r"\left(\frac{1}{2}, \sqrt{2}\right)", r"(\frac12,\sqrt2)", 1),
    ("tuples", "(1,000, 2)", "(1000,2)", 1),
    ("tuples", "1, 2", "1,2", 1),
    ("tuples", "2, 1", "1, 2", 0),
    ("tuples", r"1 \text{ and } 2", "1, 2", 1),
    ("tuples", "1 or 2", "1, 2", 1),
    ("tuples", "1 and 2", "1,2", 1),
    ("tuples", r"(1, 2)", "[1, 2]", 0),
    ("tuples", r"\{1,2\}", r"\{1,2\}", 1),
    ("tuples", r"\{2,1\}", r"\{1,2\}", 0),
    # --- \text{} and words
    ("text", r"\text{B}", "B", 1),
    ("text", "B", r"\text{B}", 1),
    ("text", "(B)", r"\text{(B)}", 1),
    ("text", r"\text{(C)}", "B", 0),
    ("text", r"\text{Monday}", "Monday", 1),
    ("text", "monday", r"\text{Monday}", 1),
    ("text", r"\text{Tuesday}", r"\text{Monday}", 0),
    ("text", r"\text{yes}", "yes", 1),
    ("text", "no", r"\text{yes}", 0),
    ("text", r"\textbf{(A)}", "A", 1),
    ("text", r"\text{east}", r"\text{East}", 1),
    # --- units
    ("units", r"5\text{ cm}", "5", 1),
    ("units", r"5 \text{ cm}", "5", 1),
    ("units", "5 cm", "5", 1),
    ("units", r"5\text{ meters}", r"5\text{ m}", 1),
    ("units", "12 inches", "12", 1),
    ("units", "3 hours", "3", 1),
    ("units", r"90 \text{ seconds}", "90", 1),
    ("units", r"6\text{ cm}^2", "6", 1),
    ("units", "6 cm^2", "6", 1),
    ("units", r"5\text{ cm}", "6", 0),
    ("units", r"\$5.00", "5", 1),
    ("units", r"\$ 5", r"\$5", 1),
    ("units", r"\$4.99", "5", 0),
    ("units", r"5 \text{ dollars}", "5", 1),
    ("units", "2 million", "2000000", 0),  # 2*10^6: an integer label needs an integer answer
    ("units", "3 billion", "3000000000", 0),
    # --- percentages
    ("percent", r"50\%", "50", 1),
    ("percent", "50", r"50\%", 1),
    ("percent", r"50 \%", r"50\%", 1),
    ("percent", "50%", "50", 1),
    ("percent", r"12.5\%", "12.5", 1),
    ("percent", r"25\%", "50", 0),
    ("percent", "0.5", r"50\%", 0),
    # --- degrees
    ("degrees", r"30^\circ", "30", 1),
    ("degrees", r"30^{\circ}", "30", 1),
    ("degrees", "30", r"30^\circ", 1),
    ("degrees", r"30^\circ", r"30^{\circ}", 1),
    ("degrees", "30 degrees", "30", 1),
    ("degrees", r"45^\circ", "30", 0),
    ("degrees", r"\frac{\pi}{6}", r"30^\circ", 0),
    # --- infinity
    ("infinity", r"\infty", r"\infty", 1),
    ("infinity", r"-\infty", r"-\infty", 1),
    ("infinity", r"\infty", r"-\infty", 0),
    ("infinity", r"+\infty", r"\infty", 0),
    ("infinity", "inf", r"\infty", 1),
    ("infinity", "0", r"\infty", 0),
    # --- reordered and equivalent expressions
    ("expressions", "1+2x", "2x+1", 1),
    ("expressions", "x^2+2x+1", "(x+1)^2", 1),
    ("expressions", "(x+1)^2", "x^2+2x+1", 1),
    ("expressions", "x^2-1", "(x-1)(x+1)", 1),
    ("expressions", "(x+1)(x-1)", "x^2-1", 1),
    ("expressions", "2x+2", "2(x+1)", 1),
    ("expressions", "a^2+b^2", "b^2+a^2", 1),
    ("expressions", "3x", "x+2x", 1),
    ("expressions", "2x-1", "1+2x", 0),
    ("expressions", "x^2+1", "(x+1)^2", 0),
    ("expressions", r"\frac{x}{2}", "x/2", 1),
    ("expressions", r"\frac{1}{x}", "1/x", 1),
    ("expressions", "6-2y", "-2y+6", 1),
    ("expressions", "2+3i", "3i+2", 1),
    ("expressions", "2-3i", "2+3i", 0),
    ("expressions", r"\pi", r"\pi", 1),
    ("expressions", r"2\pi", r"\pi \cdot 2", 1),
    ("expressions", r"\pi/2", r"\frac{\pi}{2}", 1),
    ("expressions", r"\frac{\pi}{3}", r"\frac{\pi}{2}", 0),
    ("expressions", "3.14", r"\pi", 0),
    ("expressions", r"10^2", "100", 0),  # integer label: the answer must be an integer
    ("expressions", "100", r"10^2", 0),
    ("expressions", r"2^{10}", "1024", 0),
    ("expressions", r"x^{2}", "x^2", 1),
    ("expressions", "abc", "abc", 1),
    ("expressions", "a+b+c+d", "d+c+b+a", 0),  # more than two letters: sympy is not tried
    # --- equations and named values
    ("equations", "x=3", "3", 1),
    ("equations", "3", "x=3", 1),
    ("equations", "k = 7", "7", 1),
    ("equations", "x = 3", "x=3", 1),
    ("equations", "y=3", "x=3", 1),
    ("equations", "abc=3", "3", 0),
    ("equations", "x=4", "3", 0),
    ("equations", "y = 2x + 1", "2x+1", 1),  # a name of at most two characters is dropped
    # --- thousands separators and number spellings
    ("thousands", "1,000", "1000", 1),
    ("thousands", "1000", "1,000", 1),
    ("thousands", "1{,}000", "1000", 1),
    ("thousands", r"1,\!000", "1000", 1),
    ("thousands", "1,000,000", "1000000", 1),
    ("thousands", "10,000", "1000", 0),
    ("thousands", "1,00", "100", 0),
    ("thousands", "5.0", "5", 1),
    ("thousands", "5", "5.0", 1),
    ("thousands", "5.00", "5", 1),
    ("thousands", "1e3", "1000", 1),
    ("thousands", "-3", "-3", 1),
    ("thousands", "- 3", "-3", 1),
    ("thousands", "3", "-3", 0),
    ("thousands", "-0", "0", 1),
    ("thousands", "0.1", ".1", 1),
    ("thousands", "0.10", "0.1", 1),
    ("thousands", "0.2", "0.1", 0),
    # --- wrong answers stay 0
    ("wrong", "12", "13", 0),
    ("wrong", "0", "1", 0),
    ("wrong", "-12", "12", 0),
    ("wrong", "120", "12", 0),
    ("wrong", r"\frac{1}{2}", "2", 0),
    ("wrong", r"\sqrt{2}", "2", 0),
    ("wrong", "x", "y", 0),
    ("wrong", r"\text{Paris}", r"\text{London}", 0),
    ("wrong", "(1,2)", "(1,3)", 0),
    ("wrong", "[0,2)", "[0,1)", 0),
    ("wrong", "", "5", 0),
    ("wrong", " ", "5", 0),
    ("wrong", r"\text{no solution}", "5", 0),
    ("wrong", "2+2", "5", 0),
    ("wrong", r"\infty", "1000000", 0),
]

# (category, response, label, slime's reward): which text is the answer
MATH_EXTRACTION = [
    ("extraction", "The answer is 12.", "12", 0),  # no box, no answer
    ("extraction", "12", "12", 0),
    ("extraction", r"\fbox{12}", "12", 0),
    ("extraction", r"\boxed 12", "12", 0),
    ("extraction", r"first \boxed{11}, then \boxed{12}", "12", 1),
    ("extraction", r"first \boxed{12}, then \boxed{11}", "12", 0),
    ("extraction", r"\boxed{12} and finally \boxed 13", "12", 0),  # the last \boxed opens no brace
    ("extraction", r"$\boxed{\frac{1}{2}}$", "0.5", 1),
    ("extraction", r"\boxed{\boxed{12}}", "12", 1),
    ("extraction", r"\boxed{12", "12", 0),  # truncated
    ("extraction", r"\boxed{\left(1,2\right)}.", "(1,2)", 1),
    ("extraction", r"\boxed{12}", r"\boxed{12}", 1),  # a boxed label is unboxed
    ("extraction", r"\boxed{12}", r"The answer is $\boxed{12}$.", 1),
    ("extraction", r"\boxed{12}", "", 0),
    ("extraction", r"\boxed{12}", None, 0),
    ("extraction", r"\boxed{12}", 12, 1),
    ("extraction", r"\boxed{2.5}", 2.5, 1),
]

# (category, response, label, slime's reward) for deepscaler: the solution follows the reasoning
DEEPSCALER_EXTRACTION = [
    ("deepscaler", r"<think>try 11</think> so \boxed{12}", "12", 1),
    ("deepscaler", r"<think>\boxed{12}</think> so 12", "12", 0),  # a box inside the reasoning does not count
    ("deepscaler", r"\boxed{12}", "12", 0),  # reasoning never closed
    ("deepscaler", r"a</think>b</think> \boxed{12}", "12", 1),  # after the last </think>
    ("deepscaler", r"a</think> \boxed{12} </think> no box", "12", 0),
    ("deepscaler", r"###Response \boxed{12}", "12", 1),
    ("deepscaler", r"###Response \boxed{12} ###Response \boxed{13}", "12", 1),  # up to the next marker
    ("deepscaler", r"</think> \fbox{12}", "12", 0),
    ("deepscaler", r"</think> \boxed{12}", "", 0),
    ("deepscaler", r"</think> \boxed{12}", 12, 1),
    ("deepscaler", r"</think> \boxed{12}", r"\boxed{12}", 1),
    ("deepscaler", r"</think> \boxed{\dfrac{3}{4}}", r"\frac34", 1),
]

# (response, label, slime's {"score", "pred"}) for dapo; acc is score == 1
DAPO = [
    ("Answer: 42", "42", 1.0, "42"),
    ("answer:42", "42", 1.0, "42"),
    ("ANSWER :  42", "42", 1.0, "42"),
    ("Answer: $42$", "42", 1.0, "42"),
    ("Answer: \\boxed{42}", "42", 1.0, "42"),
    ("Answer: $\\boxed{42}$.", "42", 1.0, "42"),
    ("Answer: 42 dollars", "42", 1.0, "42"),
    ("Answer: 42 square units", "42", 1.0, "42"),
    ("Answer: 42^\\circ", "42", 1.0, "42"),
    ("Answer: 42 degrees", "42", 1.0, "42"),
    ("Answer: \\text{42}", "42", 1.0, "42"),
    ("Answer: \\textbf{42}", "42", 1.0, "42"),
    ("Answer: x = 42", "42", 1.0, "42"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("Answer: 1{,}000", "1000", 1.0, "1000"),
    ("Answer: 1000 cents", "1,000", 1.0, "1000"),
    ("Answer: 42", "42.0", 1.0, "42"),
    ("Answer: 42", 42, 1.0, "42"),
    ("Answer: 42", "\\boxed{42}", 1.0, "42"),
    ("Answer: 42", "$42$", 1.0, "42"),
    ("Answer: -42", "-42", 1.0, "-42"),
    ("Answer: \\$42", "42", 1.0, "42"),
    ("Answer: 42.0", "42", -1.0, "42.0"),  # the prediction is not rewritten as an integer
    ("Answer: 4 2", "42", 1.0, "42"),  # spaces are dropped
    ("Answer: 41", "42", -1.0, "41"),
    ("Answer: 420", "42", -1.0, "420"),
    ("Answer: \\frac{84}{2}", "42", -1.0, "\\frac{84}{2}"),
    ("Answer: 42\nAnswer: 43", "42", -1.0, "43"),  # the last Answer: line
    ("Answer: 43\nAnswer: 42", "42", 1.0, "42"),
    ("no answer line, 42", "42", -1.0, "[INVALID]"),
    ("\\boxed{42}", "42", -1.0, "[INVALID]"),
    ("Answer: 42" + "y" * 400, "42", -1.0, "[INVALID]"),  # only the last 300 characters are read
    ("x" * 400 + "Answer: 42", "42", 1.0, "42"),
    ("Answer: $42$ and $43$", "42", 1.0, "42"),  # the first $...$ of the line
    ("Answer: \\frac12", "42", -1.0, "\\frac{1}{2}"),
    ("Answer: \\sqrt2", "42", -1.0, "\\sqrt{2}"),
    ("Answer: 42<|im_end|>", "42", 1.0, "42"),
    ("Answer: an 42", "42", 1.0, "42"),
]

# (response, label, slime's F1)
F1 = [
    ("The Eiffel Tower", "eiffel tower", 1.0),
    ("eiffel tower in Paris", "eiffel tower", 2 * (2 / 4) * 1 / (2 / 4 + 1)),
    ("Paris, France", "Paris", 2 / 3),
    ("London", "Paris", 0.0),
    ("yes", "yes", 1.0),
    ("Yes.", "yes", 1.0),
    ("yes", "No", 0.0),
    ("no", "No", 1.0),
    ("no answer", "noanswer", 0.0),
    ("noanswer", "noanswer", 1.0),
    ("yes it is", "yes", 0.0),  # yes/no must match exactly
    ("", "Paris", 0.0),
    ("a an the", "Paris", 0.0),
    ("The quick brown fox", "quick brown fox", 1.0),
    ("fox brown quick", "quick brown fox", 1.0),  # a bag of tokens
    ("the the the Paris", "The Paris", 1.0),
    ("Paris Paris", "Paris", 2 * 0.5 * 1 / 1.5),
    ("42", "42", 1.0),
    ("forty two", "42", 0.0),
    ("New York City", "new york", 2 * (2 / 3) * 1 / (2 / 3 + 1)),
    ("U.S.A.", "USA", 1.0),
    ("it's", "its", 1.0),
]

# (response, label, metadata, slime's reward)
GPQA = [
    ("The answer is C", "C", {}, 1.0),
    ("The answer is B", "C", {}, 0.0),
    ("answer: b", "B", {}, 1.0),
    ("<think>maybe A</think> Final answer: D", "D", {}, 1.0),
    ("<think>It is D</think> so A", "D", {}, 0.0),
    ("C is correct", "C", {}, 1.0),
    ("I pick (B).", 1, {"choices": ["x", "y", "z"]}, 1.0),
    ("I pick (B).", 2.0, {"choices": ["x", "y", "z"]}, 0.0),
    ("answer: A", "blue", {"choices": ["red", "blue"]}, 0.0),
    ("answer: B", "blue", {"choices": ["red", "blue"]}, 1.0),
    ("It is blue, clearly", "blue", {"choices": ["red", "blue"]}, 1.0),
    ("It is red, clearly", "blue", {"choices": ["red", "blue"]}, 0.0),
    ("Option E", "A", {"choices": ["red", "green", "blue", "black"]}, 0.0),
    ("answer: b", "x", {"correct_letter": "B"}, 1.0),
    ("answer: c", "B", {"correct_letter": "C"}, 1.0),  # metadata's correct letter wins over the label
    ("choice: J", "J", {}, 1.0),
    ("I think the answer is K", "K", {}, 1.0),  # K is no letter (A-J), but the label's text is in the response
    ("The answer is B", "B", {"valid_letters": ["A", "B"]}, 1.0),
    ("The answer is C", "C", {"valid_letters": ["A", "B"]}, 1.0),  # no valid letter: the label's text
    ("Answer: B", "blue", {"choices": {"A": "red", "B": "blue"}}, 1.0),
    ("the correct one is y", "Z", {"choices": ["x", "y", "z"], "correct_answer": "y"}, 1.0),  # correct_answer
    ("Answer is (c)", "C", {}, 0.0),  # the case-blind pattern reads the "i" of "is" as option I
    ("", "C", {}, 0.0),
    ("B and C", "C", {}, 1.0),  # no pattern matches: the last stand-alone valid letter
    ("final option: A", "A", {}, 1.0),
]

# (category, response, label, reward) for the lenient math_verify: unboxed answers count, the label is LaTeX
MATH_VERIFY = [
    *[("issue", rf"\boxed{{{answer}}}", label, 1.0) for category, answer, label, _ in MATH if category == "issue"],
    ("issue", r"so the answer is $\sqrt{2}$", r"\sqrt 2", 1.0),
    ("unboxed", "19<|im_end|>", "19", 1.0),
    ("unboxed", "18<|im_end|>", "19", 0.0),
    ("unboxed", "The answer is 3/4.", r"\frac34", 1.0),
    ("unboxed", r"The answer is $\frac{3}{4}$.", "0.75", 1.0),
    ("unboxed", r"so $x \in [0,1)$", "[0,1)", 1.0),
    ("boxes", r"\fbox{12}", "12", 1.0),
    ("boxes", r"\boxed 12", "12", 1.0),
    ("boxes", r"\boxed{11} then \boxed{12}", "12", 1.0),
    ("lenient", r"\boxed{\frac{2}{4}}", r"\frac12", 1.0),  # where slime's graders are strict
    ("lenient", r"\boxed{\sqrt{16}}", "4", 1.0),
    ("lenient", r"\boxed{\{2,1\}}", r"\{1,2\}", 1.0),
    ("lenient", r"\boxed{x \in [0,1)}", "[0,1)", 1.0),
    ("fallback", r"\boxed{7 3/4}", r"7\frac{3}{4}", 1.0),  # slime's sympy grader reads the mixed number
    ("wrong", r"\boxed{13}", "12", 0.0),
    ("wrong", r"\boxed{\sqrt{3}}", r"\sqrt 2", 0.0),
    ("wrong", r"\boxed{(2, 1)}", "(1,2)", 0.0),
    ("wrong", r"\boxed{(0, 1]}", "[0,1)", 0.0),
    ("wrong", r"\boxed{2x-1}", "1+2x", 0.0),
    ("wrong", r"\boxed{-\infty}", r"\infty", 0.0),
    ("wrong", r"\boxed{\text{(C)}}", "B", 0.0),
    ("wrong", r"\boxed{45^\circ}", "30", 0.0),
    ("wrong", "no answer here", "12", 0.0),
    ("wrong", r"\boxed{12}", "", 0.0),
]


def _reward(rm_type: str, response: str, label, metadata=None):
    sample = Sample(response=response, label=label, metadata=dict(metadata or {}))
    return asyncio.run(compute_reward(Namespace(rm_type=rm_type), sample))


def _ids(cases):
    return [f"{case[0]}:{case[1]!s:.40}->{case[2]!s:.30}" for case in cases]


@pytest.mark.parametrize(("category", "answer", "label", "expected"), MATH, ids=_ids(MATH))
def test_math(category, answer, label, expected):
    assert _reward("math", rf"Adding them up, the answer is $\boxed{{{answer}}}$.", label) == expected


@pytest.mark.parametrize(("category", "answer", "label", "expected"), MATH, ids=_ids(MATH))
def test_deepscaler(category, answer, label, expected):
    response = rf"<think>Let me check the cases again.</think> The answer is $\boxed{{{answer}}}$."
    assert _reward("deepscaler", response, label) == expected


@pytest.mark.parametrize(("category", "response", "label", "expected"), MATH_EXTRACTION, ids=_ids(MATH_EXTRACTION))
def test_math_extraction(category, response, label, expected):
    assert _reward("math", response, label) == expected


@pytest.mark.parametrize(("category", "response", "label", "expected"), DEEPSCALER_EXTRACTION,
                         ids=_ids(DEEPSCALER_EXTRACTION))
def test_deepscaler_extraction(category, response, label, expected):
    assert _reward("deepscaler", response, label) == expected


@pytest.mark.parametrize(("response", "label", "score", "pred"), DAPO, ids=[f"{r!s:.40}->{lab}" for r, lab, *_ in DAPO])
def test_dapo(response, label, score, pred):
    assert _reward("dapo", response, label) == {"score": score, "acc": score == 1.0, "pred": pred}


@pytest.mark.parametrize(("response", "label", "expected"), F1)
def test_f1(response, label, expected):
    assert _reward("f1", response, label) == pytest.approx(expected)
    assert _reward("boxed_f1", rf"so \boxed{{{response}}}", label) == pytest.approx(expected)


@pytest.mark.parametrize(("response", "label", "metadata", "expected"), GPQA)
def test_gpqa(response, label, metadata, expected):
    assert _reward("gpqa", response, label, metadata) == expected


@pytest.mark.parametrize(("category", "response", "label", "expected"), MATH_VERIFY, ids=_ids(MATH_VERIFY))
def test_math_verify(category, response, label, expected):
    assert _reward("math_verify", response, label) == expected


def test_the_tables_cover_every_category_with_enough_cases():
    categories = {case[0] for case in MATH}
    assert {"issue", "roots", "fractions", "intervals", "tuples", "text", "units", "percent", "degrees", "infinity",
            "expressions", "thousands", "wrong"} <= categories
    assert sum(1 for case in MATH if case[3] == 0) >= 60  # wrong answers that must stay 0
    total = 2 * len(MATH) + len(MATH_EXTRACTION) + len(DEEPSCALER_EXTRACTION) + len(DAPO) + 2 * len(F1) + len(GPQA)
    assert total >= 300
