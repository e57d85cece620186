"""The NCCL binding as far as a CPU allows: the library, its version, unique ids, error mapping,
communicator creation failing cleanly without a GPU, and the communicator cache policy."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvtransfer.nccl import CommCache, NcclError, NcclLibrary, decode_version, find_library

pytest.importorskip("nvidia.nccl", reason="nvidia-nccl-cu12 is installed on Linux x86_64 only")


@pytest.fixture(scope="module")
def lib() -> NcclLibrary:
    return NcclLibrary()


def test_library_is_found_inside_the_wheel(lib: NcclLibrary) -> None:
    path = find_library()
    assert path.name == "libnccl.so.2" and "nvidia" in str(path)
    assert lib.path == path


def test_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setenv("PDSERVE_NCCL_LIB", "/nonexistent/libnccl.so.2")
    with pytest.raises(FileNotFoundError, match="PDSERVE_NCCL_LIB"):
        find_library()


def test_version(lib: NcclLibrary) -> None:
    major, minor, _ = decode_version(lib.version)
    assert major == 2 and minor >= 18
    assert decode_version(23203) == (2, 32, 3)
    assert decode_version(2708) == (2, 7, 8)


def test_unique_ids(lib: NcclLibrary) -> None:
    a, b = lib.unique_id(), lib.unique_id()
    assert len(a) == 128 and a != b and any(a)


def test_error_mapping(lib: NcclLibrary) -> None:
    with pytest.raises(NcclError) as e:
        lib.check(4, "ncclSend")
    assert e.value.code == 4 and e.value.name == "ncclInvalidArgument" and "ncclSend" in str(e.value)
    assert lib.check(0, "x") == 0 and lib.check(7, "x") == 7  # success and in-progress pass
    with pytest.raises(NcclError, match="ncclRemoteError"):
        lib.check(6, "ncclRecv")
    with pytest.raises(ValueError, match="128 bytes"):
        lib.init_rank(2, b"short", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU failure path")
def test_communicator_creation_fails_cleanly_without_a_gpu() -> None:
    # In a child with a time limit: whatever NCCL does without a GPU must not hang the suite.
    code = textwrap.dedent(
        """
        from kvtransfer.nccl import NcclLibrary, NcclError
        lib = NcclLibrary()
        try:
            comm = lib.init_rank(2, lib.unique_id(), 0, blocking=False)
            state = lib.async_error(comm)
            print("STATE", state)
        except NcclError as e:
            print("ERROR", e.name)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERROR ncclUnhandledCudaError" in out.stdout or "ERROR ncclSystemError" in out.stdout, (
        out.stdout + out.stderr
    )


def test_comm_cache_is_lazy_capped_and_aborts_lru() -> None:
    created: list[tuple[str, int]] = []
    aborted: list[int] = []
    handles = iter(range(100, 200))

    def create(peer: str, rank: int, uid: bytes) -> int:
        created.append((peer, rank))
        return next(handles)

    cache = CommCache(2, create, aborted.append)
    a = cache.get(0, "p1", 0, b"u")
    assert cache.get(0, "p1", 0, b"u") == a and len(created) == 1  # reused
    b = cache.get(0, "p2", 0, b"u")
    cache.get(0, "p1", 0, b"u")  # p1 is now the most recent
    cache.get(0, "p3", 1, b"u")  # over the cap: p2 (least recent) is aborted
    assert aborted == [b] and len(cache) == 2
    cache.drop(0, "p1")
    assert aborted == [b, a]
    cache.close()
    assert len(aborted) == 3 and len(cache) == 0
    with pytest.raises(ValueError):
        CommCache(0, create, aborted.append)
