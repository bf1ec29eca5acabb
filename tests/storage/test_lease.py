"""One writer per run: the lease `{store}/{run_id}/.lease.json` on file:// and s3:// (moto on 127.0.0.1).

A second holder is refused naming the first (host, pid, since); the first may re-enter; a lease whose
process is gone, or that was not renewed in time, is taken over; release deletes only the holder's own lease.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import fsspec
import pytest
from conftest import moto_s3_options

from slime.errors import RunInUseError
from slime.storage.lease import LEASE_NAME, RunLease, hold_run_uri


@pytest.fixture(scope="module")
def s3_options():
    yield from moto_s3_options("slime-leases", skip_instance_cache=True)


@pytest.fixture(params=["file", "s3"])
def run_uri(request, tmp_path):
    """A run directory on a local disk or in S3, and its storage options."""
    if request.param == "file":
        return str(tmp_path / "store" / "run1"), {}
    options = request.getfixturevalue("s3_options")
    return f"s3://slime-leases/{request.node.name.replace('[', '-').rstrip(']')}/run1", options


def read_lease(uri, options):
    fs, path = fsspec.core.url_to_fs(f"{uri}/{LEASE_NAME}", **options)
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def write_lease(uri, options, **record):
    fs, path = fsspec.core.url_to_fs(f"{uri}/{LEASE_NAME}", **options)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, json.dumps(record).encode())


def test_second_writer_is_refused_naming_the_first_and_the_first_reenters(run_uri):
    uri, options = run_uri
    with hold_run_uri(uri, options) as lease:
        held = read_lease(uri, options)
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and held["since"]
        with hold_run_uri(uri, options) as again:  # the pipeline flow, then a stage flow inside it
            assert again is lease
        assert read_lease(uri, options)["token"] == held["token"]  # re-entry released nothing
        other = RunLease(uri, options)
        with pytest.raises(RunInUseError) as refused:
            other.acquire()
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message and f"host {socket.gethostname()}" in message
        assert f"since {held['since']}" in message and "--run-id" in message
    assert read_lease(uri, options) is None  # released


def test_a_lease_of_a_process_that_is_gone_is_taken_over(run_uri):
    uri, options = run_uri
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    write_lease(uri, options, host=socket.gethostname(), pid=pid, since=now, renewed_at=now, token="old",
                command="slime rl")
    with hold_run_uri(uri, options):
        assert read_lease(uri, options)["pid"] == os.getpid()


def test_a_lease_not_renewed_within_its_ttl_is_taken_over_but_a_fresh_one_is_not(run_uri):
    uri, options = run_uri
    old = "2020-01-01T00:00:00+00:00"
    write_lease(uri, options, host="another-host", pid=1, since=old, renewed_at=old, token="remote",
                command="slime rl")
    with hold_run_uri(uri, options, ttl_s=60):
        assert read_lease(uri, options)["host"] == socket.gethostname()
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    write_lease(uri, options, host="another-host", pid=1, since=now, renewed_at=now, token="remote",
                command="slime rl --config x.yaml")
    with pytest.raises(RunInUseError, match=r"slime rl --config x.yaml \(host another-host, pid 1"):
        RunLease(uri, options, ttl_s=60).acquire()
    assert read_lease(uri, options)["token"] == "remote"  # the refused writer left it alone


def test_the_holder_renews_its_lease_and_release_spares_a_lease_taken_over_meanwhile(run_uri):
    uri, options = run_uri
    lease = RunLease(uri, options, ttl_s=0.4)  # renewed every 0.1 s
    lease.acquire()
    first = read_lease(uri, options)["renewed_at"]
    deadline = time.monotonic() + 10
    while read_lease(uri, options)["renewed_at"] == first:
        assert time.monotonic() < deadline, "the lease was not renewed"
        time.sleep(0.05)
    lease._stop.set()  # the holder hangs: no more renewals; another process takes the stale lease over
    lease._renewer.join()
    time.sleep(0.5)
    taker = RunLease(uri, options, ttl_s=0.4)
    taker.record["pid"] = 1  # as if from another process
    taker.acquire()
    lease.release()  # the old holder ends: the new holder's lease stays
    assert read_lease(uri, options)["token"] == taker.record["token"]
    taker.release()
    assert read_lease(uri, options) is None


def test_two_processes_racing_for_one_run_get_exactly_one_lease(tmp_path):
    """Four processes start at once on one local run: one holds it, three are refused naming a holder.
    The holder keeps the lease until the three others have exited (it waits for the file `done`)."""
    done = tmp_path / "done"
    script = textwrap.dedent(f"""
        import os, sys, time
        from slime.errors import RunInUseError
        from slime.storage.lease import RunLease
        lease = RunLease({str(tmp_path / "run")!r})
        time.sleep(max(0.0, float(sys.argv[1]) - time.time()))
        try:
            lease.acquire()
        except RunInUseError as exc:
            print("refused", exc)
            sys.exit(3)
        print("held", flush=True)
        deadline = time.time() + 120
        while not os.path.exists({str(done)!r}) and time.time() < deadline:
            time.sleep(0.05)
        lease.release()
    """)
    start = time.time() + 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(start)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(4)]
    deadline = time.monotonic() + 120
    while sum(p.poll() is not None for p in procs) < 3:  # the refused ones end at once; a second holder would not
        assert time.monotonic() < deadline, "fewer than three writers were refused"
        time.sleep(0.05)
    done.touch()
    outs = [(p.wait(timeout=60), p.stdout.read()) for p in procs]
    assert sorted(code for code, _ in outs) == [0, 3, 3, 3], outs
    assert all("is in use by" in out for code, out in outs if code == 3)
    assert not (tmp_path / "run" / LEASE_NAME).exists()


def test_a_scheduled_eval_runs_beside_training_but_not_beside_another_eval(tmp_path):
    """Training holds the run; a watch eval takes only the evaluate lease; a second eval is refused."""
    from slime.config import load_config
    from slime.storage.lease import hold_run, hold_stage

    config = load_config(None, ["--store", str(tmp_path), "--run-id", "r"])
    other = tmp_path / "r" / ".lease-evaluate.json"
    with hold_run(config):  # `slime rl` on the run
        with hold_stage(config, "evaluate", watch=True):
            assert other.exists()
            taker = RunLease(str(tmp_path / "r"), name=".lease-evaluate.json")
            with pytest.raises(RunInUseError, match=r"the .lease-evaluate.json of run .* is in use by"):
                taker.acquire()
        assert not other.exists()
    assert not (tmp_path / "r" / LEASE_NAME).exists()
    with hold_stage(config, "rl", watch=True):  # watch concerns evaluate only: rl takes the run's lease
        assert (tmp_path / "r" / LEASE_NAME).exists() and not other.exists()


def test_check_free_refuses_early_only_for_a_live_holder(tmp_path):
    from slime.config import load_config
    from slime.storage.lease import check_free

    config = load_config(None, ["--store", str(tmp_path), "--run-id", "r"])
    check_free(config, "rl")  # no lease at all
    now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
    write_lease(str(tmp_path / "r"), {}, host="gpu-node-7", pid=4242, since=now, renewed_at=now, token="t",
                command="slime pipeline --config x.yaml")
    with pytest.raises(RunInUseError, match=r"slime pipeline --config x.yaml \(host gpu-node-7, pid 4242"):
        check_free(config, "rl")
    check_free(config, "evaluate", watch=True)  # a scheduled eval needs only the evaluate lease
    old = "2020-01-01T00:00:00+00:00"
    write_lease(str(tmp_path / "r"), {}, host="gpu-node-7", pid=4242, since=old, renewed_at=old, token="t")
    check_free(config, "rl")  # stale: it will be taken over


def test_a_lease_of_a_killed_process_not_yet_reaped_is_taken_over(tmp_path):
    """A holder killed but not yet reaped by its parent (a zombie) holds nothing."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        child.kill()
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        now = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        write_lease(str(tmp_path / "r"), {}, host=socket.gethostname(), pid=child.pid, since=now, renewed_at=now,
                    token="z", command="slime rl")
        with hold_run_uri(str(tmp_path / "r")):
            assert read_lease(str(tmp_path / "r"), {})["pid"] == os.getpid()
    finally:
        child.wait()
