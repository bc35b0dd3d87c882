"""Class names checked where they enter (issue 15: accepted but wrong).

Pure functions. A model published with more or fewer class names than it has outputs
was caught only by the edge's smoke test; a threshold or label for a misspelled class
(``scrach``, ``Scratch``) was stored and silently matched nothing. Names are compared
exactly (case-sensitive: the edge does too), with a "did you mean" for near misses.
"""

import difflib
from collections.abc import Collection, Sequence

from fedge.protocols.manifest import TensorSpec


def output_classes(outputs: Sequence[TensorSpec]) -> int | None:
    """How many classes the model scores: the last axis of its first output, if fixed."""
    if not outputs or not outputs[0].shape:
        return None
    last = outputs[0].shape[-1]
    return last if isinstance(last, int) and last > 0 else None


def class_count_problem(outputs: Sequence[TensorSpec], classes: Sequence[str]) -> str | None:
    """Why ``classes`` cannot name the model's outputs (None: they can)."""
    if len(set(classes)) != len(classes):
        twice = sorted({c for c in classes if classes.count(c) > 1})
        return f"class names must differ; {', '.join(twice)} given twice"
    scored = output_classes(outputs)
    if scored is None or scored == len(classes):
        return None
    return (
        f"the model scores {scored} classes (output {outputs[0].name!r} has shape "
        f"{list(outputs[0].shape)}) but {len(classes)} names were given "
        f"({', '.join(classes)}); give exactly {scored}"
    )


def suggestion(name: str, known: Collection[str]) -> str:
    """`` (did you mean 'scratch'?)`` for a near miss, else ''."""
    exact_but_case = [k for k in known if k.lower() == name.lower()]
    close = exact_but_case or difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_class(name: str, known: Collection[str], where: str) -> str | None:
    """The refusal for ``name`` if it is not one of ``known`` (None: it is)."""
    if name in known:
        return None
    names = ", ".join(sorted(known)) or "none, publish a model first"
    return f"{name!r} is not {where}{suggestion(name, known)}; known classes: {names}"
