"""Sequence bookkeeping of one (edge, stream): pure, no store."""

from fedge.edge_manager.ingest.gaps import Observation, SeqState, observe


def _feed(seqs: list[int], state: SeqState | None = None) -> SeqState:
    state = state or SeqState(-1)
    for seq in seqs:
        state = observe(state, seq).state
    return state


def test_in_order_batches_open_no_gap() -> None:
    state = SeqState(-1)
    for seq in range(5):
        observation = observe(state, seq)
        assert observation == Observation(SeqState(seq), None, None)
        state = observation.state
    assert state == SeqState(4, ())


def test_first_batch_after_a_loss_at_the_start_opens_a_gap() -> None:
    observation = observe(SeqState(-1), 3)
    assert observation == Observation(SeqState(3, ((0, 2),)), (0, 2), None)


def test_jump_ahead_opens_a_gap_between_max_and_seq() -> None:
    observation = observe(SeqState(2), 6)
    assert observation.opened == (3, 5)
    assert observation.filled is None
    assert observation.state == SeqState(6, ((3, 5),))


def test_jump_of_one_opens_a_single_number_gap() -> None:
    assert observe(SeqState(2), 4).state == SeqState(4, ((3, 3),))


def test_several_gaps_stay_sorted() -> None:
    assert _feed([0, 3, 7]) == SeqState(7, ((1, 2), (4, 6)))


def test_filling_the_middle_splits_the_gap() -> None:
    state = SeqState(10, ((3, 7),))
    observation = observe(state, 5)
    assert observation.opened is None
    assert observation.filled == (3, 7)
    assert observation.state == SeqState(10, ((3, 4), (6, 7)))


def test_filling_the_low_edge_shrinks_the_gap() -> None:
    observation = observe(SeqState(10, ((3, 7),)), 3)
    assert observation.state == SeqState(10, ((4, 7),))
    assert observation.filled == (3, 7)


def test_filling_the_high_edge_shrinks_the_gap() -> None:
    observation = observe(SeqState(10, ((3, 7),)), 7)
    assert observation.state == SeqState(10, ((3, 6),))
    assert observation.filled == (3, 7)


def test_filling_a_single_number_gap_removes_it() -> None:
    observation = observe(SeqState(10, ((1, 1), (4, 4))), 4)
    assert observation.state == SeqState(10, ((1, 1),))
    assert observation.filled == (4, 4)


def test_filling_one_gap_leaves_the_others_in_order() -> None:
    state = SeqState(20, ((1, 2), (5, 9), (12, 15)))
    assert observe(state, 7).state == SeqState(20, ((1, 2), (5, 6), (8, 9), (12, 15)))


def test_late_batches_in_any_order_close_every_gap() -> None:
    state = _feed([0, 9, 4, 1, 8, 2, 3, 7, 5, 6])
    assert state == SeqState(9, ())


def test_a_number_below_max_outside_any_gap_changes_nothing() -> None:
    """Only reachable if the caller's dedupe missed a duplicate."""
    state = SeqState(10, ((3, 4),))
    assert observe(state, 8) == Observation(state, None, None)
