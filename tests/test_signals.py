"""`slime.signals`: SIGTERM as SystemExit(143) for the entry points, and a handler kept across code (ray.init)
that installs its own."""

import os
import signal

import pytest

from slime.signals import keep_sigterm_handler, sigterm_as_exit


def test_sigterm_raises_system_exit_143_inside_the_block_and_the_old_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped, sigterm_as_exit():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
        raise AssertionError("SIGTERM did not stop the block")
    assert stopped.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_handler_replaced_inside_the_block_is_put_back():
    def mine(signum, frame):
        raise SystemExit(1)

    def theirs(signum, frame):  # what ray.init installs
        raise AssertionError("not this one")

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with keep_sigterm_handler():
            signal.signal(signal.SIGTERM, theirs)
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_handler_exception_reported_as_system_error_by_a_c_extension_comes_out_as_itself():
    from slime.signals import unwrap_signal_errors

    @unwrap_signal_errors
    def blocked_in_ray_wait(cause: BaseException):
        try:
            raise cause
        except BaseException as inner:  # what CPython does when a C call returns with an exception set
            raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from inner

    with pytest.raises(SystemExit) as stopped:
        blocked_in_ray_wait(SystemExit(143))
    assert stopped.value.code == 143
    with pytest.raises(SystemError):  # an ordinary error stays what it was
        blocked_in_ray_wait(ValueError("not a signal"))
