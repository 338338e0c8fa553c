"""Choice questions: the letter cascade that reads which option an answer names (`extract_choice`)."""

from __future__ import annotations

import re

from loupe.data.tasks import OPTION_LETTERS
from loupe.protocol import extract_answer
from loupe.rewards.text import normalize_answer

# Each pattern below sees either a short string or a window of a few dozen characters after a fixed word, with
# whitespace collapsed: model output can hold thousands of spaces, and adjacent `\s*` over such a run
# backtracks for minutes.
_LONE_LETTER = re.compile(r"[(\[{]? ?([A-Za-z]) ?[)\]}]? ?[.:,;!]?")
_ANSWER_CUE = re.compile(r"(?i:\b(?:answer|option|choice)\b)|\\boxed\{")
# The letter after a cue may be lowercase ("option b"); "e.g."/"i.e." are abbreviations, not letters.
_AFTER_ANSWER = re.compile(
    r" ?(?:(?i:is)\b|[:=])? ?:? ?(?:(?i:(?:the )?(?:option|choice))\b ?)?:? ?([(\[]?)([A-Za-z])([)\]]?)"
    r"(?![A-Za-z0-9]|\.[A-Za-z])"
)
_AFTER_BOXED = re.compile(r" ?(\(?)([A-Za-z])(\)?) ?\}")
# Another letter joined on by a list word ("A, B, C or D", "A/B", "(A) or (B)"), ending where a list item ends.
_LIST_CONTINUATION = re.compile(
    r" ?(?:[,/&;]|(?i:or|and)\b) ?[(\[]?([A-Za-z])[)\]]?(?= ?(?:$|[,.;:!?/&]|(?i:or|and)\b))"
)
_LETTER_IS_CORRECT = re.compile(
    r"(?<![A-Za-z0-9'])[(\[]?([A-Za-z])[)\]]? (?:is|seems|looks) (?:to be )?(?:the )?(?:correct|right)\b"
)
# "(B)" anywhere; a lowercase "(b)" only as a word of its own, so "car(s)" is not option S.
_PARENTHESISED = re.compile(r"\(([A-Z])\)|(?<!\S)\(([a-z])\)")
_LEADING_LETTER = re.compile(r"([A-Z]) ?[.):](?= |$)")
_ENUMERATOR = re.compile(r"(?<!\S)[(\[]?([A-Z])[.):\]](?= |$)")
_WORD = re.compile(r"[^\W_]+")
_WHITESPACE = re.compile(r"\s+")
# After "answer is A"/"Answer: I" a following lowercase word usually means the article or pronoun began a
# sentence ("Answer: A red car"); these words still read as the letter ("the answer is A because ...").
_LETTER_CONNECTIVES = {"because", "since", "as", "and", "so", "which", "is", "was", "seems", "looks", "here"}
_LIST_WORDS = {"or", "and", "either", "nor", "neither"}


def _window(text: str, start: int, size: int = 80) -> str:
    return _WHITESPACE.sub(" ", text[start : start + 4 * size])[:size]


def _lists_letters(after: str, letter: str, letters: str) -> bool:
    """Whether `after` (the text right after a letter) joins another option letter on, as in "A, B or C"."""
    more = _LIST_CONTINUATION.match(after)
    return bool(more) and more.group(1).upper() in letters and more.group(1).upper() != letter


def _answer_is_letter(text: str, letters: str) -> str | None:
    """Rule (b): the last "answer is X" / "answer: X" / "option X" / "\\boxed{X}" naming a valid letter.

    A lowercase letter counts here too ("option b"); "a" and "i" (either case, unbracketed) followed by a
    lowercase word are taken for the article or pronoun. A letter that starts a list of letters ("the answer is
    A, B or C") names no choice.
    """
    found = None
    for cue in _ANSWER_CUE.finditer(text):
        window = _window(text, cue.end())
        pattern = _AFTER_BOXED if cue.group().startswith("\\") else _AFTER_ANSWER
        m = pattern.match(window)
        if m is None or m.group(2).upper() not in letters:
            continue
        opened, letter, closed = m.group(1), m.group(2).upper(), m.group(3)
        if letter in "AI" and not (opened or closed):
            next_word = re.match(r" ([A-Za-z]+)", window[m.end() :])
            if next_word and next_word.group(1)[0].islower() and next_word.group(1) not in _LETTER_CONNECTIVES:
                continue
        if _lists_letters(window[m.end() :], letter, letters):
            continue
        found = letter
    return found


