import pytest

from swarm.sharding.errors import UserError
from swarm.sharding.ranges import format_ranges, parse_ranges


def test_parse_and_format_round_trip():
    ids = parse_ranges("0-3, 8,10-11,3")
    assert ids == [0, 1, 2, 3, 8, 10, 11]
    assert format_ranges(ids) == "0-3,8,10-11"


@pytest.mark.parametrize("bad", ["", "a-b", "5-2", "-1", "1-"])
def test_bad_ranges_are_user_errors(bad):
    with pytest.raises(UserError):
        parse_ranges(bad, "expert")
