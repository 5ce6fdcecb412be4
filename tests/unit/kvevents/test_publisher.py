"""The publisher thread and the service's translation, on real ZeroMQ sockets (ipc
in a temporary directory) read by a real subscriber (tests/kv_events_harness.py)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import zmq
from daemon_harness import eventually
from kv_events_harness import SEQ, EventReader

from kvtierd.contract import BlockEvent, Medium
from kvtierd.kvevents import wireformat
from kvtierd.kvevents.publisher import EventPublisher
from kvtierd.kvevents.translator import Translator
from kvtierd_client.wire.proto import pb2


@pytest.fixture
def where() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")
    yield path
    for name in os.listdir(path):
        os.unlink(os.path.join(path, name))
    os.rmdir(path)


def publisher(where: str, **bounds: int) -> EventPublisher:
    settings = {"queue_bytes": 1 << 20, "replay_bytes": 1 << 20, **bounds}
    topics = [b"kv@a@m", b"kv@b@m"]
    made = EventPublisher(f"ipc://{where}/pub", f"ipc://{where}/replay", topics, **settings)
    made.start()
    return made


def event(n: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": [n], "medium": "CPU"}


def sent_alone(pub: EventPublisher, events: list[dict]) -> None:
    """Publishes ``events`` as a message of their own (waits until it is sent)."""
    before = pub.stats().messages
    assert pub.publish(events)
    eventually(lambda: pub.stats().messages > before, 20, "the message sent")


def test_messages_are_numbered_without_gaps_one_per_topic_and_replayed(where):
    pub = publisher(where)
    try:
        with EventReader(f"ipc://{where}/pub", f"ipc://{where}/replay") as reader:
            for n in range(3):
                sent_alone(pub, [event(n)])
            for n in range(3, 6):  # a burst: gathered into one message
                assert pub.publish([event(n)])
            reader.until(lambda events: len(events) >= 12)
        messages = reader.ordered
        assert [m.seq for m in messages] == list(range(len(messages)))
        assert [m.topic for m in messages] == ["kv@a@m", "kv@b@m"] * (len(messages) // 2)
        for topic in ("kv@a@m", "kv@b@m"):
            hashes = [e["block_hashes"][0] for m in messages if m.topic == topic for e in m.events]
            assert hashes == list(range(6))  # each event once per topic, in order
        assert len(messages) < 12  # the burst shared a message
        assert pub.stats().last_seq == len(messages) - 1
    finally:
        pub.stop()
    assert not os.path.exists(f"{where}/pub")  # ipc files go with the publisher


def test_the_replay_window_is_bounded_in_bytes_and_answers_from_a_sequence(where):
    pub = publisher(where, replay_bytes=64 << 10)
    try:
        big = {"type": "BlockRemoved", "block_hashes": list(range(1000)), "medium": "CPU"}
        for _ in range(40):  # ~3 KB a message, two topics: far more than the window
            sent_alone(pub, [big])
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"ipc://{where}/replay")
        try:
            dealer.send_multipart([b"", SEQ.pack(0)])
            answered = []
            while True:
                assert dealer.poll(10_000)
                _empty, topic, seq, _payload = dealer.recv_multipart()
                if not topic:
                    assert seq == b"\xff" * 8  # the end: -1
                    break
                answered.append(SEQ.unpack(seq)[0])
        finally:
            dealer.close(0)
        assert answered == list(range(answered[0], 80))
        size = len(wireformat.payload(1.0, [big])) + len(b"kv@a@m") + 64  # as the window counts
        assert answered[0] > 0 and len(answered) == (64 << 10) // size  # only the newest 64 KiB
    finally:
        pub.stop()


def test_a_full_queue_refuses_and_says_the_publisher_lost_events(where):
    pub = EventPublisher(f"ipc://{where}/pub", "", [b"t"], queue_bytes=1000, replay_bytes=1 << 20)
    try:  # not started: nothing drains the queue
        assert pub.publish([event(0)] * 5)  # the first list is always taken
        assert not pub.publish([event(1)] * 20)
        assert pub.lost and pub.stats().refused_items == 20
        assert pub.publish([event(1)] * 20, bounded=False)  # a re-announce
    finally:
        pub.stop()


def wire(n: int) -> pb2.BlockDescription:
    return pb2.BlockDescription(block_hashes=[n], token_ids=[n, n], block_size=2)


def stores(events, medium):  # noqa: ANN001, ANN201
    return [e["block_hashes"][0] for e in events if e["type"] == "BlockStored"
            and e["medium"] == medium]  # fmt: skip


def removals(events, medium):  # noqa: ANN001, ANN201
    return [h for e in events if e["type"] == "BlockRemoved" and e["medium"] == medium
            for h in e["block_hashes"]]  # fmt: skip


def test_storage_is_one_medium_however_many_tiers_hold_a_key():
    translator = Translator(1 << 20)
    events = translator.describe("p", [b"a", b"b"], [wire(1), pb2.BlockDescription()])
    for event in (
        BlockEvent((b"a", b"b"), Medium.CPU, removed=False),  # b: undescribed
        BlockEvent((b"a",), Medium.STORAGE, False, tier="fs0"),
        BlockEvent((b"a",), Medium.REMOTE, False, tier="redis0"),
        BlockEvent((b"a",), Medium.STORAGE, True, tier="fs0"),  # redis0 still holds it
        BlockEvent((b"a",), Medium.CPU, removed=True),
        BlockEvent((b"a",), Medium.REMOTE, True, tier="redis0"),
    ):
        events += translator.observe("p", event)
    assert stores(events, "CPU") == [1] and stores(events, "STORAGE") == [1]
    assert [(e["type"], e["medium"]) for e in events] == [
        ("BlockStored", "CPU"), ("BlockStored", "STORAGE"),
        ("BlockRemoved", "CPU"), ("BlockRemoved", "STORAGE"),
    ]  # fmt: skip
    assert translator.undescribed_stores == 1 and len(translator.table) == 0


def test_a_description_the_bound_takes_out_is_withdrawn_first():
    translator = Translator(64 << 10)
    events = []
    for n in range(200):
        key = f"k{n}".encode()
        events += translator.describe("p", [key], [wire(n)])
        events += translator.observe("p", BlockEvent((key,), Medium.CPU, removed=False))
    withdrawn = removals(events, "CPU")
    held = set(stores(events, "CPU")) - set(withdrawn)
    assert withdrawn and len(held) == len(translator.table)
    assert translator.table.used_bytes <= 64 << 10
    assert withdrawn == sorted(withdrawn)  # the least recently stored first


def test_after_a_refusal_the_next_message_starts_with_what_on_lost_says(where):
    lost_marker = {"type": "AllBlocksCleared"}
    pub = EventPublisher(
        f"ipc://{where}/pub", f"ipc://{where}/replay", [b"t"], queue_bytes=1000,
        replay_bytes=1 << 20, on_lost=lambda: [lost_marker],
    )  # fmt: skip
    try:
        assert pub.publish([event(0)] * 5)
        assert not pub.publish([event(1)] * 20)  # refused: its removals are lost
        with EventReader(f"ipc://{where}/pub", f"ipc://{where}/replay") as reader:
            pub.start()
            events = reader.until(lambda ev: len(ev) >= 6)
        assert events == [lost_marker] + [event(0)] * 5
    finally:
        pub.stop()


def test_the_translator_forgets_everything_when_items_were_lost():
    translator = Translator(1 << 20)
    translator.describe("p", [b"a"], [wire(1)])
    assert stores(translator.observe("p", BlockEvent((b"a",), Medium.CPU, False)), "CPU") == [1]
    assert translator.clear() == [{"type": "AllBlocksCleared"}]
    assert len(translator.table) == 0
    # a removal the router no longer holds is not published; a new store is
    assert translator.observe("p", BlockEvent((b"a",), Medium.CPU, True)) == []
    translator.describe("p", [b"a"], [wire(1)])
    assert stores(translator.observe("p", BlockEvent((b"a",), Medium.CPU, False)), "CPU") == [1]


def test_a_re_announce_puts_parents_before_their_children():
    """llm-d drops a store whose parent it cannot place: the seed of a reopened pool
    (saved in least-recently-stored order) is announced root first."""

    def raw(block: int, parent: int | None) -> bytes:
        described = pb2.BlockDescription(block_hashes=[block], token_ids=[block], block_size=1)
        if parent is not None:
            described.parent_block_hash = parent
        return described.SerializeToString()

    held = [("primary", int(Medium.CPU))]
    kept = [(b"c", raw(3, 2), held), (b"b", raw(2, 1), held), (b"a", raw(1, None), held),
            (b"z", raw(9, 8), held)]  # fmt: skip
    events = Translator(1 << 20).seed("p", kept)
    assert [e["block_hashes"][0] for e in events] == [1, 9, 2, 3]  # z: its parent is not kept


def test_a_key_described_after_it_was_stored_is_announced_where_it_is():
    """A block another node stored in a shared tier, promoted here: the engine that
    loads it describes it afterwards (CompleteStore of a ready key)."""
    translator = Translator(1 << 20)
    promoted = translator.observe("p", BlockEvent((b"a",), Medium.CPU, removed=False))
    assert promoted == [] and translator.undescribed_stores == 1
    assert translator.observe("p", BlockEvent((b"a",), Medium.REMOTE, False, tier="r")) == []
    events = translator.describe("p", [b"a"], [wire(7)])
    assert sorted((e["type"], e["medium"]) for e in events) == [
        ("BlockStored", "CPU"), ("BlockStored", "STORAGE"),
    ]  # fmt: skip
    # a key that left before its description came is not announced
    translator.observe("p", BlockEvent((b"b",), Medium.CPU, removed=False))
    translator.observe("p", BlockEvent((b"b",), Medium.CPU, removed=True))
    assert translator.describe("p", [b"b"], [wire(8)]) == []
