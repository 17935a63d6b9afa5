"""Benchmark: our FpmDirectPublisher against the Dynamo runtime's Rust FpmDirectPublisher, same run.

    .venv/bin/python benchmarks/bench_publisher.py [--seconds S] [--json PATH]

Starts its own nats-server on a free loopback port and a receiver in a separate process (a raw
NATS protocol reader, so the receiver never competes with the publisher for the GIL). Measures:

1. caller-side cost of ``publish()`` (median / p99 of single calls): a flood of calls alone, the same
   with a busy Python thread beside it, and a "scheduler cycle" pattern (one call, then ~50 µs of
   Python work) with the busy thread, as in a real engine;
2. records/s one publisher delivers when flooded for ``--seconds``, with delivered / dropped counts
   (ours counts every drop; the runtime's losses are silent, so they show as "unaccounted");
3. publish-to-receive latency p50 / p99 at 1,000 records/s (receive time stamped by the receiver
   process on the shared monotonic clock); both publishers run at once, one record each per
   millisecond half a millisecond apart, so that noise from other processes hits both alike; and during
   that run the CPU time of our sender thread per record (what publishing costs the engine process beyond
   ``publish()``; the runtime's sender shares its tokio threads with the rest of the runtime, so it has no
   such figure);
4. the whole process's CPU per record at 1,000 records/s, each publisher alone, over the same process's CPU
   in an equal idle interval just before (the sleep-paced caller, identical for both, is included): the
   figure that compares the two senders.

Prints a table with ratios (ours / runtime; lower is better for costs and latency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

NS = "bench"
PERF = time.perf_counter


# --------------------------------------------------------------------------- receiver process
class Sched(msgspec.Struct, frozen=True):
    sum_prefill_tokens: int = 0


class Rec(msgspec.Struct):
    wall_time: float = 0.0
    scheduled_requests: Sched = Sched()


class Env(msgspec.Struct):
    payload: bytes


def receiver_main(url: str, subject: str, out_path: str) -> None:
    """Raw NATS subscriber: stamps each socket read, decodes the record's marker field.

    The marker (``scheduled_requests.sum_prefill_tokens``) is the sender's index, so the parent can
    pair every receipt with its publish() time; heartbeats (marker 0 and wall_time 0) are skipped.
    """
    dec_env, dec_rec = msgspec.msgpack.Decoder(Env), msgspec.msgpack.Decoder(Rec)
    host, port = url.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * 1024 * 1024)
    sock.sendall(f'CONNECT {{"verbose":false,"pedantic":false}}\r\nSUB {subject} 1\r\nPING\r\n'.encode())
    markers: list[int] = []
    stamps: list[float] = []
    buf = b""
    ready = False
    sock.settimeout(0.2)
    stop_file = out_path + ".stop"
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            if os.path.exists(stop_file):
                break
            continue
        if not chunk:
            break
        now = PERF()
        buf += chunk
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            line = buf[pos:eol]
            if line.startswith(b"MSG "):
                size = int(line.rsplit(b" ", 1)[1])
                end = eol + 2 + size
                if end + 2 > len(buf):
                    break
                rec = dec_rec.decode(dec_env.decode(buf[eol + 2 : end]).payload)
                if rec.wall_time > 0:
                    markers.append(rec.scheduled_requests.sum_prefill_tokens)
                    stamps.append(now)
                pos = end + 2
            else:
                if line == b"PING":
                    sock.sendall(b"PONG\r\n")
                elif line == b"PONG" and not ready:
                    ready = True
                    print("READY", flush=True)
                pos = eol + 2
        buf = buf[pos:]
    with open(out_path, "w") as f:
        json.dump({"markers": markers, "stamps": stamps}, f)


class Receiver:
    def __init__(self, url: str, subject: str, workdir: str, tag: str) -> None:
        self.out = os.path.join(workdir, f"recv-{tag}.json")
        for stale in (self.out, self.out + ".stop"):  # a previous receiver of the same tag
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--receiver", url, subject, self.out],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError("receiver did not start")

    def finish(self, settle: float = 1.0) -> tuple[list[int], list[float]]:
        time.sleep(settle)
        Path(self.out + ".stop").touch()
        self.proc.wait(30)
        data = json.loads(Path(self.out).read_text())
        return data["markers"], data["stamps"]


# --------------------------------------------------------------------------- publishers under test
class Ours:
    name = "ours"
    kwargs = False

    def __init__(self, url: str, component: str) -> None:
        from dynamo.common.forward_pass_metrics import ForwardPassMetrics, ScheduledRequestMetrics
        from dynamo.common.fpm_publisher import FpmDirectPublisher

        self.pub = FpmDirectPublisher(namespace=NS, component=component, worker_id="bench-ours", nats_url=url)
        self._R, self._S = ForwardPassMetrics, ScheduledRequestMetrics
        self.template = ForwardPassMetrics(worker_id="bench-ours", wall_time=0.001)
        deadline = time.monotonic() + 10
        while not self.pub.stats().connected and time.monotonic() < deadline:
            time.sleep(0.01)

    def make(self, i: int) -> Any:
        return self._R(
            worker_id="bench-ours", wall_time=0.001, scheduled_requests=self._S(sum_prefill_tokens=i)
        )

    def call(self, i: int, rec: Any) -> None:  # the record is built outside the timed call
        self.pub.publish(rec)

    def dropped(self) -> int | None:
        return self.pub.stats().dropped

    def close(self) -> None:
        self.pub.close()


class Runtime:
    name = "runtime"
    kwargs = True

    def __init__(self, drt: Any, component: str) -> None:
        from dynamo.llm import FpmDirectPublisher

        self.pub = FpmDirectPublisher(drt.endpoint(f"{NS}.{component}.generate"), "bench-rt", dp_size=1)
        self.kw = dict(
            dp_rank=0,
            scheduled_num_prefill_requests=1,
            scheduled_sum_prefill_tokens=0,
            scheduled_sum_prefill_kv_tokens=0,
            scheduled_num_decode_requests=0,
            scheduled_sum_decode_kv_tokens=0,
            queued_num_prefill_requests=0,
            queued_sum_prefill_tokens=0,
            queued_num_decode_requests=0,
            queued_sum_decode_kv_tokens=0,
            wall_time_secs=0.001,
        )
        time.sleep(0.3)

    def make(self, i: int) -> Any:
        kw = dict(self.kw)
        kw["scheduled_sum_prefill_tokens"] = i
        return kw

    def call(self, i: int, kw: Any) -> None:
        self.pub.publish(**kw)

    def dropped(self) -> int | None:
        return None  # not exposed: losses are silent

    def close(self) -> None:
        self.pub.shutdown()


# --------------------------------------------------------------------------- measurements
class BusyThread:
    """A Python thread that never blocks: the GIL competitor a real engine has beside the scheduler."""

    def __enter__(self) -> BusyThread:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self) -> None:
        x = 0
        while not self.stop:
            x += 1

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


def timed_calls(pub: Any, n: int, work_us: float = 0.0) -> list[int]:
    """Per-call cost in ns; ``work_us`` of Python work between calls emulates a scheduler cycle."""
    clock = time.perf_counter_ns
    recs = [pub.make(i + 1) for i in range(min(n, 1000))]
    m = len(recs)
    out = [0] * n
    fn = pub.pub.publish
    for i in range(n):
        rec = recs[i % m]
        if pub.kwargs:
            t0 = clock()
            fn(**rec)
            t1 = clock()
        else:
            t0 = clock()
            fn(rec)
            t1 = clock()
        out[i] = t1 - t0
        if work_us:
            end = t1 + work_us * 1000
            while clock() < end:
                pass
    return out


def timer_overhead_ns() -> int:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(100_000):
        t0 = clock()
        samples.append(clock() - t0)
    return int(statistics.median(samples))


def pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


@dataclass
class Result:
    cost: dict[str, tuple[float, float]]  # scenario -> (median ns, p99 ns)
    offered: int
    delivered: int
    dropped: int | None
    flood_seconds: float
    lat_p50_ms: float = 0.0
    lat_p99_ms: float = 0.0
    lat_received: int = 0
    lat_sent: int = 0
    sender_cpu_us_per_record: float | None = None
    process_cpu_us_per_record: float = 0.0


def measure(make_pub: Any, url: str, workdir: str, tag: str, seconds: float) -> Result:
    cost: dict[str, tuple[float, float]] = {}
    # 1. caller-side cost (a throwaway subject: nobody listens, the sender still runs)
    pub = make_pub("costs")
    try:
        for scenario, busy, n, work in (
            ("flood alone", False, 200_000, 0.0),
            ("flood + busy thread", True, 200_000, 0.0),
            ("cycle + busy thread", True, 5_000, 50.0),
        ):
            timed_calls(pub, 2000, work)  # warm-up
            if busy:
                with BusyThread():
                    ns = timed_calls(pub, n, work)
            else:
                ns = timed_calls(pub, n, work)
            cost[scenario] = (statistics.median(ns), pct(ns, 0.99))
    finally:
        pub.close()

    # 2. flood throughput, every record accounted for
    comp = f"flood{tag}"
    recv = Receiver(
        url, f"namespace.{NS}.component.{comp}.endpoint.generate.forward-pass-metrics", workdir, comp
    )
    pub = make_pub(comp)
    try:
        recs = [pub.make(i + 1) for i in range(200_000)]
        offered = 0
        t0 = PERF()
        end = t0 + seconds
        call = pub.call
        while PERF() < end:
            for _ in range(1000):
                call(offered, recs[offered % 200_000])
                offered += 1
        flood_s = PERF() - t0
    finally:
        pub.close()  # ours: flushes what it can within 2 s
    markers, _ = recv.finish()
    delivered = len(markers)
    dropped = pub.dropped()

    return Result(
        cost=cost,
        offered=offered,
        delivered=delivered,
        dropped=dropped,
        flood_seconds=flood_s,
        process_cpu_us_per_record=process_cpu_per_record(make_pub, seconds),
    )


def process_cpu_per_record(make_pub: Any, seconds: float, rate: float = 1000.0) -> float:
    """This process's CPU microseconds per record at ``rate``, over an equal idle interval before it."""
    pub = make_pub("cpu")
    try:
        recs = [pub.make(i + 1) for i in range(1000)]
        time.sleep(0.2)
        p0 = time.process_time()
        time.sleep(seconds)
        idle = time.process_time() - p0
        n = int(seconds * rate)
        p0 = time.process_time()
        start = PERF()
        for i in range(n):
            wait = start + i / rate - PERF()
            if wait > 0:
                time.sleep(wait)
            pub.call(i, recs[i % 1000])
        busy = time.process_time() - p0
    finally:
        pub.close()
    return (busy - idle) / n * 1e6


