"""Real servers standing in for origins in tests and benchmarks: nginx (HTTP with ETags; a rate-limited path for a
slow drip), moto's S3 server (its own process, the S3 REST protocol), and a Hub endpoint serving model repos the way
the Hugging Face Hub's API does (its model revision route and file resolves; the public Hub is not reachable here).

Each is a context manager yielding its base URL; a missing program raises ``ServerMissing`` naming what to install
(tests turn it into a skip: tests/support/origin_servers.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from adapter_fabric.harness.cluster import free_port


class ServerMissing(RuntimeError):
    """A server's program is not installed here (the message says how to install it)."""


NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
#: bytes/s nginx sends under /slow/ (a drip: a 15 KB adapter takes ~15 s)
DRIP_RATE = "1k"

_NGINX_CONF = """
{user}
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
daemon off;
events {{ worker_connections 64; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        etag on;
        location /slow/ {{ limit_rate {drip}; limit_rate_after 0; alias {root}/; }}
        location /moved/ {{ return 302 /moved/; }}
    }}
}}
"""


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    import socket

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def nginx(root: Path, tmp: Path) -> Iterator[str]:
    """nginx serving ``root`` (ETags on) at the yielded ``http://127.0.0.1:PORT``; ``/slow/`` is ``root`` at DRIP_RATE."""
    if NGINX is None:
        raise ServerMissing("nginx is not installed (scripts/bootstrap.sh installs it as root with apt-get; apt-get install nginx-light)")
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = tmp / "nginx.conf"
    # As root, nginx's workers would run as nobody and could not read a test's private temp directory.
    user = "user root;" if os.geteuid() == 0 else ""
    conf.write_text(_NGINX_CONF.format(user=user, tmp=tmp, port=port, root=root, drip=DRIP_RATE))
    proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_port(port, proc, "nginx")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


#: what moto's server and the boto3 clients in the tests and nodes use
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def moto_s3() -> Iterator[str]:
    """moto's S3-compatible server (its own process, the S3 REST protocol) at the yielded endpoint URL."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        raise ServerMissing("moto[server] is not installed (pip install -e '.[test]')") from None
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc, "moto server")
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def s3_client(endpoint: str):
    import boto3

    return boto3.session.Session(**{k.lower(): v for k, v in S3_ENV.items() if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1").client(
        "s3", endpoint_url=endpoint
    )


def put_adapter_s3(client, bucket: str, key_prefix: str, adapter_dir: Path) -> None:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        client.put_object(Bucket=bucket, Key=f"{key_prefix}/{name}", Body=(adapter_dir / name).read_bytes())


# ---------------------------------------------------------------- a Hub endpoint


class HubRepos:
    """Model repos as the Hub keeps them: each publish is a commit; ``main`` names the latest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fetches: list[str] = []  # every file download path served (tests count origin traffic)

    def publish(self, repo: str, adapter_dir: Path) -> str:
        """Commit ``adapter_dir``'s files to ``repo``; the commit's sha."""
        digest = hashlib.sha1()
        for name in sorted(os.listdir(adapter_dir)):
            digest.update(name.encode() + b"\0" + (adapter_dir / name).read_bytes())
        sha = digest.hexdigest()
        dest = self.root / repo / sha
        if not dest.exists():
            shutil.copytree(adapter_dir, dest)
        (self.root / repo / "main").write_text(sha)
        return sha

    def commit(self, repo: str, revision: str) -> str | None:
        folder = self.root / repo
        if revision == "main":
            ref = folder / "main"
            return ref.read_text() if ref.is_file() else None
        return revision if (folder / revision).is_dir() and len(revision) == 40 else None


def _hub_handler(repos: HubRepos, token: str | None):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                return self._send(401, b'{"error": "Invalid credentials"}', {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
            path = unquote(urlsplit(self.path).path)
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "revision":
                repo, revision = "/".join(parts[2:4]), parts[5]
                if not (repos.root / repo).is_dir():
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})
                sha = repos.commit(repo, revision)
                if sha is None:
                    return self._send(404, b'{"error": "Revision not found"}', {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"})
                files = sorted(os.listdir(repos.root / repo / sha))
                siblings = [{"rfilename": n, "size": os.path.getsize(repos.root / repo / sha / n)} for n in files]
                body = json.dumps({"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": siblings, "tags": []}).encode()
                return self._send(200, body, {"Content-Type": "application/json"})
            if len(parts) == 5 and parts[2] == "resolve":
                repo, revision, name = "/".join(parts[:2]), parts[3], parts[4]
                sha = repos.commit(repo, revision)
                file = repos.root / repo / sha / name if sha else None
                if file is None or not file.is_file():
                    return self._send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound"})
                repos.fetches.append(path)
                return self._send(200, file.read_bytes(), {"ETag": f'"{sha}-{name}"', "X-Repo-Commit": str(sha)})
            return self._send(404, b"not found")

    return Handler


@contextmanager
def hub_endpoint(root: Path, token: str | None = None) -> Iterator[tuple[str, HubRepos]]:
    """A Hub-compatible endpoint (the API's model revision route and file resolves) over ``root``; (URL, repos)."""
    repos = HubRepos(root)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _hub_handler(repos, token))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", repos
    finally:
        server.shutdown()
        server.server_close()
