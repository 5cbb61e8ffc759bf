"""`--rm-type math`: boxed-answer grader with MATH normalisation and a sympy equivalence check.

This reproduces the behaviour of the grader the Sparse-RL authors trained with (slime's `rm_type == "math"`,
`grade_answer_verl` in slime/rollout/rm_hub/math_utils.py, itself taken from DeepScaleR), written anew:

1. Extraction: the content of the LAST `\\boxed{...}` (nested braces balanced; `\\fbox{...}` accepted too).
   No box -> reward 0. There is no "the answer is X" / last-number fallback: the authors' grader has none,
   and their prompts ask for `\\boxed{}`. A label that itself contains a box is reduced to its content.
2. Stage 1 (Hendrycks MATH `strip_string`): purely textual normalisation (\\left/\\right, dfrac/tfrac,
   degrees, units after `\\text{ `, percent, `\\frac12` -> `\\frac{1}{2}`, `0.5` -> `\\frac{1}{2}`, `a/b`,
   `k = ...`, spaces). Equal strings -> correct.
3. Stage 2 (DeepScaleR `grade_answer_sympy`): a more aggressive normalisation (unit words, thousands
   separators, `10.0` -> `10`, LaTeX -> plain expression, lower case), element-wise comparison of tuples
   and intervals (bracket types must match), and `sympy.simplify(a - b) == 0` for the rest, with the
   authors' strictness rules: an integer answer must match an integer exactly, and `a/b` fractions must be
   written identically (an unreduced `2/4` is not `1/2`).

Deliberate differences from the reference, all in edge cases: LaTeX is converted by our own small
translator (the reference used pylatexenc, not a dependency here); `\\sqrt3`/`\\frac12` fixes only take
letters/digits (the reference mangled `\\sqrt[3]{x}` and `\\frac\\pi2`); unit words are removed only as whole
words (the reference turned "Tuesday" into "Tues"); infinity is sympy's `oo`; known function names do
not count as unknown letters in the "too many variables" guard. Hangs are bounded by the caller (worker
processes with a timeout), not here.
"""

from __future__ import annotations

import math
import re
from typing import Any

import sympy
from sympy.parsing import sympy_parser

from slime_sparse.reward.registry import register_reward

from .latex import latex_to_plain, read_braced

