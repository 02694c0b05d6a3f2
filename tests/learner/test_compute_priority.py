"""The learner's compute thread: niced before it runs anything, so the OpenMP threads it starts are too."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from fleetrl.train.trainer import compute_executor


def thread_nices() -> dict[int, int]:
    """{thread id: niceness} of this process's threads."""
    nices = {}
    for tid in os.listdir("/proc/self/task"):
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        nices[int(tid)] = int(fields[16])  # field 19 of stat(5), counted after the command name
    return nices


def test_compute_thread_and_its_openmp_threads_run_niced_and_the_rest_do_not() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the compute thread's first parallel op starts one OpenMP worker
    x = torch.randn(256, 256)
    x @ x  # this thread's own OpenMP workers start now, at normal priority
    before = set(thread_nices())
    executor = compute_executor(7)
    try:
        compute_tid = executor.submit(lambda: ([x @ x for _ in range(4)], threading.get_native_id())[1]).result()
        nices = thread_nices()
    finally:
        executor.shutdown()
        torch.set_num_threads(previous)
    assert nices[compute_tid] == 7
    started = set(nices) - before - {compute_tid}
    assert started and all(nices[tid] == 7 for tid in started)  # OpenMP workers inherit the priority
    assert nices[threading.get_native_id()] == 0  # the event loop's thread keeps normal priority


def test_nice_zero_changes_nothing() -> None:
    executor = compute_executor(0)
    try:
        assert executor.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result() == 0
    finally:
        executor.shutdown()
