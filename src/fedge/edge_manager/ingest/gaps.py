"""Sequence bookkeeping for one (edge, stream): new, duplicate, and the gaps in between.

Pure: the ingest adapter loads the state, calls :func:`observe`, and writes the result.
A gap is a closed range of sequence numbers not yet received; it opens when a batch
arrives ahead of ``max_seq + 1`` and shrinks as late batches (QoS 1 retries, an outbox
drained after a restart) fill it.
"""

from dataclasses import dataclass

Gap = tuple[int, int]  # inclusive range


@dataclass(frozen=True)
class SeqState:
    max_seq: int  # -1 before the first batch
    gaps: tuple[Gap, ...] = ()


@dataclass(frozen=True)
class Observation:
    state: SeqState
    opened: Gap | None
    filled: Gap | None  # the gap that contained the seq (before it was split)


def observe(state: SeqState, seq: int) -> Observation:
    """Account for a batch that was NOT a duplicate (the caller checked its key)."""
    if seq > state.max_seq:
        opened = (state.max_seq + 1, seq - 1) if seq > state.max_seq + 1 else None
        gaps = state.gaps + ((opened,) if opened else ())
        return Observation(SeqState(seq, gaps), opened, None)
    for gap in state.gaps:
        low, high = gap
        if low <= seq <= high:
            rest = tuple(g for g in state.gaps if g != gap)
            pieces = tuple(p for p in ((low, seq - 1), (seq + 1, high)) if p[0] <= p[1])
            return Observation(SeqState(state.max_seq, tuple(sorted(rest + pieces))), None, gap)
    # Below max and in no gap: only possible if the caller's dedupe missed it.
    return Observation(state, None, None)


def received(state: SeqState, seq: int) -> bool:
    """Whether ``seq`` already arrived: at or below ``max_seq`` and in no open gap.

    True whether or not its batch key is still stored, which is what lets retention prune
    keys without letting a redelivered batch in again (retention.py).
    """
    return seq <= state.max_seq and not any(low <= seq <= high for low, high in state.gaps)
