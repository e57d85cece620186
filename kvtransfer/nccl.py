"""NCCL from Python through ctypes: the library, its calls, and the communicators (the ``nccl``
data path that uses them is ``ncclpath``).

The library is the ``libnccl.so.2`` inside the installed ``nvidia-nccl-cu12`` wheel
(``PDSERVE_NCCL_LIB`` overrides the path). Without a GPU, loading, ``ncclGetVersion`` and
``ncclGetUniqueId`` work and communicator creation fails with a CUDA error, which is as far as
CPU tests go; ``benchmarks/gpu_kvtransfer.py`` covers real transfers.

Communicators: one 2-rank communicator per live connection between a prefill GPU and a decode
GPU, created lazily when the first transfer connects, the unique id carried in the
authenticated ``hello``; non-blocking init polled with ``ncclCommGetAsyncError`` under a
deadline and aborted (never destroyed from a destructor) on error, timeout or disconnect; at
most ``max_comms`` live at once (each costs tens of MB of GPU memory), further connections
refused rather than aborting one in use.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdserve.kvtransfer.states import FailureCause, TransferError

NCCL_UNIQUE_ID_BYTES = 128
RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}
NCCL_IN_PROGRESS = 7
NCCL_UINT8 = 1
_CONFIG_MAGIC = 0xCAFEBEEF
_UNDEF_INT = -(2**31)


class NcclError(TransferError):
    def __init__(self, code: int, call: str, detail: str = "") -> None:
        name = RESULTS.get(code, f"ncclResult {code}")
        cause = FailureCause.PEER_LOST if code == 6 else FailureCause.PROTOCOL
        super().__init__(cause, f"{call} failed: {name}{': ' + detail if detail else ''}")
        self.code = code
        self.name = name


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


class NcclConfig(ctypes.Structure):
    """The leading fields of ``ncclConfig_t``; ``size`` tells NCCL how many we pass."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
    ]


def find_library() -> Path:
    """``PDSERVE_NCCL_LIB``, else ``nvidia/nccl/lib/libnccl.so.2`` from the installed wheel."""
    override = os.environ.get("PDSERVE_NCCL_LIB")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"PDSERVE_NCCL_LIB={override} does not exist")
        return path
    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("nvidia-nccl-cu12 is not installed (pip install nvidia-nccl-cu12)")
    seen: set[str] = set()
    for loc in spec.submodule_search_locations:  # namespace packages may list a path twice
        real = os.path.realpath(loc)
        if real in seen:
            continue
        seen.add(real)
        candidate = Path(real) / "lib" / "libnccl.so.2"
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"libnccl.so.2 not found under {sorted(seen)}")


def decode_version(code: int) -> tuple[int, int, int]:
    if code >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return code // 10000, (code // 100) % 100, code % 100
    return code // 1000, (code // 100) % 10, code % 100


