"""`StopText`, the adapter's stop-sequence filter, on text streamed in arbitrary pieces."""

from __future__ import annotations

import unittest

from pdbridge_mlx.generation import StopText


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    filt, sent = StopText(stops), []
    for piece in pieces:
        out, stopped = filt.push(piece)
        sent.append(out)
        if stopped:
            return sent, True, ""
    return sent, False, filt.flush()


class StopTextTest(unittest.TestCase):
    def test_text_before_a_stop_is_sent_and_the_stop_never(self):
        sent, stopped, _ = run(["5"], ["1, 2", ", 3, 4, ", "5, 6"])
        self.assertEqual(("".join(sent), stopped), ("1, 2, 3, 4, ", True))

    def test_a_stop_split_across_pieces_is_held_back_then_caught(self):
        sent, stopped, _ = run(["</end>"], ["ok </", "en", "d> more"])
        self.assertEqual(sent, ["ok ", "", ""])
        self.assertTrue(stopped)

    def test_a_held_prefix_that_never_completes_is_released(self):
        sent, stopped, rest = run(["</end>"], ["a </", "x", "y </e"])
        self.assertEqual(("".join(sent), stopped, rest), ("a </xy ", False, "</e"))

    def test_the_earliest_of_several_stops_wins_and_is_named(self):
        filt = StopText(["world", "lo"])
        self.assertEqual((filt.push("hello world"), filt.matched), (("hel", True), "lo"))
        self.assertEqual(StopText(["world"]).matched, "", "none matched yet")

    def test_no_stops_pass_everything_through(self):
        sent, stopped, rest = run([], ["a", "", "b"])
        self.assertEqual((sent, stopped, rest), (["a", "", "b"], False, ""))


if __name__ == "__main__":
    unittest.main()
