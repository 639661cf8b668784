import pytest

from vmm.scheduler import Scheduler, SchedulerError
from vmm.trace import Trace


def test_events_run_in_time_then_sequence_order():
    s = Scheduler()
    seen = []
    s.schedule(10, lambda: seen.append("b"), "b")
    s.schedule(5, lambda: seen.append("a"), "a")
    s.schedule(10, lambda: seen.append("c"), "c")
    while s.run_next():
        pass
    assert seen == ["a", "b", "c"]
    assert s.now_ns() == 10


def test_cancelled_event_does_not_run_and_next_event_skips_it():
    s = Scheduler()
    seen = []
    t = s.schedule(5, lambda: seen.append("x"), "x")
    s.schedule(7, lambda: seen.append("y"), "y")
    t.cancel()
    assert s.next_event_ns() == 7
    s.run_until_time(100)
    assert seen == ["y"] and s.now_ns() == 100


def test_past_and_negative_schedules_are_refused():
    s = Scheduler()
    s.run_until_time(50)
    with pytest.raises(SchedulerError, match="negative delay"):
        s.schedule(-1, lambda: None, "neg")
    with pytest.raises(SchedulerError, match="in the past"):
        s.schedule_at(10, lambda: None, "past")


def test_advance_to_refuses_to_skip_an_event():
    s = Scheduler()
    s.schedule(5, lambda: None, "e")
    with pytest.raises(SchedulerError, match="event is due at 5"):
        s.advance_to(10)


def test_trace_digest_depends_on_content_time_and_order():
    def digest(events, times):
        now = [0]
        tr = Trace(lambda: now[0])
        for (kind, fields), t in zip(events, times):
            now[0] = t
            tr.emit("src", kind, fields)
        return tr.digest()

    base = digest([("a", {"x": 1}), ("b", {"y": 2})], [0, 5])
    assert base == digest([("a", {"x": 1}), ("b", {"y": 2})], [0, 5])
    assert base != digest([("b", {"y": 2}), ("a", {"x": 1})], [0, 5])
    assert base != digest([("a", {"x": 1}), ("b", {"y": 2})], [0, 6])
    assert base != digest([("a", {"x": 1}), ("b", {"y": 3})], [0, 5])


def test_trace_refuses_nondeterministic_fields():
    tr = Trace(lambda: 0)
    with pytest.raises(TypeError, match="not deterministic"):
        tr.emit("src", "bad", {"obj": object()})


def test_trace_counts_keeps_and_watches_across_batches():
    """count spans hashed batches; keep switched on later keeps from then on; a
    watcher added later sees every event from then on; neither changes the digest."""
    def run(keep_at, watch_at):
        tr = Trace(lambda: 3)
        seen = []
        src = tr.tracer("s")
        for i in range(5000):
            if i == keep_at:
                tr.keep = True
            if i == watch_at:
                tr.watch(seen.append)
            src.emit("e", i=i)
            tr.emit("m", "f", {"i": i})
        return tr, seen

    plain, _ = run(-1, -1)
    tr, seen = run(4990, 4000)
    assert plain.count == tr.count == 10000
    assert plain.digest() == tr.digest()
    assert [e.get("i") for e in tr.events] == [i for i in range(4990, 5000) for _ in "ab"]
    assert len(seen) == 2000 and seen[0].source == "s" and seen[1].kind == "f"
    tr.keep = False
    tr.emit("m", "g", {})
    assert len(tr.events) == 20 and len(seen) == 2001 and tr.count == 10001
