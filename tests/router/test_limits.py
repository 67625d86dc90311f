"""Per-client limits as logic: a token bucket with a burst, a cap on requests under way, clients
apart from each other, and a bounded memory of clients (router/limits.py)."""

from __future__ import annotations

import pytest

from router.access import Access, ApiKeys
from router.limits import ClientLimiter, Limited, Limits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_with_the_wait_said() -> None:
    clock = Clock()
    limiter = ClientLimiter(Limits(rate=2.0, burst=3), clock)
    for _ in range(3):
        limiter.admit("a")()
    with pytest.raises(Limited) as over:
        limiter.admit("a")
    assert over.value.reason == "rate" and over.value.retry_after_s == pytest.approx(0.5)
    assert over.value.retry_after == "1"  # whole seconds, at least 1
    assert "2 requests/s" in over.value.message and "--rate-limit" in over.value.message
    clock.now += 0.5  # one request's worth of tokens back
    limiter.admit("a")()
    with pytest.raises(Limited):
        limiter.admit("a")
    clock.now += 60  # a long idle time refills up to the burst, no further
    for _ in range(3):
        limiter.admit("a")()
    with pytest.raises(Limited):
        limiter.admit("a")


def test_a_refused_request_costs_no_token() -> None:
    clock = Clock()
    limiter = ClientLimiter(Limits(rate=1.0, burst=1), clock)
    limiter.admit("a")
    for _ in range(5):
        with pytest.raises(Limited):
            limiter.admit("a")
    clock.now += 1.0
    limiter.admit("a")


def test_requests_under_way_are_capped_until_one_ends() -> None:
    limiter = ClientLimiter(Limits(concurrency=2), Clock())
    first, second = limiter.admit("a"), limiter.admit("a")
    with pytest.raises(Limited) as over:
        limiter.admit("a")
    assert over.value.reason == "concurrency" and "at most 2" in over.value.message
    limiter.admit("b")  # another client is not held back
    first()
    first()  # releasing twice gives back one slot only
    third = limiter.admit("a")
    with pytest.raises(Limited):
        limiter.admit("a")
    second(), third()


def test_no_limits_admit_everything_and_remember_no_one() -> None:
    limiter = ClientLimiter(Limits())
    for i in range(1000):
        limiter.admit(f"client {i}")()
    assert len(limiter) == 0


def test_many_clients_are_forgotten_once_idle() -> None:
    clock = Clock()
    limiter = ClientLimiter(Limits(rate=10.0, concurrency=4), clock)
    limiter.MAX_IDLE_CLIENTS = 100
    held = limiter.admit("busy")
    for i in range(100):
        limiter.admit(f"c{i}")()
    clock.now += 1.0  # every bucket refilled: those clients are like new ones
    limiter.admit("newcomer")
    assert len(limiter) == 2  # the busy one (a request under way) and the newcomer
    with pytest.raises(Limited):  # the busy client's state was kept: it still counts
        for _ in range(4):
            limiter.admit("busy")
    held()


@pytest.mark.parametrize("limits", [dict(rate=0), dict(rate=-1.0), dict(concurrency=0), dict(burst=2)])
def test_limits_that_make_no_sense_are_refused(limits) -> None:
    with pytest.raises(ValueError):
        Limits(**limits)


def test_a_client_is_its_key_never_the_key_itself() -> None:
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.match("sk-two") == 1 and keys.match("sk-three") is None and keys.match(None) is None
    assert keys.client("sk-two", "10.0.0.1") == "key#1"
    assert keys.client("sk-nope", "10.0.0.1") == "address 10.0.0.1"  # an invalid key counts as its address
    assert ApiKeys().client("sk-one", "10.0.0.2") == "address 10.0.0.2"
    assert not ApiKeys([""])
    assert "sk-one" not in repr(Access(api_keys=("sk-one",)))  # options may be logged; keys never are
