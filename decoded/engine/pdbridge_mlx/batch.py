"""Continuous batching: generations that join and leave between decode steps.

Built on mlx-lm's public `BatchGenerator` (the engine under mlx_lm.server's own
batching): a request's cache, restored from store blocks or empty, joins as its
per-request prompt cache, so a bridged prompt starts decoding after one token
while others are mid-answer. Model thread only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlx_lm.generate import BatchGenerator

from .errors import Cancelled
from .generation import Job, Output, ms


@dataclass
class _Member:
    job: Job
    output: Output
    detokenizer: Any


class Batch:
    """At most `size` generations decoded together."""

    def __init__(self, engine: Any, size: int):
        self.engine = engine
        self.size = size
        self.members: dict[int, _Member] = {}
        self._generator: BatchGenerator | None = None

    def __len__(self) -> int:
        return len(self.members)

    @property
    def has_room(self) -> bool:
        return len(self.members) < self.size

    def add(self, job: Job) -> None:
        """Restores the job's cache and lets it join; a request whose blocks do not fit fails
        alone."""
        engine, p = self.engine, job.params
        admitted = time.perf_counter()
        cache, cached = engine.prompt_cache(p)
        output = Output(job, engine.tokenizer, cached=cached, admitted=admitted, restore_ms=ms(admitted))
        sampler, processors = engine.sampling(p)
        if self._generator is None:
            self._generator = BatchGenerator(
                engine.model,
                stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids],
                completion_batch_size=self.size,
                prefill_batch_size=self.size,
                prefill_step_size=engine.prefill_step_size,
            )
        (uid,) = self._generator.insert(
            [p.tokens[cached:]],
            max_tokens=[p.max_tokens],
            caches=[cache],
            all_tokens=[p.tokens[:cached]],
            samplers=[sampler],
            logits_processors=[processors],
        )
        self.members[uid] = _Member(job, output, engine.tokenizer.detokenizer)

    def step(self) -> None:
        """One step: a prompt chunk for those still prefilling, one token for the others."""
        self._drop_cancelled()
        if not self.members:
            return
        try:
            _, responses = self._generator.next()
            ended = []
            for r in responses:
                member = self.members.get(r.uid)
                if member is None:
                    continue
                detok = member.detokenizer
                if r.finish_reason != "stop":  # the EOS is not text
                    detok.add_token(r.token)
                if r.finish_reason is not None:
                    detok.finalize()
                try:
                    over = member.output.step(r.token, detok.last_segment, r.logprobs, r.finish_reason)
                except Cancelled as e:
                    member.job.fail(e)
                    over = True
                if over:
                    del self.members[r.uid]
                    if r.finish_reason is None:  # ended by us (a stop sequence): the generator goes on
                        ended.append(r.uid)
            if ended:
                self._generator.remove(ended)
        except Exception as e:
            # Whatever broke, broke for everyone in the batch: fail them all and start afresh.
            self.fail_all(e)
            raise

    def fail_all(self, error: BaseException) -> None:
        for member in self.members.values():
            member.job.fail(error)
        self.members.clear()
        self._generator = None

    def _drop_cancelled(self) -> None:
        shutting_down = self.engine.cancelled.is_set()
        gone = [uid for uid, m in self.members.items() if shutting_down or m.job.cancelled.is_set()]
        if not gone:
            return
        for uid in gone:
            self.members.pop(uid).job.fail(Cancelled("adapter is shutting down" if shutting_down else "client went away"))
        self._generator.remove(gone)