def sender_thread_cpu_s() -> float:
    """CPU seconds (nanosecond clock) of our publisher's sender thread(s) now alive in this process."""
    total = 0.0
    for t in threading.enumerate():
        if t.name == "fpm-publisher" and t.ident is not None:
            with contextlib.suppress(OSError):  # the thread ended since enumerate()
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


def measure_latency(
    makers: dict[str, Any], url: str, workdir: str, seconds: int, cpu: dict[str, float] | None = None
) -> dict[str, list[float]]:
    """Publish-to-receive latency (ms) at 1,000 records/s per publisher, all publishers at once.

    Each millisecond every publisher gets one record, at evenly spread offsets, so machine noise
    (other processes on a shared box) hits them at the same moments. ``cpu`` receives our sender
    thread's CPU microseconds per record over the run (key "ours").
    """
    recvs, pubs, sent_at, recs = {}, {}, {}, {}
    n = seconds * 1000
    try:
        for name, make in makers.items():
            comp = f"lat{name}"
            subject = f"namespace.{NS}.component.{comp}.endpoint.generate.forward-pass-metrics"
            recvs[name] = Receiver(url, subject, workdir, comp)
            pubs[name] = make(comp)
            sent_at[name] = [0.0] * (n + 1)
            recs[name] = [pubs[name].make(i) for i in range(n + 1)]
        slots = [
            (k / (1000.0 * len(pubs)), pub.pub.publish, pub.kwargs, sent_at[name], recs[name])
            for k, (name, pub) in enumerate(pubs.items())
        ]
        cpu0 = sender_thread_cpu_s()
        start = PERF() + 0.01
        for i in range(1, n + 1):
            for offset, fn, kwargs, times, rr in slots:
                wait = start + i / 1000.0 + offset - PERF()
                if wait > 0:  # sleep-paced: the caller holds the GIL only to publish
                    time.sleep(wait)
                times[i] = PERF()
                if kwargs:
                    fn(**rr[i])
                else:
                    fn(rr[i])
        time.sleep(0.2)
        if cpu is not None and "ours" in pubs:
            cpu["ours"] = (sender_thread_cpu_s() - cpu0) / n * 1e6
    finally:
        for pub in pubs.values():
            pub.close()
    out = {}
    for name, recv in recvs.items():
        markers, stamps = recv.finish(0.2)
        times = sent_at[name]
        out[name] = [(t - times[m]) * 1000 for m, t in zip(markers, stamps, strict=True) if 0 < m <= n]
    return out


