"""The NCCL binding as far as a CPU allows: the library, its version, unique ids, error mapping,
communicator creation failing cleanly without a GPU, and the communicator cache policy."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pdserve.kvtransfer.nccl import CommRegistry, NcclError, NcclLibrary, decode_version, find_library
from pdserve.kvtransfer.states import FailureCause, TransferError

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
        from pdserve.kvtransfer.nccl import NcclLibrary, NcclError
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


def test_comm_registry_caps_live_communicators_and_aborts_on_close() -> None:
    created: list[int] = []
    aborted: list[int] = []
    handles = iter(range(100, 200))

    def create(rank: int, uid: bytes) -> int:
        created.append(rank)
        return next(handles)

    reg = CommRegistry(2, create, aborted.append)
    a = reg.open("conn-a", 0, b"u")
    assert reg.open("conn-a", 0, b"u") == a and created == [0]  # one per connection
    b = reg.open("conn-b", 1, b"u")
    with pytest.raises(TransferError, match="already live"):
        reg.open("conn-c", 0, b"u")  # at the cap: refuse, never abort one in use
    assert aborted == []
    reg.close("conn-a")
    assert aborted == [a] and len(reg) == 1
    reg.open("conn-c", 0, b"u")
    reg.close_all()
    assert sorted(aborted) == sorted([a, b, 102]) and len(reg) == 0

    def failing(rank: int, uid: bytes) -> int:
        raise TransferError(FailureCause.TIMEOUT, "init timed out")

    reg2 = CommRegistry(1, failing, aborted.append)
    with pytest.raises(TransferError):
        reg2.open("x", 0, b"u")
    assert len(reg2) == 0  # the reserved slot is given back
    with pytest.raises(ValueError):
        CommRegistry(0, create, aborted.append)
