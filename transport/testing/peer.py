"""A peer program for the conformance kit's cross-process and peer-killed checks.

    python -m transport.testing.peer URL --mode MODE [--options JSON] [--size N] [--count N]

It connects to ``URL`` (a listener in the test process) with ``--options`` (listen/connect
keywords as JSON) and prints ``ready`` on stdout once connected. Modes:

``stream``  send ``{"seq": i, "n": size}`` + ``pattern(i, size)`` messages (``--count``
            of them, then close and exit 0; forever without ``--count``), releasing
            anything received;
``echo``    send every message back (header and buffers) until a ``{"op": "exit"}``
            header or the connection closes; exit 0;
``hold``    receive ``--count`` messages and keep them unreleased (so the sender runs out
            of credits), print ``held N``, then sleep until killed;
``idle``    do nothing until killed.

Exit status: 0 on success, 1 on a transport error (its message on stderr).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import transport
from transport.errors import ConnectionClosed, Timeout, TransportError
from transport.testing.conformance import pattern


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _stream(conn, size: int, count: int | None) -> None:
    seq = 0
    while count is None or seq < count:
        slot = conn.alloc(size)
        if size:
            slot.array("u1", size)[:] = pattern(seq, size)
        conn.send({"seq": seq, "n": size}, [slot])
        seq += 1
        while conn.pending():
            conn.recv(timeout=0).release()


def _echo(conn) -> None:
    while True:
        try:
            msg = conn.recv(timeout=60)
        except ConnectionClosed:
            return
        with msg:
            if isinstance(msg.header, dict) and msg.header.get("op") == "exit":
                return
            slots = []
            for b in msg.buffers:
                s = conn.alloc(b.nbytes)
                s.buf[:] = b
                slots.append(s)
            conn.send(msg.header, slots)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m transport.testing.peer")
    ap.add_argument("url")
    ap.add_argument("--mode", required=True, choices=["stream", "echo", "hold", "idle"])
    ap.add_argument("--options", default="{}", help="listen/connect keywords as JSON")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--count", type=int, default=None)
    args = ap.parse_args(argv)
    options = json.loads(args.options)
    try:
        conn = transport.connect(args.url, **options)
    except TransportError as e:
        print(f"peer: cannot connect to {args.url}: {e!r}", file=sys.stderr)
        return 1
    _say("ready")
    try:
        if args.mode == "stream":
            _stream(conn, args.size, args.count)
        elif args.mode == "echo":
            _echo(conn)
        elif args.mode == "hold":
            held = [conn.recv(timeout=60) for _ in range(args.count or 1)]
            _say(f"held {len(held)}")
            while True:
                time.sleep(1)
        else:
            while True:
                time.sleep(1)
    except (TransportError, Timeout) as e:
        print(f"peer ({args.mode}): {e!r}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
