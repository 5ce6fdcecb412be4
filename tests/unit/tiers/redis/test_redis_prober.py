"""The redis tier's presence probes against a real redis-server: one pipelined EXISTS in
flight per node, shared by every lookup that asks meanwhile; answers reach the tier
that asked before the probe's future completes; a node that does not answer holds its
own keys only, for no longer than the link's call deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import redis
from redis_harness import RedisServer

from kvtierd.tiers.redis.link import RedisLink
from kvtierd.tiers.redis.prober import ProbeAnswer, Prober
from kvtierd.tiers.redis.settings import RedisTierSettings


class Answers:
    """A listener (what a RedisTier is to the prober) that keeps what it was told."""

    def __init__(self) -> None:
        self.present: dict[bytes, bool | None] = {}
        self.errors: list[BaseException] = []

    def probe_answered(self, answer: ProbeAnswer) -> None:
        self.present.update(answer.answers)
        if answer.error is not None:
            self.errors.append(answer.error)


def _link(server: RedisServer, timeout: float) -> RedisLink:
    return RedisLink(RedisTierSettings(urls=(server.url,), cluster="false", timeout=timeout), None)


def test_lookups_asking_while_a_probe_is_in_flight_share_the_next_one(redis_factory) -> None:
    server = redis_factory()
    prefix = f"prober-{uuid.uuid4().hex[:8]}:".encode()
    with redis.Redis.from_url(server.url) as client:
        client.set(prefix + b"a", b"1")
        client.set(prefix + b"b", b"1")
    link = _link(server, timeout=10.0)
    link.client()  # built: keys route on the loop from now on

    async def scenario() -> None:
        prober = Prober(link, asyncio.get_running_loop(), "unit")
        told = Answers()
        try:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)  # the first probe hangs in flight
            first = prober.ask(told, [(prefix + b"a", b"a")])
            await asyncio.sleep(0)  # its loop turn ended: it left
            assert prober.probes == 1 and not first[0].done()
            second = prober.ask(told, [(prefix + b"b", b"b")])  # two lookups meanwhile
            third = prober.ask(told, [(prefix + b"c", b"c"), (prefix + b"a", b"a")])
            # "b" and "c" wait for the next probe, shared; "a" rides on the one it is in
            assert len(second) == 1 and {id(f) for f in third} == {id(second[0]), id(first[0])}
            assert prober.probes == 1  # nothing else left while one is in flight
            os.kill(server.proc.pid, signal.SIGCONT)
            await asyncio.wait_for(asyncio.gather(first[0], second[0]), 10)
            assert prober.probes == 2  # "b" and "c" in one pipeline
            assert told.present == {b"a": True, b"b": True, b"c": False}
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            prober.close()

    try:
        asyncio.run(scenario())
    finally:
        link.close()


def test_a_node_that_does_not_answer_fails_its_probe_within_the_call_deadline(
    redis_factory,
) -> None:
    server = redis_factory()
    link = _link(server, timeout=0.3)
    link.client()

    async def scenario() -> None:
        prober = Prober(link, asyncio.get_running_loop(), "unit")
        told = Answers()
        try:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            futures = prober.ask(told, [(b"unit:x", b"x")])
            await asyncio.wait_for(asyncio.gather(*futures), 10)
            assert time.monotonic() - started < 5.0  # the deadline (2 x timeout), not forever
            assert told.present == {b"x": None} and told.errors  # unknown, and why
            again = prober.ask(told, [(b"unit:y", b"y")])  # the node is skipped: no wait
            await asyncio.wait_for(asyncio.gather(*again), 1.0)
            assert told.present[b"y"] is None
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
            prober.close()

    try:
        asyncio.run(scenario())
    finally:
        link.close()


def test_closing_the_prober_wakes_every_waiting_lookup(redis_factory) -> None:
    server = redis_factory()
    link = _link(server, timeout=10.0)
    link.client()

    async def scenario() -> None:
        prober = Prober(link, asyncio.get_running_loop(), "unit")
        try:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
            futures = prober.ask(Answers(), [(b"unit:z", b"z")])
            await asyncio.sleep(0)  # the first probe left
            futures += prober.ask(Answers(), [(b"unit:w", b"w")])
            prober.close()
            await asyncio.wait_for(asyncio.gather(*futures), 1.0)
            assert prober.ask(Answers(), [(b"unit:v", b"v")]) == []  # closed: nothing asked
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

    try:
        asyncio.run(scenario())
    finally:
        link.close()