def _letter_is_correct(text: str, letters: str) -> str | None:
    """Rule (c): the last "X is correct" / "(X) is the right ..." naming a valid letter, unless it ends a list."""
    found = None
    collapsed = _WHITESPACE.sub(" ", text)
    for m in _LETTER_IS_CORRECT.finditer(collapsed):
        letter = m.group(1).upper()
        before = collapsed[max(0, m.start() - 12) : m.start()]
        if letter in letters and not re.search(r"(?:[,/&;]|\b(?i:or|and)) ?$", before):
            found = letter
    return found


def _only_lists_options(text: str, options: list[str], letters: str) -> bool:
    """Whether the prediction merely repeats the option list: two or more letters and nothing else.

    Nothing else means: once the option texts are taken out, every word left is an option letter or a list word
    ("or", "and"), as in "(A) red (B) green (C) blue" or "A, B, C or D". Such an answer picks no option.
    """
    rest = text.lower()
    for option in sorted({o.strip().lower() for o in options}, key=len, reverse=True):
        if option:
            rest = rest.replace(option, " ")
    words = _WORD.findall(rest)
    named = {w.upper() for w in words if len(w) == 1 and w.upper() in letters}
    return len(named) >= 2 and all(w in _LIST_WORDS or w.upper() in named for w in words)


def _option_text_match(text: str, options: list[str], letters: str) -> str | None:
    """Rule (f): the one option whose normalised text equals, else appears as whole words in, the prediction."""
    prediction = normalize_answer(text)
    if not prediction:
        return None
    normalised = [normalize_answer(o) for o in options]
    equal = [letters[i] for i, o in enumerate(normalised) if o and o == prediction]
    if equal:
        return equal[0] if len(equal) == 1 else None
    contained = [letters[i] for i, o in enumerate(normalised) if o and f" {o} " in f" {prediction} "]
    return contained[0] if len(contained) == 1 else None


def extract_choice(prediction: str, options: list[str]) -> str | None:
    """The option letter a prediction names, or None; never raises.

    Tried in order, the first rule that names a letter within the options wins:
    (a) the whole prediction is one letter, optionally bracketed or followed by punctuation ("B", "(b)", "b.");
    then, if the prediction merely repeats the option list ("(A) red (B) green", "A, B, C or D"), None;
    (b) "answer is X", "answer: X", "answer is option (X)", "option X", "option b", "\\boxed{X}" (the last such;
        one that starts a list of letters, "the answer is A, B or C", does not count);
    (c) "X is correct", "(b) is the right one" (the last such);
    (d) "(X)" anywhere (lowercase "(x)" as a word of its own), when exactly one distinct valid letter appears
        so ("(A) or (B)" is no answer);
    (e) "X." / "X)" / "X:" at the start ("B. the red car"), unless another letter is enumerated so later;
    (f) option text: the one option whose normalised text equals the prediction's, else the one that appears in
        it as whole words (two appearing is ambiguous: None).
    Letters outside the option range never count. Lowercase letters count in (a), right after a cue in (b),
    before "is correct" in (c) and bracketed in (d); "a" and "i" followed by a lowercase word are read as the
    article or pronoun, so "the answer is a red car" is not option A. An `<answer>…</answer>` wrapper, if
    present, is looked inside, and markdown asterisks are ignored.
    """
    if not isinstance(prediction, str) or not options:
        return None
    letters = OPTION_LETTERS[: len(options)]
    inner = extract_answer(prediction)
    text = (inner if inner is not None else prediction).replace("*", "")

    short = _WHITESPACE.sub(" ", text.strip()) if len(text.strip()) <= 12 else ""
    lone = _LONE_LETTER.fullmatch(short)
    if lone and lone.group(1).upper() in letters:
        return lone.group(1).upper()
    if _only_lists_options(text, options, letters):
        return None
    letter = _answer_is_letter(text, letters) or _letter_is_correct(text, letters)
    if letter:
        return letter
    in_parentheses = {(upper or lower).upper() for upper, lower in _PARENTHESISED.findall(text)} & set(letters)
    if len(in_parentheses) == 1:
        return in_parentheses.pop()
    leading = _LEADING_LETTER.match(_window(text, len(text) - len(text.lstrip()), size=4))
    if leading and leading.group(1) in letters:
        enumerated = {m for m in _ENUMERATOR.findall(_WHITESPACE.sub(" ", text)) if m in letters}
        if enumerated <= {leading.group(1)}:
            return leading.group(1)
    return _option_text_match(text, options, letters)
