"""LaTeX -> plain expression, the small translator behind `--rm-type math`'s second stage (math_grader.py):
fractions, roots, text commands and symbols become what sympy's parser reads. Our own, in place of the
reference's pylatexenc (not a dependency here)."""
from __future__ import annotations

import re


def read_braced(text: str, start: int) -> tuple[str, int] | None:
    """`text[start]` is "{": return (content, index after the matching "}") or None if unbalanced."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


# LaTeX -> plain-expression translation tables.
_FRAC_COMMANDS = {"frac", "dfrac", "tfrac", "cfrac"}
_TEXT_COMMANDS = {"text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "operatorname", "boxed"}
_SYMBOLS = {
    "pi": "pi", "infty": "oo", "infinity": "oo", "cdot": "*", "times": "*", "div": "/", "cup": "U",
    "cap": "&", "le": "<=", "leq": "<=", "ge": ">=", "geq": ">=", "ne": "!=", "neq": "!=", "ldots": "...",
    "dots": "...", "cdots": "...", "%": "", "$": "", "{": "", "}": "", "circ": "",
}  # fmt: skip
_DROPPED = {
    "left", "right", "displaystyle", "textstyle", ",", ";", ":", "!", " ", "quad", "qquad",
    "big", "Big", "bigl", "bigr", "Bigl", "Bigr",
}  # fmt: skip


def _read_command(expr: str, i: int) -> tuple[str, int]:
    """`expr[i]` is a backslash: return the command name and the index after it."""
    j = i + 1
    if j < len(expr) and expr[j].isalpha():
        while j < len(expr) and expr[j].isalpha():
            j += 1
        return expr[i + 1 : j], j
    return expr[i + 1 : j + 1], j + 1


def _read_argument(expr: str, i: int) -> tuple[str, int]:
    """One TeX argument starting at `expr[i]`: a braced group, a command, or a single character."""
    while i < len(expr) and expr[i] == " ":
        i += 1
    if i >= len(expr):
        raise ValueError("missing argument")
    if expr[i] == "{":
        braced = read_braced(expr, i)
        if braced is None:
            raise ValueError("unbalanced braces")
        return braced
    if expr[i] == "\\":
        _, j = _read_command(expr, i)
        return expr[i:j], j
    return expr[i], i + 1


def _as_operand(plain: str) -> str:
    """Parenthesise unless a number or single letter, so `\\frac{1}{2}` stays the `1/2` the rules expect."""
    return plain if re.fullmatch(r"[0-9.]+|[A-Za-z]", plain) else f"({plain})"


def latex_to_plain(expr: str) -> str:
    """Translate a LaTeX answer into text sympy's parser reads (`\\frac{a}{b}` -> `a/b`, `\\sqrt{x}` -> `sqrt(x)`).

    Raises ValueError on malformed input (unbalanced braces, a command missing its argument).
    """
    out: list[str] = []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch == "\\":
            name, i = _read_command(expr, i)
            if name in _FRAC_COMMANDS:
                num, i = _read_argument(expr, i)
                den, i = _read_argument(expr, i)
                out.append(f"{_as_operand(latex_to_plain(num))}/{_as_operand(latex_to_plain(den))}")
            elif name == "sqrt":
                index = None
                if i < len(expr) and expr[i] == "[":
                    close = expr.find("]", i)
                    if close < 0:
                        raise ValueError("unclosed \\sqrt[")
                    index, i = expr[i + 1 : close], close + 1
                radicand, i = _read_argument(expr, i)
                radicand = latex_to_plain(radicand)
                out.append(f"sqrt({radicand})" if index is None else f"root({radicand},{latex_to_plain(index)})")
            elif name in _TEXT_COMMANDS:
                arg, i = _read_argument(expr, i)
                out.append(latex_to_plain(arg))
            elif name in _SYMBOLS:
                out.append(_SYMBOLS[name])
            elif name not in _DROPPED:
                out.append(name)  # unknown command (e.g. \alpha): keep its name
        elif ch == "{":
            braced = read_braced(expr, i)
            if braced is None:
                raise ValueError("unbalanced braces")
            out.append(f"({latex_to_plain(braced[0])})")
            i = braced[1]
        else:
            out.append(ch)
            i += 1
    return "".join(out)
