"""The client's public import paths, including the names kept for code written
against an earlier layout: each gives the very objects of the module that defines them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvtierd_client.types
import kvtierd_client.wire.proto
import kvtierd_client.wire.results


def test_the_raw_stubs_old_import_path_gives_the_same_modules_with_a_deprecation_warning():
    """``kvtierd_client.proto`` (the path before the client's layout by layer) is an
    alias of ``kvtierd_client.wire.proto``: same objects, not copies (a message class
    from one passes ``isinstance`` against the other), and a DeprecationWarning that
    names the new path and points at the importing line."""
    with pytest.warns(DeprecationWarning, match=r"kvtierd_client\.wire\.proto") as caught:
        from kvtierd_client.proto import pb2, pb2_grpc
    assert pb2 is kvtierd_client.wire.proto.pb2
    assert pb2_grpc is kvtierd_client.wire.proto.pb2_grpc
    assert pb2.LookupRequest is kvtierd_client.wire.proto.pb2.LookupRequest
    assert [w.filename for w in caught] == [__file__] * 2  # the line that imported them


def test_the_old_path_fails_with_the_new_path_under_warnings_as_errors():
    """Where warnings are errors (``-W error``), the old import fails with a one-line
    message saying where the stubs went, not a ModuleNotFoundError."""
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", "from kvtierd_client.proto import pb2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "DeprecationWarning: kvtierd_client.proto is deprecated: import pb2 and pb2_grpc "
        "from kvtierd_client.wire.proto"
    ), result.stderr


def test_the_public_paths_import_without_a_warning():
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c",
         "import kvtierd_client.wire.proto, kvtierd_client.types"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert kvtierd_client.types.LookupResult is kvtierd_client.wire.results.LookupResult
    assert kvtierd_client.types.StoreResult is kvtierd_client.wire.results.StoreResult
