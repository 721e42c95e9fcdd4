"""The kv route's pinned ring (`ring.py`): slots in order, room again as they are released in any
order, a full ring that waits for a release (backpressure), a payload it can never hold, a slot
split between the blocks prefilld releases one by one, and the ring as a file another process maps."""

import os
import threading
import unittest

import torch

from pdbridge_vllm.ring import PinnedRing


class PinnedRingTest(unittest.TestCase):
    def setUp(self):
        self.ring = PinnedRing(100, pin=False)  # pinning needs a GPU; the bookkeeping does not

    def take(self, nbytes):
        slot, view, waited = self.ring.take(nbytes)
        self.assertEqual(view.numel(), nbytes)
        return slot

    def test_slots_follow_each_other_and_wrap_once_the_oldest_is_free(self):
        a, b, c = self.take(40), self.take(40), self.take(20)
        self.assertEqual([(s.start, s.end) for s in (a, b, c)], [(0, 40), (40, 80), (80, 100)])
        a.release()
        d = self.take(30)  # wraps to the start, before b
        self.assertEqual((d.start, d.end), (0, 30))
        c.release()  # out of order: b is still the oldest, nothing moves yet
        self.assertIsNone(self.ring._room(20))
        b.release()
        e = self.take(60)  # b and c freed: room after d
        self.assertEqual((e.start, e.end), (30, 90))

    def test_a_full_ring_waits_for_a_release(self):
        first = self.take(70)
        got = []
        waiter = threading.Thread(target=lambda: got.append(self.ring.take(50)))
        waiter.start()
        waiter.join(0.2)
        self.assertTrue(waiter.is_alive(), "50 bytes fit beside 70 of 100")
        first.release()
        waiter.join(5)
        slot, _, waited = got[0]
        self.assertEqual((slot.start, slot.end), (0, 50))
        self.assertGreater(waited, 0.1)

    def test_a_release_twice_frees_once_and_a_payload_beyond_the_ring_is_refused(self):
        a, b = self.take(50), self.take(50)
        a.release()
        a.release()
        self.assertEqual([(s.start, s.released) for s in self.ring._live], [(50, False)])
        b.release()
        self.assertEqual(self.take(100).start, 0)
        self.assertIsNone(self.ring.take(101))

    def test_a_split_slot_comes_back_with_its_last_holder(self):
        a = self.take(60)
        a.split(3)
        a.release()
        a.release()
        self.assertIsNone(self.ring._room(50), "one of three blocks is still prefilld's")
        a.release()
        a.release()  # one more changes nothing
        self.assertEqual(self.take(100).start, 0)

    def test_the_ring_is_a_file_another_process_maps(self):
        slot, view, _ = self.ring.take(4)
        view.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
        with open(f"/proc/{os.getpid()}/fd/{self.ring.fd}", "rb") as shared:
            self.assertEqual(shared.read(4), bytes([1, 2, 3, 4]))


if __name__ == "__main__":
    unittest.main()