# ----------------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------------

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def last_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, or None (no box, or braces unbalanced)."""
    matches = list(_BOX_COMMAND.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text) or text[i] != "{":
        return None  # `\boxed 5`: the reference grader does not accept the brace-less form either
    braced = read_braced(text, i)
    return None if braced is None else braced[0]


def label_candidates(label: Any) -> list[str]:
    """Acceptable answers for a label: a string, a number, or a list/tuple of those (any may match)."""
    if label is None:
        return []
    if isinstance(label, (list, tuple)):
        return [answer for item in label for answer in label_candidates(item)]
    if isinstance(label, bool) or not isinstance(label, (str, int, float)):
        raise TypeError(f"math reward labels must be str, int, float or a list of them, got {type(label).__name__}")
    text = str(label).strip()
    if "\\boxed" in text or "\\fbox" in text:
        boxed = last_boxed_answer(text)
        return [] if boxed is None else [boxed]
    return [text] if text else []


# ----------------------------------------------------------------------------------------------------
# Stage 1: Hendrycks MATH string normalisation
# ----------------------------------------------------------------------------------------------------


def _unwrap_text(answer: str) -> str:
    """`\\text{Tuesday}` -> `Tuesday`, only when the whole answer is one `\\text{...}` group."""
    if answer.startswith("\\text{"):
        braced = read_braced(answer, len("\\text"))
        if braced is not None and braced[1] == len(answer) and braced[0]:
            return braced[0]
    return answer


def _fix_sqrt(s: str) -> str:
    r"""`\sqrt3` / `\sqrt 3` -> `\sqrt{3}` (the radicand is one letter or digit, as TeX reads it)."""
    return re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)


def _fix_fracs(s: str) -> str:
    r"""`\frac12` -> `\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}`, `\frac{a}2` -> `\frac{a}{2}`."""
    s = re.sub(r"\\frac([0-9A-Za-z])([0-9A-Za-z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([0-9A-Za-z])\{", r"\\frac{\1}{", s)
    return re.sub(r"(\\frac\{[^{}]*\})([0-9A-Za-z])", r"\1{\2}", s)


def _fix_a_slash_b(s: str) -> str:
    r"""A plain integer ratio `3/4` -> `\frac{3}{4}` (the MATH labels write fractions that way)."""
    match = re.fullmatch(r"(-?[0-9]+)/([0-9]+)", s)
    if match and all(str(int(part)) == part for part in match.groups()):
        return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}"
    return s


def normalize_math_string(answer: str) -> str:
    """Hendrycks-MATH style textual normalisation (stage 1). Pure string rewriting, never raises."""
    s = _unwrap_text(answer.strip()).strip()
    s = s.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")  # degrees
    s = s.replace("\\$", "")
    # "\text{ " (with a space) only introduces units in MATH answers: keep what precedes it.
    s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    # Leading-dot decimals: ".5" -> "0.5".
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    # "k = 5" / "x=5" -> "5" (a short left-hand side is a variable name).
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


# ----------------------------------------------------------------------------------------------------
# Stage 2: expression normalisation and sympy equivalence
# ----------------------------------------------------------------------------------------------------

_UNIT_WORDS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
    "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_UNIT_PATTERN = re.compile(r"(?<![A-Za-z])(?:" + "|".join(_UNIT_WORDS) + r")(?:es|s)?(?![A-Za-z]) *(?:\^[0-9]+)?")
_MAGNITUDES = (("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"))
# Names our LaTeX translation emits; they are not unknown variables for the "too many letters" guard.
_KNOWN_NAMES = ("sqrt", "root", "frac", "pi", "oo")


def _strip_thousands_commas(expr: str) -> str:
    """`1,234,567` -> `1234567`, leaving tuple commas such as `(1,23)` alone."""
    previous = None
    while previous != expr:
        previous, expr = expr, re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", expr)
    return expr


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _str_is_int(text: str) -> bool:
    try:
        value = float(_strip_thousands_commas(text))
    except ValueError:
        return False
    return math.isfinite(value) and abs(value - round(value)) <= 1e-7


def _is_fraction(text: str) -> bool:
    return re.fullmatch(r"-?[0-9]+/0*[1-9][0-9]*", text) is not None


def normalize_expression(answer: str) -> str:
    """DeepScaleR-style normalisation (stage 2): text for element-wise and sympy comparison."""
    expr = _unwrap_text(answer)
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , ")):
        expr = expr.replace(old, new)
    for word, power in _MAGNITUDES:
        expr = expr.replace(word, power)
    expr = _UNIT_PATTERN.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)  # 1,\!000 thousands separator
    if _is_float(expr) and _str_is_int(expr):
        expr = str(int(round(float(expr))))  # "10.0" -> "10"
    if "\\" in expr:
        try:
            expr = latex_to_plain(expr)
        except (ValueError, RecursionError):
            pass  # malformed (or absurdly nested) LaTeX: compare it as text
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # mixed number "7 3/4" -> "7+3/4"
    expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(round(float(_strip_thousands_commas(expr)))))
    return expr


def split_tuple(expr: str) -> list[str]:
    """Elements of a tuple/interval such as `(a,b]` or `(1,(8pi)/7)`; anything else is one element.

    Splits on the top-level commas when one bracket pair encloses the whole expression (the reference
    required no inner brackets at all; our LaTeX translation adds parentheses, e.g. `\\frac{8\\pi}{7}` ->
    `(8pi)/7`, so nesting must be allowed). `(1,2)u(3,4)` is not enclosed by one pair: not split.
    """
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    if len(expr) <= 2 or expr[0] not in "([" or expr[-1] not in ")]":
        return [expr]
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(expr):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth == 0 and i != len(expr) - 1:
                return [expr]  # the opening bracket closes before the end
        elif ch == "," and depth == 1:
            elements.append(expr[start:i].strip())
            start = i + 1
    if depth != 0:
        return [expr]  # unbalanced brackets
    elements.append(expr[start:-1].strip())
    return elements


def _sympy_allowed(expr: str) -> bool:
    """Refuse inputs on which sympy tends to hang or guess: >2 unknown letters, big/nested powers."""
    letters = expr
    for name in _KNOWN_NAMES:
        letters = letters.replace(name, "")
    if len({ch for ch in letters if ch.isalpha()}) > 2:
        return False
    if "^{" in expr or "^(" in expr:
        return False
    return re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr) is None


# parse_expr evaluates Python: give it sympy's public names and no builtins (model output is untrusted).
_SYMPY_GLOBALS: dict[str, Any] = {name: obj for name, obj in vars(sympy).items() if not name.startswith("_")}
_SYMPY_GLOBALS["__builtins__"] = {}
_TRANSFORMATIONS = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)


def _parse_sympy(expr: str) -> sympy.Basic:
    return sympy_parser.parse_expr(
        expr.replace("^", "**"), local_dict={}, global_dict=dict(_SYMPY_GLOBALS), transformations=_TRANSFORMATIONS
    )


def sympy_equal(a: str, b: str) -> bool:
    """Whether two normalised expressions are equal under sympy (False whenever parsing fails)."""
    if not (_sympy_allowed(a) and _sympy_allowed(b)):
        return False
    try:
        lhs, rhs = _parse_sympy(a), _parse_sympy(b)
        if lhs == rhs:
            return True
        return sympy.simplify(lhs - rhs) == 0
    except Exception:  # noqa: BLE001 - any parse/simplify failure means "not shown equal"
        return False


def _elements_equal(truth: str, given: str) -> bool:
    if _is_fraction(truth) and _is_fraction(given):
        return truth == given  # an unreduced fraction is not accepted
    if _str_is_int(truth) != _str_is_int(given):
        return False  # an integer answer must be matched by an integer, without simplification
    return sympy_equal(truth, given)


def sympy_grade(given: str, truth: str) -> bool:
    """Stage 2 comparison of a given answer against the ground truth."""
    truth_n, given_n = normalize_expression(truth), normalize_expression(given)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_elems, given_elems = split_tuple(truth_n), split_tuple(given_n)
    if len(truth_elems) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False  # (a, b) vs [a, b]: interval/tuple brackets must agree
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_equal(t, g) for t, g in zip(truth_elems, given_elems, strict=True))


def is_equivalent(given: str, truth: str) -> bool:
    """Stage 1 string match, else stage 2 element-wise/sympy match."""
    if normalize_math_string(given) == normalize_math_string(truth):
        return True
    return sympy_grade(given, truth)


@register_reward("math")
def grade_math(response: str, label: Any, **kwargs: Any) -> float:
    """1.0 when the last boxed answer of `response` matches the label (or one of a list of labels)."""
    truths = label_candidates(label)
    given = last_boxed_answer(response)
    if given is None or not truths:
        return 0.0
    return 1.0 if any(is_equivalent(given, truth) for truth in truths) else 0.0
