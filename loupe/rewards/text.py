"""Free-form answers compared as text: `normalize_answer` and `exact_match`."""

from __future__ import annotations

import re
import unicodedata
from decimal import Decimal, InvalidOperation

_NUMBER_WORDS = {
    word: str(value)
    for value, word in enumerate(
        [
            "zero",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "eleven",
            "twelve",
            "thirteen",
            "fourteen",
            "fifteen",
            "sixteen",
            "seventeen",
            "eighteen",
            "nineteen",
            "twenty",
        ]
    )
}
_ARTICLES = {"a", "an", "the"}
_THOUSANDS_SEPARATOR = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DOT_NOT_DECIMAL = re.compile(r"(?<!\d)\.|\.(?!\d)")
_DECIMAL = re.compile(r"\d+(?:\.\d+)?")


def _canonical_token(token: str) -> str:
    token = _NUMBER_WORDS.get(token, token)
    if _DECIMAL.fullmatch(token):
        try:
            # "3.50" -> "3.5", "007" -> "7", "2.0" -> "2": the same number written differently.
            return format(Decimal(token).normalize(), "f")
        except InvalidOperation:
            return token
    return token


def normalize_answer(text: str | None) -> str:
    """Lowercase, drop punctuation, symbols and articles, collapse spaces, write numbers 0-20 and decimals one way.

    "The Red Car!" -> "red car"; "Twelve" -> "12"; "1,000" -> "1000"; "3.50" -> "3.5"; "don't" -> "dont".
    A dot between digits is a decimal point and stays. Never erases a whole answer: an answer made only of
    articles keeps its last word ("A" -> "a", "the A" -> "a"), and one made only of punctuation and symbols is
    kept as written, lowercased with spaces collapsed ("?!" -> "?!").
    """
    if not isinstance(text, str):
        return ""
    folded = unicodedata.normalize("NFKC", text).lower()
    text = folded.replace("'", "").replace("\u2019", "")
    text = _THOUSANDS_SEPARATOR.sub("", text)
    text = _DOT_NOT_DECIMAL.sub(" ", text)
    text = "".join(" " if ch != "." and unicodedata.category(ch)[0] in "PS" else ch for ch in text)
    tokens = text.split()
    words = [t for t in tokens if t not in _ARTICLES] or tokens[-1:]
    if not words:
        return " ".join(folded.split())
    return " ".join(_canonical_token(t) for t in words)


def exact_match(prediction: str | None, solution: str) -> bool:
    """Whether the two answers are equal after `normalize_answer` (an empty prediction never matches)."""
    normalised = normalize_answer(prediction)
    return bool(normalised) and normalised == normalize_answer(solution)
