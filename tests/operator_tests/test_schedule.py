from datetime import datetime, timedelta, timezone

import pytest

from slotune.operator import schedule

T = datetime(2026, 11, 22, 13, 7, 30, tzinfo=timezone.utc)  # a Sunday


@pytest.mark.parametrize(
    "expr,expected",
    [
        ("* * * * *", datetime(2026, 11, 22, 13, 8, tzinfo=timezone.utc)),
        ("*/15 * * * *", datetime(2026, 11, 22, 13, 15, tzinfo=timezone.utc)),
        ("0 3 * * 1", datetime(2026, 11, 23, 3, 0, tzinfo=timezone.utc)),
        ("30 4 1,15 * 5", datetime(2026, 11, 27, 4, 30, tzinfo=timezone.utc)),  # either day field matches
        ("0 0 29 2 *", datetime(2028, 2, 29, tzinfo=timezone.utc)),
        ("@daily", datetime(2026, 11, 23, tzinfo=timezone.utc)),
        ("@every 90s", T + timedelta(seconds=90)),
        ("@every 6h", T + timedelta(hours=6)),
    ],
)
def test_next_after(expr, expected):
    assert schedule.next_after(expr, T) == expected


@pytest.mark.parametrize("expr", ["0 3 * *", "61 * * * *", "* * 0 * *", "@every 0s", "@every 5x", "every tuesday"])
def test_bad_expressions_name_themselves(expr):
    with pytest.raises(ValueError, match="schedule"):
        schedule.next_after(expr, T)


@pytest.mark.parametrize("expr", ["0 0 30 2 *", "0 0 31 2,4,6,9,11 *", "0 0 30,31 2 *"])
def test_a_schedule_that_never_fires_is_refused(expr):
    with pytest.raises(schedule.ScheduleError, match="never fires"):
        schedule.parse(expr)
    with pytest.raises(schedule.ScheduleError, match="never fires"):
        schedule.next_after(expr, T)


def test_leap_day_is_found_across_a_skipped_century_leap_year():
    # 2100 is not a leap year: from 2096-03-01 the next Feb 29 is in 2104 (8 years)
    assert schedule.next_after("0 0 29 2 *", datetime(2096, 3, 1, tzinfo=timezone.utc)) == datetime(
        2104, 2, 29, tzinfo=timezone.utc
    )
