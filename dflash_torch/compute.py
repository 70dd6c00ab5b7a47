"""The process's one torch compute thread.

The torch CPU wheel runs its parallel ops with GNU OpenMP (libgomp), which gives every
thread that runs a parallel op its own team of worker threads, kept until that thread
exits. libgomp counts the threads of all teams; once they outnumber the cores (two
Python threads that each ran torch ops with 2 threads, on 2 cores), every team's
threads stop spinning between parallel regions ("throttled" spin) and sleep instead,
so each op pays a futex wake-up. On a 2-core CPU a 16x256 @ 256x768 linear takes about
80 us when one thread owns a team and about 200 us on either thread once two do.

So all of the engine's torch work (loading, warm-up, every decoding round) runs on one
thread per process, whichever thread calls the engine: :func:`run` hands a function to
it and returns its result (a prompt is still tokenized in the calling thread).
Code that mixes its own torch work with an engine's in one process should run it
through :func:`run` too. ``torch.set_num_threads`` called in the main thread reaches the
compute thread at the main thread's next call (:func:`set_num_threads` sets the compute
thread's from any thread). That thread is a dedicated one, or, inside
``with this_thread():``, the calling thread itself: a program whose torch work all
starts from one thread (``generate``, ``bench``) then runs it there, and Ctrl-C
interrupts it as usual.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
from concurrent import futures
from concurrent.futures import Future
from typing import Callable, Iterator, TypeVar

import torch

from .options import check_threads

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_tasks: queue.SimpleQueue = queue.SimpleQueue()
_closed = False
_claimed: threading.Thread | None = None  # the thread inside ``this_thread()``, if any
_running: Future | None = None  # the call running on the dedicated thread
_inline = threading.local()  # depth: the run() calls running inline in this (claimed) thread
_interrupted: set[Future] = set()  # calls whose caller got Ctrl-C and waits for them to end
_main_threads: int | None = None  # torch.get_num_threads() of the main thread at its last run() call


def _loop() -> None:
    global _running
    while True:
        item = _tasks.get()
        if item is None:
            return
        fn, args, kwargs, future = item
        if _closed:  # (queued by a daemon thread before the exit: not run while the interpreter finalizes)
            if future.set_running_or_notify_cancel():
                future.set_exception(SystemExit())
            continue
        if not future.set_running_or_notify_cancel():
            continue
        _running = future
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, which re-raises it
            future.set_exception(exc)
        _running = None
        del item, fn, args, kwargs, future  # no reference to the task outlives it


def _start() -> threading.Thread | None:
    global _thread
    with _lock:
        if _thread is None and not _closed:
            _thread = threading.Thread(target=_loop, name="dflash-compute", daemon=True)
            _thread.start()
        return _thread


EXIT_WAIT_S = 30.0  # seconds the exit waits for a call still running on the compute thread


@atexit.register
def _stop() -> None:
    """At exit (after every non-daemon thread ended): a call still running on the compute thread,
    one a daemon thread made, is asked to stop as after Ctrl-C (between rounds, see
    :func:`interrupted`) and waited for, up to ``EXIT_WAIT_S`` seconds, and calls queued behind it
    are not run: an interpreter that finalizes under a running torch op aborts the process
    ("terminate called without an active exception", SIGABRT). Later calls run inline in the main
    thread (an atexit handler's); a call from another thread ends that thread (``SystemExit``),
    which would otherwise run torch ops while the interpreter finalizes."""
    global _closed
    with _lock:
        _closed = True
        running = _running
        if _thread is not None:
            _tasks.put(None)
    if running is not None:
        _interrupted.add(running)
        futures.wait([running], timeout=EXIT_WAIT_S)


def _after_fork() -> None:
    """In a forked child (``os.fork``, multiprocessing's ``fork`` start method, a server that
    loads the model before forking its workers): the parent's compute thread does not exist
    there, so the child starts its own at its first call (a call queued to the parent's
    would wait forever). A call the parent had running is not the child's."""
    global _lock, _thread, _tasks, _running, _claimed
    _lock, _thread, _tasks, _running = threading.Lock(), None, queue.SimpleQueue(), None
    _interrupted.clear()
    if _claimed is not threading.current_thread():
        _claimed = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


@contextlib.contextmanager
def this_thread() -> Iterator[None]:
    """Within the block, :func:`run` called from this thread runs inline: this thread is
    the compute thread (calls from other threads still go to the dedicated one)."""
    global _claimed
    previous, _claimed = _claimed, threading.current_thread()
    try:
        yield
    finally:
        _claimed = previous


def run(fn: Callable[..., T], *args, **kwargs) -> T:
    """Call ``fn(*args, **kwargs)`` on the compute thread and return its result.

    Calls run one at a time in arrival order; a call made on the compute thread itself
    (see :func:`this_thread`), or from the main thread after interpreter shutdown began, runs
    inline (from another thread then, it raises ``SystemExit``: see :func:`_stop`). An
    exception raised by ``fn`` is raised here. A caller interrupted by Ctrl-C waits for
    ``fn`` to end (see :func:`interrupted`; a second Ctrl-C stops waiting), then raises
    ``KeyboardInterrupt``.
    ``fn`` must not wait for another thread's engine call: that call waits for ``fn``.
    """
    current = threading.current_thread()
    if current is _claimed:
        _inline.depth = getattr(_inline, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inline.depth -= 1
    if current is threading.main_thread():
        fn, args, kwargs = _with_main_threads(fn, args, kwargs)
    thread = _thread or _start()
    future: Future = Future()
    with _lock:  # (a task queued after _stop's sentinel would never run)
        if _closed and current is not threading.main_thread() and current is not thread:
            raise SystemExit  # (a daemon thread at exit: see _stop)
        inline = _closed or current is thread
        if not inline:
            _tasks.put((fn, args, kwargs, future))
    if inline:
        return fn(*args, **kwargs)
    try:
        return future.result()
    except BaseException:  # interrupted (Ctrl-C) while fn runs: let fn end before the interrupt
        # unwinds (an interpreter that exits under a running torch op aborts the process)
        _interrupted.add(future)
        future.add_done_callback(_interrupted.discard)  # (when fn ends, not when waiting stops: fn still stops)
        with contextlib.suppress(BaseException):  # a second Ctrl-C stops waiting
            futures.wait([future])
        raise
    finally:
        del future  # a raised exception's traceback would keep the result alive


def _with_main_threads(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """``fn`` with its arguments, to be run on the compute thread for the main thread: where
    the main thread's ``torch.get_num_threads()`` changed since its last call
    (``torch.set_num_threads`` after the engine loaded, which sets it for the calling thread
    only), preceded by the same change on the compute thread, so that the program's setting
    holds for the engine's work as for its own (a new thread takes the setting made before it
    started; :func:`set_num_threads` changes the compute thread's alone)."""
    global _main_threads
    n = torch.get_num_threads()
    if n == _main_threads:
        return fn, args, kwargs
    first, _main_threads = _main_threads is None, n
    if first and _thread is None:  # (the compute thread, started now, takes it)
        return fn, args, kwargs

    def after_setting(*a, **k):
        torch.set_num_threads(n)
        return fn(*a, **k)

    return after_setting, args, kwargs


def on_compute_thread() -> bool:
    """Whether the caller runs inside a :func:`run` call: on the dedicated compute thread, or
    inline in the thread that :func:`this_thread` claimed. A call there must not wait for
    another thread's engine call, which waits for it."""
    return (_thread is not None and threading.current_thread() is _thread) or getattr(_inline, "depth", 0) > 0


def busy() -> bool:
    """Whether a call runs on the dedicated compute thread now."""
    return _running is not None


def check_caller(what: str) -> None:
    """Refuse ``what`` (a step of a decoder, e.g. ``BatchDecoder.step``) called from another
    thread while the compute thread runs a call: that call may be decoding with the same
    caches (an engine's ``generate_batch``, a server's rounds), which the step would change
    under it.

    Raises:
        DFlashError: naming ``what`` and :func:`run`, which waits its turn.
    """
    if _running is not None and not on_compute_thread():
        from .errors import DFlashError

        raise DFlashError(f"{what} was called from another thread while the compute thread runs an engine call "
                          "(which may be decoding with the same caches): call it through dflash_torch.compute.run, "
                          "which waits its turn")


def interrupted() -> bool:
    """Whether the caller of the running call was interrupted (Ctrl-C) and waits for it to
    end: a long call should check it between steps and stop."""
    return _running is not None and _running in _interrupted and threading.current_thread() is _thread


def stopped() -> BaseException:
    """What a call that :func:`interrupted` stops raises: ``KeyboardInterrupt`` for its caller's
    Ctrl-C, ``SystemExit`` at the process's exit (:func:`_stop`: the daemon thread that made the
    call then ends without a traceback, nobody having pressed Ctrl-C)."""
    return SystemExit() if _closed else KeyboardInterrupt()


def set_num_threads(n: int, name: str = "threads") -> None:
    """``torch.set_num_threads(n)`` for the compute thread (and torch's default for new threads).

    Raises:
        DFlashError: ``n`` is not an integer in [1, the CPUs this process may use]
            (:func:`~dflash_torch.options.usable_cpus`; ``name`` is the option's name in the message).
    """
    run(torch.set_num_threads, check_threads(n, name))
