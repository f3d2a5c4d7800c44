"""A machine's cores, shared by the engine nodes on it: a lease taken for every step.

llama.cpp's CPU threads spin while they wait: two busy nodes whose threads add up to more
than the cores slow each other down many times over, while a node alone on the machine is
fastest with every core. So the engine nodes of one host (those the topology puts on it with
no `n_threads` of their own) share the cores through a small shared file, one record a node:
whether it is busy (has work), whether that work is prompt tokens and for how many
requests, how many threads its step runs on now, and its process id. Before each step a
node takes a lease on threads (`acquire`) and gives it back after (`release`):

- a busy node's share is the cores divided by the busy nodes; it takes its share of the
  cores that no running step holds;
- with no core free, a step of one thread starts anyway (the steps then take turns on the
  cores), but never beside a step on several threads: it waits for that one to end (a
  barrier of a step whose other thread lost its core waits for that thread's next turn, so
  a shared step could take many times as long);
- prompts first: while more nodes are busy than there are cores, a step of generated tokens
  waits for nodes evaluating prompt tokens (those waiting for cores, or whose core it would
  share: not while a core is free) whose requests waiting for their prompt work (evaluated
  now, or queued behind it: the scheduler's prompts_at_once) outnumber the step's streams,
  at most `max_wait_s` (the node's `max_itl_slowdown` over its decode pass, the time its
  own prompt work may add to a step) times those requests over the streams: a wait delays
  the step's streams, a step beside the prompts delays those requests' first tokens. In a
  burst, new streams then start sooner and together, in fewer, fuller passes, and the
  first stream does not step alone beside the prompts of the rest; under steady load (as
  many streams as requests or more) a stream does not wait at every token for prompts that
  would end no sooner for it.

The engine thread (and the llama.cpp threads it starts) also runs at a lower priority than
the rest of the machine (`yield_to_io`): a node's gRPC and HTTP handlers, the router and
clients on the host take a core the moment they have work, so a burst of requests reaches
the engines at once, instead of one request a time slice while the engines hold every core.

Cores the host's other processes keep busy (a load generator, a browser, the router under a
burst) are left to them: a step whose threads outnumber the cores it really has waits, at
every one of the hundreds of barriers in a step, for the thread that lost its core (llama.cpp's
threads sleep after a short spin, GOMP_SPINCOUNT in node.py), and takes 10-20 times as long.
The engine nodes measure that load (`OtherLoad`: Linux's busy time less their own processes'
CPU time) and run their steps on the cores left.

A request alone gets every core; many at once share them without oversubscription. A node
that dies leaves its record: the others skip records whose process is gone, and its next
start clears it.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

# One record a node: busy (0 idle, 1 busy, 2 busy with prompt tokens), threads of its step
# now (0 between steps), requests whose prompt tokens its step evaluates, process id. (The
# requests were padding before: a record of an older node reads as 0, taken as 1.)
_RECORD = struct.Struct("<BBHI")
IDLE, BUSY, PROMPTS = 0, 1, 2
# How often a waiting node looks again.
POLL_S = 0.0005
# The engine threads' niceness (Linux: 0 is the default, 19 the lowest priority). At 10 a
# thread at the default niceness gets about 9 times their share of a core they contend for.
ENGINE_NICENESS = 10
# A step held up this long by another node's record takes one thread anyway (a record whose
# process id went to another live process would otherwise hold the cores for ever).
STALE_S = 30.0
# The host's other load is averaged over this long (sampled at most this often), and from
# this many cores of it on the engine nodes leave it a core (two from 1.4, ...).
LOAD_SAMPLE_S = 0.5
LEAVE_CORE_AT = 0.4
# A sample whose window reaches back further than this (the node was idle, or its last step
# was long) may hold load that is already gone: the processes running at this moment bound it.
RECENT_S = 2 * LOAD_SAMPLE_S
NOW_READINGS = 5
NOW_READING_S = 0.002


class _Peer(NamedTuple):
    state: int
    threads: int
    requests: int


class OtherLoad:
    """How many cores the host's processes other than its engine nodes keep busy: the busy
    time of Linux's /proc/stat (steal included: a vCPU the hypervisor took is no core
    either) less the engine processes' CPU time, over the last LOAD_SAMPLE_S or more. 0
    where the machine cannot tell (no /proc).

    A window longer than RECENT_S (the first step after the node was idle) that would leave
    a core counts no more than the threads of other processes running now (`_running_now`,
    ~10 ms, only then): load that ended before the step began (a process that ran its own
    llama.cpp on every core until just now) would otherwise cost the node a core for its
    whole first step (measured: a 1,000-token prompt on one thread for its first 2 s of
    3.2 s, after a 2.6 s run of such a process)."""

    def __init__(self) -> None:
        self._tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._last: tuple[float, float, dict[int, float]] | None = None
        self._cores = 0.0
        self._readable = os.path.isfile("/proc/stat")  # (not looked for again every step)

    def __call__(self, pids: Callable[[], Iterable[int]]) -> float:
        """pids: the engine nodes' processes (read only when a new sample is due)."""
        now = time.monotonic()
        if not self._readable or (self._last is not None and now - self._last[0] < LOAD_SAMPLE_S):
            return self._cores
        host = self._host()
        if host is None:
            return 0.0
        busy, running = host
        mine = {pid: t for pid in pids() if (t := self._process_s(pid)) is not None}
        if self._last is not None and self._last[2].keys() == mine.keys():
            then, busy_then, mine_then = self._last
            engines = sum(mine.values()) - sum(mine_then.values())
            self._cores = max(0.0, (busy - busy_then - engines) / (now - then))
            if now - then > RECENT_S and self._cores >= LEAVE_CORE_AT:
                self._cores = min(self._cores, float(self._running_now(running, list(mine))))
        # (an engine node that came or went: a new baseline, the last figure stands)
        self._last = (now, busy, mine)
        return self._cores

    def _running_now(self, running: int, engines: list[int]) -> int:
        """Other processes' threads running at this moment: the fewest of a few readings
        NOW_READING_S apart (a thread that happens to run at one, such as the router's
        passing this request on, is not a load; a spinning process runs at all of them)."""
        fewest = running - sum(_running_threads(pid) for pid in engines)
        for _ in range(NOW_READINGS - 1):
            if fewest <= 0:
                break
            time.sleep(NOW_READING_S)
            host = self._host()
            if host is None:
                break
            fewest = min(fewest, host[1] - sum(_running_threads(pid) for pid in engines))
        return max(fewest, 0)

    def _host(self) -> tuple[float, int] | None:
        """The host's busy seconds, and the threads running (or ready to) at this moment."""
        try:
            with open("/proc/stat", "rb") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        # cpu user nice system idle iowait irq softirq steal (guest time is in user's)
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, lines[0].split()[1:9])
        running = next((int(ln.split()[1]) for ln in lines if ln.startswith(b"procs_running")), 0)
        return (user + nice + system + irq + softirq + steal) / self._tick, running

    def _process_s(self, pid: int) -> float | None:
        fields = _stat_fields(f"/proc/{pid}/stat")
        if fields is None:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime, stime


