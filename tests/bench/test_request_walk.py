"""bench/request_walk.py's count of a request's walk: a return is coming back to a room
(an object's class or a module) already left."""

from __future__ import annotations

from tests.bench.scripts import load_script

walk = load_script("request_walk.py")


def test_a_return_is_a_room_entered_again_after_leaving_it():
    path = ["dp", "pool", "dp", "metrics", "pool", "link", "ledger"]
    back = walk.returns(path)
    assert back == {"dp": 1, "pool": 1}
    assert sum(walk.returns(path, 3).values()) == 1  # from the 4th stop on: pool's
    assert not walk.returns(["a", "b", "c"])
