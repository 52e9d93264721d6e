"""The benchmarks' CPU-per-token report: processes named by role, CPU summed over a process tree."""

import os
import subprocess
import sys
import time

import psutil

from tritone_bench.proc_cpu import ProcessTree, per_token_ms, read_stat, role


def test_roles_of_both_stacks():
    stub = b"/venv/backends/python/triton_python_backend_stub\x00/run/model_repository/postprocessing/1/model.py\x00x"
    assert role("triton_python_b", stub) == "postprocessing"
    assert role("tritonserver", b"/opt/tritonserver/bin/tritonserver\x00--model-repository=/r") == "tritonserver"
    assert role("python", b"python\x00-m\x00tritone.openai\x00--port\x009000") == "openai front end"
    assert role("VLLM::EngineCor", b"VLLM::EngineCore") == "vllm engine core"
    assert role("VLLM::Worker_TP0", b"python3\x00-c\x00from multiprocessing") == "vllm worker_tp"
    assert role("vllm", b"/venv/bin/python\x00/venv/bin/vllm\x00serve") == "vllm api server"
    assert role("python3.11", b"/usr/bin/python3.11\x00-m\x00tritone.executor.worker\x00{}") == "llm workers"
    assert role("sh", b"/bin/sh\x00-c") == "other"


def test_stat_line_with_spaces_and_parentheses_in_the_name():
    ticks = os.sysconf("SC_CLK_TCK")
    fields = ["S", "42"] + ["0"] * 9 + [str(3 * ticks), str(ticks)] + ["0"] * 30
    assert read_stat(f"7 (a (b) c) {' '.join(fields)}") == (42, 4.0)


def test_tree_counts_a_busy_child_and_not_the_rest_of_the_machine():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ninput()"],
                             stdin=subprocess.PIPE)
    try:
        alone = ProcessTree(child.pid)
        deadline = time.monotonic() + 30
        while alone.cpu_seconds().get("other", 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.02)
        child_seconds = alone.cpu_seconds()
        assert set(child_seconds) == {"other"} and 0.25 <= child_seconds["other"] < 5.0
        # The tree from this process holds the child and this process (and any other process this
        # one started that still lives, such as a compile worker of an earlier test), not the rest
        # of the machine.
        others = sum(_cpu_seconds(p) for p in psutil.Process().children(recursive=True) if p.pid != child.pid)
        ours = ProcessTree(os.getpid()).cpu_seconds()["other"]
        assert child_seconds["other"] <= ours <= child_seconds["other"] + time.process_time() + others + 1.0
    finally:
        child.communicate(b"\n", timeout=10)


def _cpu_seconds(process) -> float:
    """User and system seconds of a process, 0 for one that ended since it was listed (an earlier
    test's server process finishing its exit)."""
    try:
        return sum(process.cpu_times()[:2])
    except psutil.NoSuchProcess:
        return 0.0


def test_per_token_sums_the_text_path():
    before = {"tritonserver": 1.0, "postprocessing": 2.0, "llm": 10.0}
    after = {"tritonserver": 1.5, "postprocessing": 2.25, "preprocessing": 0.05, "llm": 20.0}
    report = per_token_ms(before, after, 1000)
    assert report["tritonserver"] == 0.5 and report["llm"] == 10.0
    assert abs(report["text path"] - 0.8) < 1e-9
