"""The read-write lock: readers together, a writer alone, and a waiting writer before later readers."""
import threading

from lightning_persia.read_write_lock import ReadWriteLock


def test_a_writer_waits_for_the_readers_and_later_readers_wait_for_it():
    lock = ReadWriteLock()
    events: list[str] = []
    first_in, release_first, writer_waiting = threading.Event(), threading.Event(), threading.Event()

    def reader(name: str, hold: threading.Event | None = None) -> None:
        with lock.reading():
            events.append(f"{name} in")
            if hold is not None:
                first_in.set()
                hold.wait(10)
        events.append(f"{name} out")

    def writer() -> None:
        writer_waiting.set()
        with lock.writing():
            events.append("writer in")
        events.append("writer out")

    first = threading.Thread(target=reader, args=("first", release_first))
    first.start()
    first_in.wait(10)
    second = threading.Thread(target=reader, args=("second",))
    second.start()
    second.join(10)  # readers share the lock
    write = threading.Thread(target=writer)
    write.start()
    writer_waiting.wait(10)
    while lock._writers_waiting == 0:  # the writer is queued behind the first reader
        threading.Event().wait(0.001)
    late = threading.Thread(target=reader, args=("late",))
    late.start()
    threading.Event().wait(0.05)
    assert "writer in" not in events and "late in" not in events
    release_first.set()
    for thread in (first, write, late):
        thread.join(10)
    assert events.index("first out") < events.index("writer in") < events.index("writer out") < events.index("late in")
