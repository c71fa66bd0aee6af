"""A process that has already imported what a node imports, and forks node processes from it on request.

A node's start-up is mostly imports (torch, transformers' model code, grpc): about 4 CPU-seconds each on a
small machine, paid again by every node a test, a benchmark or the demo starts. This process pays them once;
each node it forks is then a real, separate ``fabric-node`` process running ``adapter_fabric.node.main`` from its
start, as ``python -m`` would, in the caller's directory, environment, arguments, stdout and stderr.

It runs only what its harness asks (``adapter_fabric.harness.node_forks``), over a socket pair no other process
holds. The fork is done twice, so the node's parent becomes the harness (a child subreaper): the harness waits
for its nodes and reads their exit codes as it would a subprocess's. Nothing here runs torch code before a fork
(forking after imports is what torch's data loaders do; a thread pool already used would not survive one).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import gc
import importlib
import json
import os
import runpy
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

NODE_MODULE = "adapter_fabric.node.main"
# What a tiny-model node imports before it serves; a node running another model imports the rest itself.
PRELOADED = (
    "torch",
    "grpc",
    "transformers.models.llama.modeling_llama",
    "adapter_fabric.node.server",
    "adapter_fabric.serving.multi_lora",
    "adapter_fabric.node.settings",  # what the node's main imports; the main itself runs fresh (runpy)
    "adapter_fabric.observability.logs",
)
MAX_REQUEST_BYTES = 1 << 20  # argv and environment of one node; a larger request is refused, not truncated
FDS_PER_REQUEST = 2  # the node's stdout and stderr
_PR_SET_NAME = 15


@dataclass(frozen=True)
class Launch:
    """What one node runs with: its arguments, environment and working directory (fds are its stdout, stderr)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    @classmethod
    def from_json(cls, data: bytes) -> Launch:
        fields = json.loads(data)
        argv, env, cwd = fields["argv"], fields["env"], fields["cwd"]
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a list of strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("env must map strings to strings")
        if not isinstance(cwd, str):
            raise ValueError("cwd must be a string")
        return cls(argv=argv, env=env, cwd=cwd)

    def to_json(self) -> bytes:
        return json.dumps({"argv": self.argv, "env": self.env, "cwd": self.cwd}).encode()


def serve(control: socket.socket) -> tuple[Launch, list[int]] | None:
    """Answer each request with a node's pid (or an error); returns only in a forked node, with what it runs."""
    while True:
        try:
            data, ancillary, flags, _addr = control.recvmsg(MAX_REQUEST_BYTES, socket.CMSG_SPACE(FDS_PER_REQUEST * 4))
        except ConnectionError:
            return None
        if not data:
            return None  # the harness is gone: so is this process (its nodes are not its children)
        fds = _received_fds(ancillary)
        try:
            if flags & socket.MSG_TRUNC:
                raise ValueError(f"a request is at most {MAX_REQUEST_BYTES} bytes of argv and environment")
            if len(fds) != FDS_PER_REQUEST:
                raise ValueError(f"a request carries {FDS_PER_REQUEST} descriptors, not {len(fds)}")
            launch = Launch.from_json(data)
            pid = _fork_detached()
        except Exception as exc:  # a bad request or a failed fork is answered, never fatal to this process
            for fd in fds:
                os.close(fd)
            if not _answer(control, {"error": f"{type(exc).__name__}: {exc}"}):
                return None
            continue
        if pid == 0:  # the node
            control.close()
            return launch, fds
        for fd in fds:
            os.close(fd)
        if not _answer(control, {"pid": pid}):
            return None


def _answer(control: socket.socket, reply: dict[str, object]) -> bool:
    try:
        control.sendall(json.dumps(reply).encode())
    except OSError:
        return False  # the harness is gone
    return True


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return list(fds)


def _fork_detached() -> int:
    """Fork twice: in the node 0, here the node's pid, once its first parent has exited (it is then the harness's)."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        try:
            node = os.fork()
        except BaseException:
            os._exit(1)
        if node == 0:
            os.close(write_end)
            return 0
        os.write(write_end, struct.pack("=q", node))
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reply:
        packed = reply.read(8)
    os.waitpid(middle, 0)  # the node is reparented to the harness before this returns
    if len(packed) != 8:
        raise OSError("the node's first fork failed")
    return struct.unpack("=q", packed)[0]


def become_node(launch: Launch, fds: list[int]) -> NoReturn:
    """Turn this forked process into ``python -m adapter_fabric.node.main ARGS`` with the caller's files and environment."""
    stdout, stderr = fds
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in fds:
        os.close(fd)
    prctl(_PR_SET_NAME, b"fabric-node")  # what ps and top show (its command line stays the server's); cosmetic
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it (the server ignores it)
    gc.enable()
    os.chdir(launch.cwd)
    sys.path[0] = launch.cwd  # ``python -m`` puts the working directory first (the server's was where it started)
    os.environ.clear()
    os.environ.update(launch.env)
    sys.argv = [NODE_MODULE, *launch.argv]
    try:
        runpy.run_module(NODE_MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit_code(code: object) -> int:
    """``sys.exit``'s argument as the interpreter reads it: None is 0, a number itself, anything else printed and 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> NoReturn:
    """End as the interpreter would (its threads joined, its exit hooks run, output flushed), then skip finalizing
    the modules: tearing down the server's imports (torch, transformers) took a node 1.6 s of CPU at each exit."""
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter calls first at exit: joins non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # ended by a signal, as an interrupted interpreter is: the parent sees the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def prctl(option: int, argument: int | bytes) -> bool:
    """Linux's prctl(2) with one argument; False where it failed or there is none (not Linux)."""
    try:
        value = ctypes.c_char_p(argument) if isinstance(argument, bytes) else argument
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the harness and its nodes; this ends at EOF
    control = socket.socket(fileno=int(sys.argv[1]))
    gc.disable()  # no collection may leave holes in pages the nodes share; frozen below, so theirs skip these objects
    for module in PRELOADED:
        importlib.import_module(module)
    gc.freeze()
    forked = serve(control) if _answer(control, {"ready": True}) else None
    if forked is not None:
        become_node(*forked)
    os._exit(0)  # the harness is gone; finalizing the imports would only cost time (and print native libraries' leak reports)


if __name__ == "__main__":
    main()