class NcclLibrary:
    """Typed wrappers; every call checks its ``ncclResult_t``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or find_library()
        self.lib = ctypes.CDLL(str(self.path))
        L = self.lib
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        for name, args in {
            "ncclGetVersion": [ctypes.POINTER(i32)],
            "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
            "ncclCommInitRankConfig": [ctypes.POINTER(vp), i32, UniqueId, i32, ctypes.POINTER(NcclConfig)],
            "ncclCommGetAsyncError": [vp, ctypes.POINTER(i32)],
            "ncclCommAbort": [vp],
            "ncclCommDestroy": [vp],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
            "ncclSend": [vp, sz, i32, i32, vp, vp],
            "ncclRecv": [vp, sz, i32, i32, vp, vp],
        }.items():
            fn = getattr(L, name)
            fn.argtypes = args
            fn.restype = i32
        L.ncclGetErrorString.argtypes = [i32]
        L.ncclGetErrorString.restype = ctypes.c_char_p
        self.version = self.get_version()

    def check(self, code: int, call: str) -> int:
        if code not in (0, NCCL_IN_PROGRESS):
            detail = self.lib.ncclGetErrorString(code)
            raise NcclError(code, call, detail.decode() if detail else "")
        return code

    def get_version(self) -> int:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(bytearray(uid.internal))

    def init_rank(self, nranks: int, uid: bytes, rank: int, blocking: bool = False) -> int:
        """Start creating a communicator; returns its handle (poll ``async_error`` until 0)."""
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        u = UniqueId()
        ctypes.memmove(u.internal, uid, NCCL_UNIQUE_ID_BYTES)
        cfg = NcclConfig(
            size=ctypes.sizeof(NcclConfig),
            magic=_CONFIG_MAGIC,
            version=self.version,
            blocking=1 if blocking else 0,
            cgaClusterSize=_UNDEF_INT,
            minCTAs=_UNDEF_INT,
            maxCTAs=_UNDEF_INT,
            netName=None,
            splitShare=_UNDEF_INT,
        )
        comm = ctypes.c_void_p()
        self.check(
            self.lib.ncclCommInitRankConfig(ctypes.byref(comm), nranks, u, rank, ctypes.byref(cfg)),
            "ncclCommInitRankConfig",
        )
        return comm.value or 0

    def async_error(self, comm: int) -> int:
        r = ctypes.c_int()
        self.check(
            self.lib.ncclCommGetAsyncError(ctypes.c_void_p(comm), ctypes.byref(r)), "ncclCommGetAsyncError"
        )
        return r.value

    def abort(self, comm: int) -> None:
        self.lib.ncclCommAbort(ctypes.c_void_p(comm))

    def group(self, calls: Callable[[], None]) -> None:
        self.check(self.lib.ncclGroupStart(), "ncclGroupStart")
        try:
            calls()
        finally:
            self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd")

    def send(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self.check(
            self.lib.ncclSend(
                ctypes.c_void_p(ptr), nbytes, NCCL_UINT8, peer, ctypes.c_void_p(comm), ctypes.c_void_p(stream)
            ),
            "ncclSend",
        )

    def recv(self, ptr: int, nbytes: int, peer: int, comm: int, stream: int) -> None:
        self.check(
            self.lib.ncclRecv(
                ctypes.c_void_p(ptr), nbytes, NCCL_UINT8, peer, ctypes.c_void_p(comm), ctypes.c_void_p(stream)
            ),
            "ncclRecv",
        )


def wait_ready(lib: NcclLibrary, comm: int, deadline: float, poll_s: float = 0.001) -> None:
    """Poll a non-blocking communicator until it is ready; abort it on error or deadline."""
    while True:
        try:
            state = lib.async_error(comm)
        except NcclError:
            lib.abort(comm)
            raise
        if state == 0:
            return
        if state != NCCL_IN_PROGRESS:
            lib.abort(comm)
            lib.check(state, "ncclCommInitRankConfig (async)")
        if time.monotonic() > deadline:
            lib.abort(comm)
            raise TransferError(FailureCause.TIMEOUT, "NCCL communicator not ready before the deadline")
        time.sleep(poll_s)


class CommRegistry:
    """One communicator per live connection, at most ``max_comms`` at once.

    A communicator is created when its connection is set up (``open``) and aborted when the
    connection goes (``close``) — never ``ncclCommDestroy``, which can hang on a dead peer. At
    the cap, new connections are refused rather than aborting a communicator still in use.
    Pure bookkeeping around the ``create``/``destroy`` callables, so it is tested without a GPU.
    """

    def __init__(
        self, max_comms: int, create: Callable[[int, bytes], int], destroy: Callable[[int], None]
    ) -> None:
        if max_comms < 1:
            raise ValueError("max_comms must be >= 1")
        self.max_comms = max_comms
        self._create = create
        self._destroy = destroy
        self._comms: dict[object, int] = {}
        self._lock = threading.Lock()

    def open(self, key: object, rank: int, uid: bytes) -> int:
        with self._lock:
            if key in self._comms:
                return self._comms[key]
            if len(self._comms) >= self.max_comms:
                raise TransferError(
                    FailureCause.REJECTED, f"{self.max_comms} NCCL communicators already live"
                )
            self._comms[key] = 0  # reserve the slot while the (slow) creation runs
        try:
            handle = self._create(rank, uid)
        except BaseException:
            with self._lock:
                self._comms.pop(key, None)
            raise
        with self._lock:
            self._comms[key] = handle
        return handle

    def close(self, key: object) -> None:
        with self._lock:
            handle = self._comms.pop(key, None)
        if handle:
            self._destroy(handle)

    def __len__(self) -> int:
        return len(self._comms)

    def close_all(self) -> None:
        with self._lock:
            handles, self._comms = list(self._comms.values()), {}
        for h in handles:
            if h:
                self._destroy(h)
