"""DeepScaleR's sympy grader: the second check of slime's `math` and `deepscaler` (after `hendrycks`).

Both answers are normalised (below); equal strings match. Otherwise both are split into elements when
they are a tuple or interval (`(1, 2)`, `[0, 1)`: the brackets must be the same on both sides) and
compared element by element:

* two plain fractions (`3/4`) must be written the same: an unreduced `2/4` is not `1/2`;
* an integer label needs an integer answer (`4` is not `\\sqrt{16}` or `8/2`): the model must simplify;
* anything else matches when sympy simplifies `(label) - (answer)` to 0, which is tried only for at most
  two distinct letters and no `^{`, `^(`, or two-digit exponents (where sympy can hang).

Normalisation: a whole-answer `\\text{}` is unwrapped; `$`, `%`, units (degree, cm, meter, mile, second,
minute, hour, day, week, month, year, foot/feet, inch, yard, with plural and power), `^\\circ` and
thousands separators are dropped; `million`/`billion`/`trillion` become powers of ten; ` or `/` and `
become commas; LaTeX is turned into text by pylatexenc (`\\frac{1}{2}` -> `1/2`, `\\sqrt{2}` ->
`sqrt(2)`, `\\pi` -> `pi`, `\\infty` -> `inf`); `7 3/4` is the mixed number `7+3/4`; case, spaces and
braces are dropped. These are the rules of slime's `rm_hub.math_utils.grade_answer_sympy`, kept rule
for rule so the two grade alike; sympy work belongs in the grading process (`grading_process`), which
bounds its time.
"""

from __future__ import annotations

import contextlib
import re

import sympy
from pylatexenc.latex2text import LatexNodes2Text
from sympy.parsing import sympy_parser

_TEXT_ONLY = re.compile(r"^\\text\{(?P<text>.+?)\}$")
_UNITS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard"]
_UNIT_PATTERNS = [re.compile(rf"{unit}(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS]
_SCALES = [("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")]
_UNICODE = [("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")]
_THOUSANDS = re.compile(r"(\d),(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_BRACKETS = "()[]"
# Where sympy may never return: powers of braced or parenthesised exponents, stacked or long exponents.
_UNSAFE_SUBSTRINGS = ["^{", "^("]
_UNSAFE_PATTERNS = [re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+")]
# sympy's public names (pi, sqrt, ...) and no Python builtins: parse_expr evaluates the text it is given.
_SYMPY_NAMES = {name: value for name, value in vars(sympy).items() if not name.startswith("_")}
_TRANSFORMATIONS = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_integral(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def drop_thousands_separators(text: str) -> str:
    """`1,000,000` -> `1000000`; commas between tuple elements (`1,2`, `1, 234`) stay."""
    while True:
        shorter = _THOUSANDS.sub(r"\1\2\3", text)
        if shorter == text:
            return text
        text = shorter


def _str_is_int(text: str) -> bool:
    try:
        return _is_integral(float(drop_thousands_separators(text)))
    except ValueError:
        return False


def _latex_to_text(text: str) -> str:
    text = text.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    text = LatexNodes2Text().latex_to_text(text)
    for symbol, name in _UNICODE:
        text = text.replace(symbol, name)
    return text.strip()


def sympy_normalize(expr: str | None) -> str | None:
    """The normalised text of an answer (None stays None); see the module docstring."""
    if expr is None:
        return None
    match = _TEXT_ONLY.search(expr)
    if match is not None:
        expr = match.group("text")
    expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in _SCALES:
        expr = expr.replace(word, power)
    for unit in _UNIT_PATTERNS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _is_float(expr) and _is_integral(float(expr)):
        expr = str(int(round(float(expr))))
    if "\\" in expr:
        with contextlib.suppress(Exception):  # pylatexenc gives up on malformed LaTeX: keep the text as it is
            expr = _latex_to_text(expr)
    expr = re.sub("- *", "-", expr)  # "- 3" -> "-3" before the mixed-number rule reads "7 3" as 7+3
    expr = re.sub("([0-9]) +([0-9])", r"\1+\2", expr)
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _letters(expr: str) -> int:
    return len({ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()})


def _safe_to_evaluate(expr: str) -> bool:
    if _letters(expr) > 2:
        return False
    if any(bad in expr for bad in _UNSAFE_SUBSTRINGS):
        return False
    return not any(pattern.search(expr) for pattern in _UNSAFE_PATTERNS)


def _sympy_zero(truth: str, given: str) -> bool:
    """Whether sympy simplifies `(truth) - (given)` to 0 (False when it cannot parse or it is unsafe)."""
    difference = f"({truth})-({given})"
    if not _safe_to_evaluate(difference):
        return False
    try:
        parsed = sympy_parser.parse_expr(difference.replace("^", "**"), local_dict={},
                                         global_dict={"__builtins__": {}, **_SYMPY_NAMES},
                                         transformations=_TRANSFORMATIONS)
        return sympy.simplify(parsed) == 0
    except Exception:  # any parse or simplify failure means "not shown equal", as in the original
        return False


def _elements(expr: str) -> list[str]:
    """A tuple or interval's elements (`(1,2)` -> ["1", "2"]); anything else is one element."""
    expr = drop_thousands_separators(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and not any(b in inner for b in _BRACKETS):
        return [element.strip() for element in inner.split(",")]
    return [expr]


def _elements_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # an unreduced fraction is not the answer
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer must be given as an integer
    return _sympy_zero(truth, given)


def sympy_equal(given: str | None, truth: str | None) -> bool:
    """Whether `given` equals `truth` under the normalisation and element-wise sympy check above."""
    truth_n, given_n = sympy_normalize(truth), sympy_normalize(given)
    if truth_n is None or given_n is None:
        return False
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elements, given_elements = _elements(truth_n), _elements(given_n)
    if len(truth_elements) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # a tuple or interval needs the same brackets
    if len(truth_elements) != len(given_elements):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elements, given_elements, strict=True))
