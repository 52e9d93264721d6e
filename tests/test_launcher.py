"""The launcher's choices that need no server: which allocator tritonserver runs on, how its text work is
made nicer."""

import os
import subprocess
import sys
import time

import pytest

from tritone.launcher import MALLOC_LIBRARIES, find_malloc


def test_auto_finds_the_mimalloc_that_comes_with_tritone():
    assert "libmimalloc.so" in find_malloc("auto")
    assert find_malloc("mimalloc") == find_malloc("auto")


def test_system_preloads_nothing():
    assert find_malloc("system") is None


def test_a_library_by_path_is_taken_as_it_is(tmp_path):
    library = tmp_path / "libmymalloc.so"
    library.write_bytes(b"")
    assert find_malloc(str(library)) == str(library)


@pytest.mark.parametrize("choice", ["/no/such/libmalloc.so", "hoard"])
def test_an_unknown_choice_is_refused_naming_the_flag(choice):
    with pytest.raises(ValueError, match=r"--malloc .*no such file"):
        find_malloc(choice)


def test_a_named_allocator_that_is_missing_is_refused(monkeypatch):
    monkeypatch.setattr("tritone.launcher.install._malloc_library", lambda name: None)
    for name in MALLOC_LIBRARIES:
        with pytest.raises(ValueError, match=f"--malloc {name}: the library is not installed"):
            find_malloc(name)
    assert find_malloc("auto") is None  # the C library's, where none is found


def test_lower_priority_adds_to_every_thread_once(tmp_path):
    from tritone.processes import lower_priority

    child = subprocess.Popen([sys.executable, "-c", "import threading, time; "
                              "threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"])
    try:
        time.sleep(0.5)  # its second thread started
        base = os.getpriority(os.PRIO_PROCESS, child.pid)
        done: set[int] = set()
        lowered = lower_priority(child.pid, 3, done)
        assert len(lowered) == 2 and set(lowered) == done
        nices = {os.getpriority(os.PRIO_PROCESS, tid) for tid in lowered}
        assert nices == {min(19, base + 3)}
        assert lower_priority(child.pid, 3, done) == []  # each thread once
        lower_priority(child.pid, 30)  # never past 19
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in lowered} == {19}
    finally:
        child.kill()
        child.wait()