def _stat_fields(path: str) -> list[bytes] | None:
    """A /proc stat file's fields after the command name (state first), or None when it is
    gone."""
    try:
        with open(path, "rb") as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return None


def _running_threads(pid: int) -> int:
    """The process's threads running (or ready to) now: state R in /proc."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    states = (_stat_fields(f"/proc/{pid}/task/{task}/stat") for task in tasks)
    return sum(1 for fields in states if fields and fields[0] == b"R")


class HostThreads:
    def __init__(
        self,
        peers: list[str],
        name: str,
        cores: int,
        folder: Path | None = None,
        others: Callable[[Callable[[], Iterable[int]]], float] | None = None,
    ):
        """peers: the names of the engine nodes sharing this host (name among them).
        others: the cores the host's other processes keep busy (default: `OtherLoad`)."""
        ordered = sorted(peers)
        self._index = ordered.index(name)
        self._count = len(ordered)
        self.cores = cores
        key = hashlib.sha256("\n".join(ordered).encode()).hexdigest()[:16]
        shm = Path("/dev/shm")
        base = folder or (shm if shm.is_dir() else Path(tempfile.gettempdir()))
        # v2: the records' layout (a node of an older release used one byte a node).
        self.path = base / f"disagg-mesh-threads-v2-{os.getuid()}-{key}"
        size = self._count * _RECORD.size
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)
        self._pid = os.getpid()
        self._state = IDLE
        self._threads = 0
        self._requests = 0
        self._others = others or OtherLoad()
        with self._locked():
            self._write()

    # -- this node's record ----------------------------------------------------------------

    def set_busy(self, busy: bool) -> None:
        self._state = BUSY if busy else IDLE
        self._write()

    def set_prompts(self, requests: int) -> None:
        """For how many requests this node's next step evaluates prompt tokens (0: none; it
        is busy either way)."""
        self._state = PROMPTS if requests else BUSY
        self._requests = min(requests, 0xFFFF)
        self._write()

    def acquire(self, max_wait_s: float, streams: int = 1) -> int:
        """The threads of this node's next step (whether it has prompt tokens: its record,
        `set_prompts`), taken from the host's free cores (waiting while they are held as the
        module says); `release` gives them back. streams: the step's generated tokens (for
        prompts first)."""
        started = time.perf_counter()
        others = self._others(self._pids)
        cores = max(1, self.cores - int(others + 1 - LEAVE_CORE_AT))
        while True:
            with self._locked():
                peers = self._peers()
                waited = time.perf_counter() - started
                threads = (
                    1
                    if waited > STALE_S
                    else self._grant(peers, cores, waited, max_wait_s, streams)
                )
                if threads:
                    self._threads = threads
                    self._write()
                    return threads
            time.sleep(POLL_S)

    def release(self) -> None:
        self._threads = 0
        self._write()

    def close(self) -> None:
        self._state, self._threads, self._requests = IDLE, 0, 0
        self._write()
        self._map.close()
        os.close(self._fd)

    # -- the others' ---------------------------------------------------------------------

    def _grant(
        self, peers: list[_Peer], cores: int, waited: float, max_wait_s: float, streams: int
    ) -> int:
        """Threads for a step now, or 0: wait. cores: those the host's other processes
        leave."""
        busy = sum(1 for p in peers if p.state != IDLE) + 1
        free = cores - sum(p.threads for p in peers)
        if self._state != PROMPTS and busy > cores:
            # Prompts first: wait for the nodes whose prompt steps wait for cores, or would
            # share a core with this step (not while a core is left free beside them), if
            # they serve more requests than this step has streams, the longer the more.
            requests = sum(
                max(1, p.requests)
                for p in peers
                if p.state == PROMPTS and (p.threads == 0 or free < 1)
            )
            if requests > streams and waited < max_wait_s * requests / max(1, streams):
                return 0
        if free < 1:  # steps of one thread may share a core, one on several never does
            return 0 if any(p.threads > 1 for p in peers) else 1
        return min(max(1, cores // busy), free)

    def _peers(self) -> list[_Peer]:
        """The other nodes' records, but for those whose process is gone."""
        peers = []
        for i in range(self._count):
            if i == self._index:
                continue
            state, threads, requests, pid = _RECORD.unpack_from(self._map, i * _RECORD.size)
            if state != IDLE and pid and _alive(pid):
                peers.append(_Peer(state, threads, requests))
        return peers

    def _pids(self) -> list[int]:
        """The processes of every engine node with a record (this one's among them)."""
        pids = (_RECORD.unpack_from(self._map, i * _RECORD.size)[3] for i in range(self._count))
        return [pid for pid in pids if pid and _alive(pid)]

    def _write(self) -> None:
        _RECORD.pack_into(
            self._map,
            self._index * _RECORD.size,
            self._state,
            self._threads,
            self._requests,
            self._pid,
        )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The whole file, for a decision and its record (two nodes deciding at once would
        both see the same free cores)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that id: not ours, but alive
        return True
    return True


def yield_to_io() -> None:
    """The calling thread, and the threads it starts from now on (llama.cpp's OpenMP
    workers), run at ENGINE_NICENESS: below the node's own event loop and gRPC threads,
    the router and anything else at the default priority. Linux only (elsewhere a no-op:
    macOS sets priority per process)."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:  # never back up: a node started at a lower priority keeps it
        if os.getpriority(os.PRIO_PROCESS, thread) < ENGINE_NICENESS:
            os.setpriority(os.PRIO_PROCESS, thread, ENGINE_NICENESS)
    except OSError:  # a sandbox that forbids it: the default priority
        pass
