"""The handlers a run installs (megatron_hcp.functional.signals): SIGTERM and SIGHUP raise
Terminated and SIGINT KeyboardInterrupt only while a run is active, the first signal only;
a signal that was ignored stays ignored; the old handlers come back after. (The runs
themselves, ended by signals: tests/unit/functional/test_run_end.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from megatron_hcp.functional.signals import Terminated, end_processes, raising_signals


@pytest.fixture
def handlers():
    """The test's own handlers for the three signals, restored after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM,
                                                     signal.SIGHUP)}
    yield saved
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_a_run_raises_terminated_with_the_shells_code(handlers, signum):
    with pytest.raises(Terminated) as info, raising_signals():
        os.kill(os.getpid(), signum)
    assert info.value.signum == signum and info.value.exit_code == 128 + signum
    assert str(info.value) == f"terminated by {signal.Signals(signum).name}"
    assert not isinstance(info.value, Exception)  # no `except Exception` swallows it
    assert signal.getsignal(signum) == handlers[signum]  # the old handler is back


def test_ctrl_c_stays_keyboard_interrupt_and_only_the_first_signal_raises(handlers):
    with pytest.raises(KeyboardInterrupt), raising_signals():
        try:
            os.kill(os.getpid(), signal.SIGINT)
        finally:  # ending the run: a second signal is dropped, the ending goes on
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == handlers[signal.SIGINT]


def test_an_ignored_signal_stays_ignored(handlers):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    with raising_signals():
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGHUP)  # nothing happens
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_nested_runs_and_other_threads_install_nothing(handlers):
    with raising_signals():
        outer = signal.getsignal(signal.SIGTERM)
        with raising_signals():
            assert signal.getsignal(signal.SIGTERM) is outer
        assert signal.getsignal(signal.SIGTERM) is outer
    assert signal.getsignal(signal.SIGTERM) == handlers[signal.SIGTERM]
    seen = []

    def in_a_thread():
        with raising_signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [handlers[signal.SIGTERM]]


def test_ending_a_launcher_that_is_gone_returns_at_once():
    assert end_processes(2 ** 22 + 12345, signal.SIGTERM, grace=5) is True  # no such pid
