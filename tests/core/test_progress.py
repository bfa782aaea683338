"""Signs of life off a terminal: a running step prints where it stands at least every 30 s (done and total,
rate, ETA), from its advances or, where it does not advance, from a ticking thread."""

import io
import time

from compresskit.progress import HEARTBEAT_S, PlainProgress


def test_a_step_prints_done_rate_and_eta_every_interval_of_the_clock():
    now = [0.0]
    buf = io.StringIO()
    progress = PlainProgress(buf, clock=lambda: now[0], tick=False)
    with progress.task("training: router", total=600) as task:
        for step in range(600):
            now[0] += 0.2
            task.advance(1)
            if step == 0:
                task.update(loss=3.5)
    lines = buf.getvalue().splitlines()
    assert HEARTBEAT_S == 30.0
    assert lines[0] == "[compresskit] training: router ..."
    assert lines[1] == "[compresskit] training: router: 151/600 (25%), 5/s, ETA 1m30s, 0m30s so far loss=3.5"
    assert len(lines) == 1 + 3 + 1  # a line each 30 s of a 120 s step, then its end
    assert lines[-1] == "[compresskit] training: router: done in 120.0s loss=3.5"


def test_slow_steps_and_steps_without_a_total():
    now = [0.0]
    buf = io.StringIO()
    progress = PlainProgress(buf, clock=lambda: now[0], tick=False)
    with progress.task("evaluating") as task:
        now[0] = 45.0
        task.advance(3)
    with progress.task("scoring", total=10) as task:
        now[0] += 31.0
        task.advance(0.5)
    lines = buf.getvalue().splitlines()
    assert lines[1] == "[compresskit] evaluating: 3, 15 s each, 0m45s so far"
    assert lines[4] == "[compresskit] scoring: 0.5/10 (5%), 62 s each, ETA 9m49s, 0m31s so far"


def test_a_step_that_does_not_advance_still_ticks():
    buf = io.StringIO()
    with PlainProgress(buf, interval=0.05).task("computing the dense reference"):
        time.sleep(0.3)
    ticks = [line for line in buf.getvalue().splitlines() if "still running" in line]
    assert ticks and ticks[0].startswith("[compresskit] computing the dense reference: still running, 0m00s so far")
