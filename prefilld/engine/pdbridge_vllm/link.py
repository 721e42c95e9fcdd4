"""Where a stage's frames go: prefilld's unix socket on its own box, or, from another box of
prefilld's ``[engine.nodes]``, its stage listener over mutual TLS.

``prefilld node`` sets the environment of the vLLM workers it starts on another box
(`RemoteLink.ENV`): prefilld's stage address and the identity its certificate holds, this box's
certificate, key and CA, and where fetched bundles are kept. Without ``PDBRIDGE_STAGE_LINK`` the
plugin is on prefilld's box and uses the request's socket. On another box the request's bundle
path is prefilld's, not this box's: the bundle is fetched from prefilld by its SHA-256 on first use
(one connection, a `BundleRequest` frame, a `BundleReply` and the bytes), checked, and kept.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pdbridge_cache.proto import engine_pb2

from . import protocol


class LinkError(Exception):
    """The link to prefilld is misconfigured, or a bundle could not be fetched."""


@dataclass(frozen=True)
class RemoteLink:
    host: str
    port: int
    server_name: str
    context: ssl.SSLContext
    bundle_dir: Path

    ENV = ("PDBRIDGE_STAGE_LINK", "PDBRIDGE_STAGE_SERVER", "PDBRIDGE_TLS_CERT", "PDBRIDGE_TLS_KEY",
           "PDBRIDGE_TLS_CA", "PDBRIDGE_BUNDLE_DIR")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RemoteLink | None:
        """The link `env` describes; None on prefilld's own box. Raises `LinkError` naming what is
        missing or unreadable, so a misconfigured box fails at vLLM's start, not per request."""
        if not env.get("PDBRIDGE_STAGE_LINK"):
            return None
        missing = [key for key in cls.ENV if not env.get(key)]
        if missing:
            raise LinkError(f"PDBRIDGE_STAGE_LINK is set but {', '.join(missing)} not")
        host, _, port = env["PDBRIDGE_STAGE_LINK"].rpartition(":")
        if not host or not port.isdigit():
            raise LinkError(f"PDBRIDGE_STAGE_LINK={env['PDBRIDGE_STAGE_LINK']!r} is not host:port")
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=env["PDBRIDGE_TLS_CA"])
            context.load_cert_chain(env["PDBRIDGE_TLS_CERT"], env["PDBRIDGE_TLS_KEY"])
        except (OSError, ssl.SSLError) as e:
            raise LinkError(f"the stage link's TLS files: {e}") from None
        return cls(host=host.strip("[]"), port=int(port), server_name=env["PDBRIDGE_STAGE_SERVER"],
                   context=context, bundle_dir=Path(env["PDBRIDGE_BUNDLE_DIR"]))

    def connect(self, timeout_s: float) -> ssl.SSLSocket:
        """A new connection to prefilld's stage listener, its certificate checked for `server_name`."""
        raw = socket.create_connection((self.host, self.port), timeout=timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            return self.context.wrap_socket(raw, server_hostname=self.server_name)
        except BaseException:
            raw.close()
            raise

    def bundle(self, sha256: str, timeout_s: float) -> Path:
        """This box's copy of the bundle of `sha256`, fetched from prefilld if it has none yet; only
        a copy whose bytes hash to `sha256` is kept."""
        path = self.bundle_dir / f"{sha256}.safetensors"
        if path.is_file():
            return path
        self.bundle_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        try:
            with self.connect(timeout_s) as sock, sock.makefile("rb") as stream:
                request = engine_pb2.PluginFrame(bundle=engine_pb2.BundleRequest(sha256=sha256))
                protocol.send_frame(sock, request)
                reply = protocol.read_header(stream, engine_pb2.BundleReply)
                if reply is None or reply.error:
                    raise LinkError(f"prefilld refused bundle {sha256}: {reply.error if reply else 'no reply'}")
                digest = _copy(stream, reply.size, partial)
                # prefilld's TLS goodbye: read, so this side closes with nothing unread (which
                # would reset the connection under prefilld's last write).
                if stream.read(1):
                    raise LinkError(f"prefilld sent more than bundle {sha256}'s {reply.size} bytes")
            if digest != sha256:
                raise LinkError(f"bundle {sha256} arrived with SHA-256 {digest}")
            os.replace(partial, path)
            return path
        except (OSError, EOFError) as e:
            raise LinkError(f"fetching bundle {sha256} from {self.host}:{self.port}: {e}") from None
        finally:
            partial.unlink(missing_ok=True)


def _copy(stream, size: int, path: Path) -> str:
    """Writes `size` bytes of `stream` to `path`; their SHA-256."""
    digest = hashlib.sha256()
    left = size
    with open(path, "wb") as out:
        while left:
            chunk = stream.read(min(left, 1 << 20))
            if not chunk:
                raise EOFError(f"the bundle ended after {size - left} of {size} bytes")
            digest.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return digest.hexdigest()
