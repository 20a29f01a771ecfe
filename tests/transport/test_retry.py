"""The one retry helper: retryable codes, exponential backoff with jitter, a deadline over the loop."""

import grpc
import pytest

from elasticdl_strategy.transport.retry import Deadline, backoff, retryable


class Clock:
    def __init__(self):
        self.now = 100.0
        self.slept = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


class Failed(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


@pytest.mark.parametrize(
    "code, again",
    [
        (grpc.StatusCode.UNAVAILABLE, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, True),
        (grpc.StatusCode.UNAUTHENTICATED, False),
        (grpc.StatusCode.INVALID_ARGUMENT, False),
        (grpc.StatusCode.FAILED_PRECONDITION, False),
    ],
)
def test_only_calls_that_reached_no_answer_are_retried(code, again):
    assert retryable(Failed(code)) is again


def test_pauses_double_up_to_the_cap_and_jitter_stays_within_its_band():
    assert [next(p) for p in [backoff(first_s=0.1, max_s=0.3, jitter=0)] for _ in range(4)] == [0.1, 0.2, 0.3, 0.3]
    low = backoff(first_s=1.0, jitter=0.2, rng=lambda: 0.0)
    high = backoff(first_s=1.0, jitter=0.2, rng=lambda: 1.0)
    assert next(low) == pytest.approx(0.8) and next(high) == pytest.approx(1.2)


def test_a_deadline_sleeps_only_pauses_that_end_before_it():
    clock = Clock()
    deadline = Deadline(1.0, clock=clock, sleep=clock.sleep)
    pauses = backoff(first_s=0.3, jitter=0)
    attempts = 1
    while deadline.pause(next(pauses)):
        attempts += 1
    assert clock.slept == [0.3, 0.6] and attempts == 3  # the next pause (1.0) would end after the deadline
    assert not deadline.expired() and deadline.remaining() == pytest.approx(0.1)
    clock.now = deadline.at
    assert deadline.expired() and deadline.remaining() == 0.0