def print_table(ours: Result, rt: Result, overhead_ns: int) -> None:
    rows: list[tuple[str, str, str, str, str]] = []

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b else "-"

    # The targets cover the flood, alone and beside a busy thread; the cycle row is extra.
    targets = {"cycle + busy thread": ("(info)", "(info)")}
    for scenario in ours.cost:
        (om, op), (rm, rp) = ours.cost[scenario], rt.cost[scenario]
        tm, tp = targets.get(scenario, ("<= 0.5 us", "<= 2 us"))
        rows.append(
            (f"publish() median, {scenario}", f"{om / 1000:.3f} us", f"{rm / 1000:.3f} us", ratio(om, rm), tm)
        )
        rows.append(
            (f"publish() p99, {scenario}", f"{op / 1000:.3f} us", f"{rp / 1000:.3f} us", ratio(op, rp), tp)
        )
    o_rate, r_rate = ours.delivered / ours.flood_seconds, rt.delivered / rt.flood_seconds
    rows.append(
        ("flood: records delivered/s", f"{o_rate:,.0f}", f"{r_rate:,.0f}", ratio(o_rate, r_rate), ">= 80,000")
    )
    rows.append(("flood: offered", f"{ours.offered:,}", f"{rt.offered:,}", "", ""))
    rows.append(("flood: delivered", f"{ours.delivered:,}", f"{rt.delivered:,}", "", ""))
    rows.append(("flood: dropped (counted)", f"{ours.dropped:,}", "n/a", "", ""))
    o_lost = ours.offered - ours.delivered - (ours.dropped or 0)
    r_lost = rt.offered - rt.delivered
    rows.append(
        (
            "flood: lost silently (unaccounted)",
            f"{o_lost:,} ({o_lost / max(1, ours.offered):.1%})",
            f"{r_lost:,} ({r_lost / max(1, rt.offered):.1%})",
            "",
            "0",
        )
    )
    rows.append(
        (
            "latency p50 @ 1,000 rec/s",
            f"{ours.lat_p50_ms:.3f} ms",
            f"{rt.lat_p50_ms:.3f} ms",
            ratio(ours.lat_p50_ms, rt.lat_p50_ms),
            "",
        )
    )
    rows.append(
        (
            "latency p99 @ 1,000 rec/s",
            f"{ours.lat_p99_ms:.3f} ms",
            f"{rt.lat_p99_ms:.3f} ms",
            ratio(ours.lat_p99_ms, rt.lat_p99_ms),
            "<= runtime",
        )
    )
    rows.append(
        (
            "latency: received / sent",
            f"{ours.lat_received}/{ours.lat_sent}",
            f"{rt.lat_received}/{rt.lat_sent}",
            "",
            "",
        )
    )
    rows.append(
        (
            "process CPU per record @ 1,000 rec/s",
            f"{ours.process_cpu_us_per_record:.1f} us",
            f"{rt.process_cpu_us_per_record:.1f} us",
            ratio(ours.process_cpu_us_per_record, rt.process_cpu_us_per_record),
            "(info)",
        )
    )
    if ours.sender_cpu_us_per_record is not None:
        rows.append(
            (
                "sender thread CPU per record @ 1,000 rec/s",
                f"{ours.sender_cpu_us_per_record:.1f} us",
                "n/a (shared tokio threads)",
                "",
                "(info)",
            )
        )
    widths = [
        max(len(r[i]) for r in [("metric", "ours", "runtime (Rust)", "ours/runtime", "target"), *rows])
        for i in range(5)
    ]
    header = ("metric", "ours", "runtime (Rust)", "ours/runtime", "target")
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    print(f"(per-call figures include the timer's own overhead, median {overhead_ns} ns)")


