"""The logging schedule: by steps, and by seconds since the last line."""

from __future__ import annotations

from trainkit.observe.schedule import LogSchedule


def test_logs_every_n_steps_and_when_the_seconds_passed_since_the_last_line() -> None:
    now = [0.0]
    schedule = LogSchedule(every_n_steps=10, every_n_seconds=5.0, clock=lambda: now[0])
    assert [s for s in range(1, 21) if schedule.should_log(s)] == [10, 20]
    now[0] = 5.0
    assert schedule.should_log(21)  # slow steps: five seconds without a line
    schedule.logged()
    now[0] = 9.9
    assert not schedule.should_log(22)
    now[0] = 10.0
    assert schedule.should_log(23)


def test_zero_seconds_logs_by_steps_only() -> None:
    now = [0.0]
    schedule = LogSchedule(every_n_steps=3, every_n_seconds=0, clock=lambda: now[0])
    now[0] = 1e9
    assert [s for s in range(1, 10) if schedule.should_log(s)] == [3, 6, 9]



def test_each_step_longer_than_the_period_logs_as_the_period_runs_from_the_decision() -> None:
    """Asked before each step (issue 48: one policy for the log and the host read), a step
    that logs starts the next period: slow steps still log every time, not every other."""
    now = [0.0]
    schedule = LogSchedule(every_n_steps=100, every_n_seconds=60.0, clock=lambda: now[0])
    decided = []
    for step in range(1, 6):
        decided.append(schedule.should_log(step))
        now[0] += 100.0  # the step runs
    assert decided == [False, True, True, True, True]
    now[0] = 440.0  # step 5 was decided at 400: the next line by time is due at 460
    assert not schedule.should_log(6)
    now[0] = 460.0
    assert schedule.should_log(7)
