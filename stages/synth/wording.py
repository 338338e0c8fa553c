"""The oracle's reasoning text: short sentences drawn from pools of wordings, so no sentence is learnt by rote.

Every turn is assembled from slots (what the last observation showed, what to do next, where), each filled
from a pool by the trajectory's own random stream. Sentences marked optional are dropped first when a turn
would not fit the student's token budget. Areas are named from a box's position ("upper left", "centre").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

Box = tuple[float, float, float, float]

SUBJECTS = (
    "the target",
    "the object in question",
    "what the question asks about",
    "the thing I am looking for",
    "the item the question describes",
)

OPENERS = (
    "The image is large and the detail is small, so I need a closer look.",
    "At this resolution I cannot make out the details.",
    "The downscaled view is too coarse to answer from.",
    "I need to find {subject} first.",
    "Small details are unreadable in this view.",
    "I should search the image before answering.",
)

FIRST_WIDE = (
    "I'll start with the {area}.",
    "Let me look at the {area} first.",
    "The {area} seems a good place to start.",
    "Zooming into the {area}.",
    "I'll check the {area}.",
    "Checking the {area}.",
)

FIRST_UNNAMED = (
    "Checking the frame.",
    "Let me zoom in where the question points.",
    "I'll zoom into the place the question names.",
)
"""First turns that do not say where the zoom goes (`OracleParams.name_first_look: false`): the box alone
carries the place, so the side word is one the model reads in the question and never writes."""

FIRST_CLOSE = (
    "Something small in the {area} could be {subject}; zooming in on it.",
    "There is a likely candidate in the {area}. Let me zoom in.",
    "{subject_cap} appears to be in the {area}; I'll zoom in there.",
    "I'll zoom straight into the {area}, where it seems to be.",
    "It should be in the {area}.",
)

MISSED = (
    "Observation {n} shows the {area}, but {subject} is not there.",
    "No sign of {subject} in Observation {n}.",
    "Observation {n} holds other objects, not {subject}.",
    "{subject_cap} is not in Observation {n}.",
    "Nothing in Observation {n} matches the question.",
    "Not in Observation {n}.",
)

RETRY = (
    "Let me try the {area} instead.",
    "I'll look elsewhere: the {area}.",
    "Maybe it is in the {area}.",
    "Next I'll check the {area}.",
    "Moving on to the {area}.",
    "Trying the {area}.",
)

SPOTTED = (
    "Observation {n} narrows it down: a candidate sits near the {area} of this view, still too small to read.",
    "In Observation {n} I can spot a candidate near the {area}, but the details are blurry.",
    "Observation {n} shows {subject} near its {area}, though not clearly.",
    "{subject_cap} seems to be in the {area} of Observation {n}; I need more detail.",
    "It is near the {area} of Observation {n}.",
)

CLOSER_ON_ORIGINAL = (
    "I'll zoom in closer on the original image.",
    "A tighter crop of the original should settle it.",
    "Zooming in closer on the original.",
    "Let me take a closer look on the full image.",
)

CLOSER_ON_OBSERVATION = (
    "Zooming further into Observation {n}.",
    "I'll zoom into Observation {n} itself.",
    "A tighter crop of Observation {n} should settle it.",
    "Let me zoom in on that part of Observation {n}.",
    "Zooming into Observation {n}.",
)

SEEN_CHOICE = (
    "Observation {n} shows it clearly: the answer is {text}, option ({letter}).",
    "Now it is clear in Observation {n}: {text}. That is option {letter}.",
    "Clearly visible now: {text}, so the answer is ({letter}).",
    "In Observation {n} I can see it is {text}, which matches option {letter}.",
    "It is {text}: option {letter}.",
)

SEEN_FREE = (
    "Observation {n} shows it clearly: the answer is {text}.",
    "Now I can see it: {text}.",
    "The zoomed view answers the question: {text}.",
    "In Observation {n} it is clear: {text}.",
    "It is {text}.",
)

GLANCE = (
    "The overview should be enough.",
    "I can answer from this view.",
    "No need to zoom for this.",
    "This view shows enough.",
)

GUESS_FREE = (
    "It looks like {text}.",
    "I think it is {text}.",
    "It seems to be {text}.",
)

GUESS_CHOICE = (
    "It looks like {text}: option ({letter}).",
    "I think it is {text}, so ({letter}).",
    "It seems to be {text}, option {letter}.",
)

CONFIRM = (
    "I am confident.",
    "That settles it.",
    "No need to look further.",
    "",
)


FOLLOW = (
    "Zooming into the {area}.",
    "I'll look at the {area} next.",
    "Let me zoom into the {area} there.",
)
"""What the oracle says before its look at the place a waypoint pointed to."""

OPERATE = {
    "read_text": (
        "The letters on the sign in the {area} are too small to read here; I'll read its text.",
        "I'll read the text of the sign in the {area}.",
        "Reading the sign in the {area}.",
    ),
    "segment_at": (
        "The object in the {area} is too small to make out its shape; I'll segment it.",
        "I'll segment the object in the {area} to measure it.",
        "Segmenting the object in the {area}.",
    ),
    "get_properties": (
        "{mask} is the object; its properties will name its shape.",
        "I'll ask for the properties of {mask}.",
        "Reading the properties of {mask}.",
    ),
    "track_object": (
        "I'll follow the square in the {area} through the frames.",
        "Its movement is hard to see frame by frame; I'll track the square in the {area}.",
        "Tracking the square in the {area}.",
    ),
}
"""What the oracle says before each visual operation (loupe.visual_ops), by operation."""

OPERATED = {
    "read_text": ("The sign reads {text}.", "The text found is {text}, so that is the word.", "It says {text}."),
    "get_properties": ("Its shape is {text}.", "The properties name its shape: {text}.", "It is a {text}."),
    "track_object": ("The track shows it moved {text}.", "It moved {text}.", "Over the frames it goes {text}."),
}
"""What the oracle says of an operation's result before it answers, by the operation that gave the answer."""


