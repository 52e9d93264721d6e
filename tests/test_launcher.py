"""The launcher's choices that need no server: which allocator tritonserver runs on, how its text work is
made nicer."""

import os
import pathlib
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


def test_lower_priority_raises_every_threads_nice_value_to_at_least_the_one_given(tmp_path):
    from tritone.processes import lower_priority

    child = subprocess.Popen([sys.executable, "-c", "import threading, time; "
                              "threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"])
    try:
        time.sleep(0.5)  # its second thread started
        base = os.getpriority(os.PRIO_PROCESS, child.pid)
        target = min(19, base + 3)
        changed = lower_priority(child.pid, target)
        assert len(changed) == (2 if target > base else 0)
        tids = [int(t.name) for t in pathlib.Path(f"/proc/{child.pid}/task").iterdir()]
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in tids} == {target}
        assert lower_priority(child.pid, target) == []  # nothing left to change
        assert lower_priority(child.pid, base) == []  # never back
        lower_priority(child.pid, 30)  # never past 19
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in tids} == {19}
    finally:
        child.kill()
        child.wait()


def test_text_nice_auto_is_19_inline_and_10_beside_the_ensembles_processes():
    from tritone.config import OPTIONS_BY_NAME, text_nice

    assert text_nice("auto", "inline") == 19
    assert text_nice("auto", "ensemble") == 10  # its flow control takes a long-unread chunk for a lost stream
    assert text_nice("5", "inline") == text_nice("5", "ensemble") == 5
    for bad in ("20", "-1", "high"):
        with pytest.raises(ValueError, match="text_nice"):
            OPTIONS_BY_NAME["text_nice"].validate(bad)
