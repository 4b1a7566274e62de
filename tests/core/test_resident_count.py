from swapopt_core._planning.resident import resident_count


def test_prefix_within_fraction() -> None:
    assert resident_count([4, 4, 4, 4], 0.5) == 2
    assert resident_count([4, 4, 4, 4], 0.49) == 1
    assert resident_count([4, 4, 4, 4], 0.0) == 0
    assert resident_count([4, 4, 4, 4], 1.0) == 4


def test_zero_cost_units_follow_their_prefix() -> None:
    assert resident_count([0, 0, 8], 0.0) == 2
    assert resident_count([], 0.7) == 0