def area_name(box: Box) -> str:
    """Where a box's centre lies on its image, in words ("upper left", "centre", "right side")."""
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    column = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else ""
    row = "upper" if cy < 1 / 3 else "lower" if cy > 2 / 3 else ""
    if row and column:
        return f"{row} {column} part"
    if row:
        return f"{row} middle part"
    if column:
        return f"{column} side"
    return "centre"


@dataclass(frozen=True)
class Sentence:
    """One sentence of a turn, with the shortest wording of its slot as a fallback for tight budgets."""

    text: str
    shortest: str
    optional: bool = False


class Wording:
    """One trajectory's phrasing: a random stream plus the subject phrase it sticks to."""

    def __init__(self, rng: random.Random, plain: bool = False):
        self.rng = rng
        self.subject = rng.choice(SUBJECTS)
        self.plain = plain
        """Each slot's shortest wording and no optional sentence: a small model learns the words that carry
        the decision (where, what colour) sooner when nothing else varies."""

    def _fill(self, pool: tuple[str, ...], optional: bool = False, **slots: object) -> Sentence:
        subject_cap = self.subject[0].upper() + self.subject[1:]
        filled = [t.format(subject=self.subject, subject_cap=subject_cap, **slots) for t in pool]
        shortest = min(filled, key=len)
        if self.plain:
            return Sentence("" if optional else shortest, shortest, optional)
        return Sentence(self.rng.choice(filled), shortest, optional)

    def first_turn(self, area: str | None, close: bool) -> list[Sentence]:
        """The opening turn's words; `area` None: a first sentence that names no place (FIRST_UNNAMED)."""
        pool = FIRST_UNNAMED if area is None else FIRST_CLOSE if close else FIRST_WIDE
        return self._kept([self._fill(OPENERS, optional=True), self._fill(pool, area=area)])

    def after_miss(self, n: int, seen_area: str, next_area: str) -> list[Sentence]:
        return [self._fill(MISSED, n=n, area=seen_area), self._fill(RETRY, area=next_area)]

    def after_spot(self, n: int, area_in_view: str, next_source_obs: int | None) -> list[Sentence]:
        spotted = self._fill(SPOTTED, n=n, area=area_in_view)
        if next_source_obs is None:
            return self._kept([spotted, self._fill(CLOSER_ON_ORIGINAL, optional=True)])
        return [spotted, self._fill(CLOSER_ON_OBSERVATION, n=next_source_obs)]

    def answer(self, n: int, text: str, letter: str | None) -> list[Sentence]:
        if letter is not None:
            seen = self._fill(SEEN_CHOICE, n=n, text=text, letter=letter)
        else:
            seen = self._fill(SEEN_FREE, n=n, text=text)
        return self._kept([seen, self._fill(CONFIRM, optional=True)])

    def after_waypoint(self, n: int, seen: str, next_area: str) -> list[Sentence]:
        return [Sentence(f"Observation {n} shows {seen}.", f"Observation {n} shows {seen}."),
                self._fill(FOLLOW, area=next_area)]

    def operate(self, operation: str, area: str, mask: str = "") -> list[Sentence]:
        return [self._fill(OPERATE[operation], area=area, mask=mask)]

    def operated(self, operation: str, text: str) -> list[Sentence]:
        return self._kept([self._fill(OPERATED[operation], text=text), self._fill(CONFIRM, optional=True)])

    def glance(self, text: str, letter: str | None) -> list[Sentence]:
        guess = self._fill(GUESS_CHOICE, text=text, letter=letter) if letter else self._fill(GUESS_FREE, text=text)
        return self._kept([self._fill(GLANCE, optional=True), guess])

    @staticmethod
    def _kept(sentences: list[Sentence]) -> list[Sentence]:
        return [s for s in sentences if s.text]


def fit_sentences(sentences: list[Sentence], max_chars: int) -> str:
    """Join the sentences within `max_chars` if it can be done: drop optional ones (earliest first), then fall
    back to each slot's shortest wording. Returns the shortest joint text when nothing fits."""
    kept = list(sentences)

    def joined() -> str:
        return " ".join(s.text for s in kept)

    while len(joined()) > max_chars and any(s.optional for s in kept):
        kept.pop(next(i for i, s in enumerate(kept) if s.optional))
    for i, sentence in enumerate(kept):
        if len(joined()) <= max_chars:
            break
        kept[i] = Sentence(sentence.shortest, sentence.shortest)
    return joined()