async def amain(args: argparse.Namespace) -> int:
    from dynamo_fpm_testing.nats_server import EmbeddedNatsServer

    with EmbeddedNatsServer() as server, tempfile.TemporaryDirectory(prefix="bench-fpm-") as workdir:
        os.environ["NATS_SERVER"] = server.url
        os.environ.setdefault("DYN_FILE_KV", os.path.join(workdir, "discovery"))
        os.environ.setdefault("DYN_LOG", "warn")
        for var in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST"):
            os.environ.setdefault(var, "127.0.0.1")
        from dynamo.runtime import DistributedRuntime

        drt = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="nats")
        try:
            overhead = timer_overhead_ns()
            print(
                f"nats-server {server.url}; flood {args.seconds:g} s per publisher; python "
                f"{sys.version.split()[0]}"
            )
            t0 = time.monotonic()
            load0 = os.getloadavg()[0]
            ours = await asyncio.to_thread(
                measure, lambda c: Ours(server.url, c), server.url, workdir, "o", args.seconds
            )
            rt = await asyncio.to_thread(
                measure, lambda c: Runtime(drt, c), server.url, workdir, "r", args.seconds
            )
            lat_s = max(2, round(args.seconds))
            sender_cpu: dict[str, float] = {}
            lats = await asyncio.to_thread(
                measure_latency,
                {"ours": lambda c: Ours(server.url, c), "runtime": lambda c: Runtime(drt, c)},
                server.url,
                workdir,
                lat_s,
                sender_cpu,
            )
            ours.sender_cpu_us_per_record = sender_cpu.get("ours")
            for res, name in ((ours, "ours"), (rt, "runtime")):
                res.lat_p50_ms, res.lat_p99_ms = pct(lats[name], 0.5), pct(lats[name], 0.99)
                res.lat_received, res.lat_sent = len(lats[name]), lat_s * 1000
            print(
                f"measured in {time.monotonic() - t0:.1f} s; load average before/after "
                f"{load0:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n"
            )
            print_table(ours, rt, overhead)
            if args.json:
                Path(args.json).write_text(
                    json.dumps({"ours": ours.__dict__, "runtime": rt.__dict__}, indent=1)
                )
        finally:
            drt.shutdown()
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--receiver":
        receiver_main(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="flood duration per publisher (default 3)")
    parser.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    return asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
