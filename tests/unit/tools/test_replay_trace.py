"""The pure parts of the trace replay benchmark: parsing, assignment, prefix hits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # benchmarks/ is not an installed package
    sys.path.insert(0, str(REPO))

from benchmarks.replay import (  # noqa: E402
    COLUMNS,
    EngineResult,
    ModeResult,
    Request,
    RunSpec,
    _merge,
    assign,
    block_key,
    default_capacity,
    distinct_blocks,
    engine_of,
    leading_hits,
    main,
    parse_trace,
    request_keys,
    table_rows,
    unbounded_hit_rate,
)

TRACE = [
    {"timestamp": 0, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 10, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1, 3]},
    {"timestamp": 20, "input_length": 512, "output_length": 1, "hash_ids": [4]},
    {"timestamp": 30, "input_length": 2048, "output_length": 2, "hash_ids": [0, 1, 2, 5]},
    {"timestamp": 40, "input_length": 1024, "output_length": 9, "hash_ids": [4, 6]},
]


def _lines() -> list[str]:
    return [json.dumps(record) + "\n" for record in TRACE]


def test_parse_keeps_order_fields_and_skips_blank_lines() -> None:
    lines = _lines()
    lines.insert(2, "\n")
    requests = parse_trace(lines)
    assert [r.index for r in requests] == [0, 1, 2, 3, 4]
    assert requests[1] == Request(1, 10.0, 1024, 3, (0, 1, 3))
    assert [r.hash_ids for r in requests] == [tuple(t["hash_ids"]) for t in TRACE]


def test_parse_limit_keeps_the_first_requests() -> None:
    assert [r.hash_ids for r in parse_trace(_lines(), limit=2)] == [(0, 1, 2), (0, 1, 3)]


@pytest.mark.parametrize(
    "line", ['{"timestamp": 0}', "not json", '{"hash_ids": [-1]}', '{"hash_ids": ["x"]}']
)
def test_parse_rejects_malformed_records_naming_the_line(line: str) -> None:
    with pytest.raises(ValueError, match="trace line 2"):
        parse_trace([_lines()[0], line])


def test_keys_are_8_byte_big_endian_without_duplicates() -> None:
    assert block_key(1) == b"\x00" * 7 + b"\x01"
    assert block_key(2**64 - 1) == b"\xff" * 8
    request = Request(0, 0.0, 0, 0, (7, 8, 7))
    assert request_keys(request) == [block_key(7), block_key(8)]


def test_round_robin_assignment_follows_trace_position() -> None:
    queues = assign(parse_trace(_lines()), 2, "rr")
    assert [[r.index for r in q] for q in queues] == [[0, 2, 4], [1, 3]]


def test_hash_assignment_sends_a_shared_first_block_to_one_engine() -> None:
    requests = parse_trace(_lines())
    for engines in (2, 3, 4, 8):
        by_first = {}
        for request in requests:
            engine = engine_of(request, engines, "hash")
            assert 0 <= engine < engines
            assert by_first.setdefault(request.hash_ids[0], engine) == engine
        queues = assign(requests, engines, "hash")
        assert sorted(r.index for q in queues for r in q) == [0, 1, 2, 3, 4]
        assert all([r.index for r in q] == sorted(r.index for r in q) for q in queues)
    assert engine_of(Request(5, 0.0, 0, 0, ()), 4, "hash") == 1  # no blocks: round-robin
    with pytest.raises(ValueError, match="unknown assignment"):
        engine_of(requests[0], 4, "random")


def test_leading_hits_stop_at_the_first_non_hit() -> None:
    assert leading_hits(["H", "H", "M", "H"], "H") == 2
    assert leading_hits(["M", "H"], "H") == 0
    assert leading_hits([], "H") == 0
    assert leading_hits(["H", "H"], "H") == 2


def test_unbounded_hit_rate_counts_the_reused_prefix_only() -> None:
    requests = parse_trace(_lines())
    # request 1 reuses [0, 1]; 3 reuses [0, 1, 2]; 4 reuses [4]: 6 of 13 blocks
    assert unbounded_hit_rate(requests) == pytest.approx(6 / 13)
    assert distinct_blocks(requests) == 7
    assert unbounded_hit_rate([]) == 0.0


def test_default_capacity_is_a_multiple_of_the_engines() -> None:
    assert default_capacity(43924, 4) == 10980
    assert default_capacity(10, 4) == 4  # at least one block per engine
    assert default_capacity(1000, 3, 0.5) % 3 == 0


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--engines=0", "--engines must be >= 1"),
        ("--flush-after-ms=-1", "--flush-after-ms must be"),
        ("--grpc-too", "--grpc-too needs --batch"),
    ],
)
def test_cli_rejects_bad_numbers_naming_the_flag(tmp_path, capsys, flag, message) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(_lines()))
    with pytest.raises(SystemExit) as exit_info:
        main([str(trace), flag])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_grpc_only_run_has_its_own_label_and_pools() -> None:
    lane = RunSpec("shared", "lru", True, 64, pipelined=True)
    grpc_only = RunSpec("shared", "lru", True, 64, pipelined=True, fast_lane=False)
    assert lane.label == "shared lru pipelined"
    assert grpc_only.label == "shared lru pipelined gRPC"
    # the two runs never see each other's keys: one daemon serves both
    assert lane.pool("t", 0) != grpc_only.pool("t", 0)


def test_daemon_cpu_is_reported_per_engine_step() -> None:
    # engine 0 alone measures the daemon's CPU over the run: the merge keeps it
    parts = [EngineResult(steps=300, daemon_cpu=0.6), EngineResult(steps=200)]
    merged = _merge(parts)
    assert merged.steps == 500
    assert merged.daemon_cpu == pytest.approx(0.6)
    spec = RunSpec("shared", "lru", True, 64, pipelined=True, fast_lane=False)
    result = ModeResult(spec, 2, 64, 4096, merged, {})
    assert result.daemon_cpu_per_step == pytest.approx(0.6 / 500)
    (row,) = table_rows([result])
    assert row[COLUMNS.index("batch")] == "pipelined, gRPC only"
    assert row[COLUMNS.index("daemon CPU/step µs")] == "1200"
