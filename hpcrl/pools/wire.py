"""What a rollout pool and the controller share: the control channel, the files of RUN_DIR/pools/, the
fingerprint (hpcrl.pools has the map).

Frames are a 4-byte big-endian length and a UTF-8 JSON object with a "type": nothing a peer sends is
unpickled, and a frame longer than MAX_FRAME_BYTES ends the connection.

    pool -> controller   hello {token, pool, index, host, pid, fingerprint}   ready {engine_s}
                         loaded {version, stats}   completions {seq, items}   heartbeat
    controller -> pool   welcome {member}  refused {reason}  weights {store, key, version, timeout_s}
                         generate {seq, requests, sampling}   heartbeat   stop {reason}
"""

from __future__ import annotations

import json
import os
import secrets
import select
import socket
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

MAX_FRAME_BYTES = 256 << 20
POOLS_DIR = "pools"
CONTROLLER_FILE = "controller.json"
TOKEN_FILE = "token"
STATE_FILE = "state.json"
# the config keys a pool worker's engine must share with the run's (besides the model's architecture)
FINGERPRINT_KEYS = ("model.dtype", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                    "rollout.max_new_tokens", "rollout.n", "rollout.segment_tokens", "data.max_prompt_length",
                    "trainer.seed")


class Channel:
    """One TCP connection carrying JSON frames; `send` from any thread, `poll` never blocks."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        self.sock = sock
        sock.settimeout(timeout_s)  # sends (and `recv`) wait at most this long
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._frames: deque[dict[str, Any]] = deque()
        self._send_lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(len(data).to_bytes(4, "big") + data)

    def _parse(self) -> None:
        while len(self._buf) >= 4:
            size = int.from_bytes(self._buf[:4], "big")
            if size > MAX_FRAME_BYTES:
                raise ConnectionError(f"a frame of {size} bytes (the most is {MAX_FRAME_BYTES})")
            if len(self._buf) < 4 + size:
                return
            msg = json.loads(bytes(self._buf[4:4 + size]))
            del self._buf[:4 + size]
            if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
                raise ConnectionError("a frame that is not a typed message")
            self._frames.append(msg)

    def _read(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        self._buf += chunk
        self._parse()

    def poll(self) -> list[dict[str, Any]]:
        """The messages that have arrived; ConnectionError once the peer is gone."""
        while select.select([self.sock], [], [], 0)[0]:
            self._read()
        out = list(self._frames)
        self._frames.clear()
        return out

    def recv(self, timeout_s: float | None) -> dict[str, Any]:
        """The next message, waiting at most timeout_s (None: forever); TimeoutError, ConnectionError."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._frames:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"no message in {timeout_s} s")
            if select.select([self.sock], [], [], min(left, 5.0) if left is not None else 5.0)[0]:
                self._read()
        return self._frames.popleft()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def pools_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / POOLS_DIR


def _write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_controller_files(run_dir: str | Path, info: dict[str, Any]) -> str:
    """controller.json (where the controller listens) and a new token (0600); returns the token."""
    d = pools_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    _write_atomic(d / TOKEN_FILE, token + "\n", 0o600)
    _write_atomic(d / CONTROLLER_FILE, json.dumps(info, indent=1) + "\n")
    return token


def remove_controller_files(run_dir: str | Path) -> None:
    for name in (CONTROLLER_FILE, TOKEN_FILE):
        try:
            (pools_dir(run_dir) / name).unlink()
        except FileNotFoundError:
            pass


def write_state(run_dir: str | Path, state: dict[str, Any]) -> None:
    _write_atomic(pools_dir(run_dir) / STATE_FILE, json.dumps(state, indent=1) + "\n")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NotJoinable(Exception):
    """The run cannot take a pool now: the message says why and what to do (exit 2)."""


def find_controller(run_dir: str | Path) -> dict[str, Any]:
    """The running controller's controller.json with its token, or NotJoinable saying why not."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NotJoinable(f"{run_dir} is not a directory (give the run's trainer.run_dir)")
    info = read_json(pools_dir(run_dir) / CONTROLLER_FILE)
    if info is None:
        raise NotJoinable(f"no run is taking rollout pools in {run_dir} ({POOLS_DIR}/{CONTROLLER_FILE} is absent): "
                          "start the run first; pools join runs with trainer.placement=split and "
                          "rollout.mode=fully_async while they run")
    if info.get("host") == socket.gethostname() and not pid_alive(int(info.get("pid", 0))):
        raise NotJoinable(f"the run in {run_dir} is not running (its controller, pid {info.get('pid')} on "
                          f"{info.get('host')}, has ended): resume it first")
    try:
        info["token"] = (pools_dir(run_dir) / TOKEN_FILE).read_text().strip()
    except OSError as e:
        raise NotJoinable(f"cannot read the run's token {pools_dir(run_dir) / TOKEN_FILE}: {e}") from None
    return info


def connect(info: dict[str, Any], timeout_s: float) -> socket.socket:
    """A connection to the controller of controller.json (its own host's loopback when it is this host)."""
    host = info.get("addr") or ("127.0.0.1" if info["host"] == socket.gethostname() else info["host"])
    try:
        return socket.create_connection((host, int(info["port"])), timeout=timeout_s)
    except OSError as e:
        raise NotJoinable(f"the run's controller at {host}:{info['port']} does not answer ({e}): the run has "
                          "ended or is being requeued; resume it, then join") from None


def _select(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return list(node) if isinstance(node, (list, tuple)) or type(node).__name__ == "ListConfig" else node


def fingerprint(cfg: Any) -> dict[str, Any]:
    """What a pool worker's engine must share with the run's: the model's architecture and tokenizer
    files, and the keys that decide what a segment samples (FINGERPRINT_KEYS)."""
    import hashlib

    from hpcrl.checkpoint.compat import architecture

    path = Path(str(_select(cfg, "model.path")))
    tokenizer = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
        if (path / name).is_file():
            tokenizer.update(name.encode() + (path / name).read_bytes())
    return {"architecture": architecture(path), "tokenizer": tokenizer.hexdigest()[:16],
            **{k: _select(cfg, k) for k in FINGERPRINT_KEYS}}


def fingerprint_differences(run: dict[str, Any], pool: dict[str, Any]) -> list[str]:
    """`key: run X, pool Y` for every fingerprint entry that differs."""
    return [f"{k}: run {run.get(k)!r}, pool {pool.get(k)!r}" for k in sorted(set(run) | set(pool))
            if run.get(k) != pool.get(k)]
