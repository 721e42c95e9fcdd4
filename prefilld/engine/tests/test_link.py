"""The link of a pipeline stage on another box of prefilld's ``[engine.nodes]``: what its
environment must say, and the bundle fetch's framing and checks, against a peer that speaks
prefilld's side of it (`capture.rs`'s `serve_bundle`) over a socket pair. The TLS itself is
prefilld's and Python's: the engines test `pipeline_stages_on_another_host_stream_over_mutual_tls`
runs it between two hosts. No engine needed."""

from __future__ import annotations

import hashlib
import socket
import tempfile
import threading
import unittest
from pathlib import Path

from pdbridge_cache.proto import engine_pb2

from pdbridge_vllm import protocol
from pdbridge_vllm.link import LinkError, RemoteLink

BUNDLE = bytes(range(256)) * 4096  # 1 MiB
SHA = hashlib.sha256(BUNDLE).hexdigest()


class Prefilld:
    """prefilld's side of one bundle request: reads it, answers `reply` and `body`."""

    def __init__(self, reply: engine_pb2.BundleReply, body: bytes):
        self.ours, self.theirs = socket.socketpair()
        self.asked: engine_pb2.PluginFrame | None = None
        self._thread = threading.Thread(target=self._serve, args=(reply, body))
        self._thread.start()

    def _serve(self, reply, body):
        with self.theirs, self.theirs.makefile("rb") as stream:
            self.asked, _ = protocol.read_frame(stream)
            self.theirs.sendall(protocol.encode_header(reply) + body)

    def join(self):
        self._thread.join(timeout=10)


class LinkTest(unittest.TestCase):
    def setUp(self):
        self.dir = Path(tempfile.mkdtemp(prefix="pdb-link-"))

    def link(self, prefilld: Prefilld) -> RemoteLink:
        link = RemoteLink(host="prefill-a.lan", port=7710, server_name="prefill-a", context=None,
                          bundle_dir=self.dir / "bundles")
        object.__setattr__(link, "connect", lambda timeout_s: prefilld.ours)
        return link

    def test_a_box_without_the_link_uses_the_requests_socket(self):
        self.assertIsNone(RemoteLink.from_env({}))

    def test_a_half_configured_link_names_what_is_missing(self):
        with self.assertRaisesRegex(LinkError, "PDBRIDGE_TLS_CERT.*not"):
            RemoteLink.from_env({"PDBRIDGE_STAGE_LINK": "prefill-a:7710", "PDBRIDGE_STAGE_SERVER": "prefill-a"})
        full = dict.fromkeys(RemoteLink.ENV, str(self.dir / "absent.pem"))
        with self.assertRaisesRegex(LinkError, "not host:port"):
            RemoteLink.from_env({**full, "PDBRIDGE_STAGE_LINK": "prefill-a"})
        with self.assertRaisesRegex(LinkError, "TLS files"):
            RemoteLink.from_env({**full, "PDBRIDGE_STAGE_LINK": "prefill-a:7710"})

    def test_a_bundle_is_fetched_once_by_its_sha256(self):
        prefilld = Prefilld(engine_pb2.BundleReply(size=len(BUNDLE)), BUNDLE)
        link = self.link(prefilld)
        path = link.bundle(SHA, timeout_s=10)
        prefilld.join()
        self.assertEqual(prefilld.asked.bundle.sha256, SHA)
        self.assertEqual(path, self.dir / "bundles" / f"{SHA}.safetensors")
        self.assertEqual(path.read_bytes(), BUNDLE)
        # Kept: asked again, no connection is made.
        object.__setattr__(link, "connect", None)
        self.assertEqual(link.bundle(SHA, timeout_s=10), path)

    def test_nothing_is_kept_of_a_refused_short_or_wrong_bundle(self):
        cases = [(engine_pb2.BundleReply(error="no bundle here"), b"", "no bundle here"),
                 (engine_pb2.BundleReply(size=len(BUNDLE)), BUNDLE[:1000], "ended after 1000"),
                 (engine_pb2.BundleReply(size=len(BUNDLE)), BUNDLE[::-1], "arrived with SHA-256")]
        for reply, body, why in cases:
            with self.subTest(why):
                prefilld = Prefilld(reply, body)
                with self.assertRaisesRegex(LinkError, why):
                    self.link(prefilld).bundle(SHA, timeout_s=10)
                prefilld.join()
                self.assertEqual(list((self.dir / "bundles").iterdir()), [])


if __name__ == "__main__":
    unittest.main()
