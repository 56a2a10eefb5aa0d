"""The bench loop's retraction modes and the disaggregated-decode admission path.

``--retract-mode offload`` retracts a decoding request with a host copy of its KV
(``Engine.retract(req, mode="offload")``) and resumes it later without
recomputing its prefix (``Engine.resume``); ``recompute`` (the default) re-admits
it as SGLang does: the request keeps its outputs, matches ``fill_ids = prompt +
outputs`` and prefills the rest of it in one extend (chunked like a prompt), then
decodes on.  The report counts the bytes offloaded and the positions loaded back
or prefilled again.

``--workload pd-decode`` runs the decode side of disaggregated serving: a request
arrives as a KV transfer from a prefill server.  The decode server pre-allocates
a row and slots for it (``Engine.pre_alloc``), the transfer takes
``transfer_steps`` steps (the prefill server is blocked on that request until it
is pre-allocated), then the request joins the running batch
(``Engine.process_prebuilt``) when a running place is free.  With
``--pre-alloc-size N`` the row pool is a ``DecodeReqToTokenPool`` with ``N`` rows
on top of ``--max-num-reqs``, so transfers start while the running batch is
full; the report's "pd: steps until pre-allocated" shows what that unblocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcore.record import ceil_align

if TYPE_CHECKING:
    from kvcore.bench.loop import Job, ServingLoop

__all__ = ["RETRACT_MODES", "PdDecode", "resume_retracted", "retract_job"]

RETRACT_MODES = ("recompute", "offload")


def retract_job(loop: ServingLoop, job: Job) -> None:
    """Retract ``job`` with the loop's mode; the outputs stay (recompute prefills prompt + outputs again)."""
    req = job.req
    with loop.engine_time:
        backup = loop.engine.retract(req, mode=loop.retract_mode)
    if backup is not None:
        loop.result.retract_offload_bytes += backup.nbytes
        loop.result.retract_offload_tokens += backup.num_tokens


def resume_retracted(loop: ServingLoop, job: Job) -> str:
    """Admit an offload-retracted ``job`` again: 'ok' (it decodes on), 'mem' or 'rows'."""
    req = job.req
    n = req.seqlen - 1
    need = ceil_align(n, loop.page_size) if loop.page_size > 1 else n
    if not loop.fits(need):
        return "mem"
    if not loop.has_free_row():
        return "rows"
    with loop.engine_time:
        ok = loop.engine.resume(req)
    if not ok:
        return "mem"
    loop.result.retract_loaded_tokens += n
    # The last token's KV is recomputed by the next decode step (SGLang backs up seqlen - 1 positions):
    # in the loop's convention (allocated == seqlen) that token is not generated yet.
    req.output_ids = req.output_ids[:-1]
    job.admitted = True
    loop.join(job)
    return "ok"


class PdDecode:
    """The decode server's admission: pre-allocate, transfer, then join the running batch."""

    def __init__(self, loop: ServingLoop, transfer_steps: int) -> None:
        self.loop = loop
        self.transfer_steps = transfer_steps
        self.in_flight: list[tuple[int, Job]] = []  # (step the transfer completes, job), pre-allocated
        self.wait_steps = 0
        self.preallocated = 0

    def owners(self) -> list[Any]:
        return [job.req for _, job in self.in_flight]

    def prefill(self) -> int:
        """One step of the decode server's admission; returns the work done (requests joined, in flight)."""
        loop = self.loop
        step = loop.step
        joined = 0
        # Transfers that completed join the running batch while it has room (SGLang: process_prebuilt).
        keep = []
        for done, job in self.in_flight:
            if done <= step and loop.has_running_place():
                with loop.engine_time:
                    loop.engine.process_prebuilt(job.req)
                job.admitted = True
                loop.join(job)
                joined += 1
            else:
                keep.append((done, job))
        self.in_flight = keep
        # Pre-allocate waiting requests while rows and memory last (the prefill side waits until then).
        i = 0
        waiting = loop.waiting
        while i < len(waiting):
            job = waiting[i]
            req = job.req
            if req.kv.retraction_backup is not None:
                state = resume_retracted(loop, job)
                if state == "ok":
                    del waiting[i]
                    continue
                break
            # A recompute-retracted request comes back as a rebootstrap: the prefill server recomputes
            # prompt + outputs but the last one (SGLang's seqlen - 1), whose KV the next decode step writes.
            fill = len(req.origin_input_ids) + max(len(req.output_ids) - 1, 0)
            need = ceil_align(fill, loop.page_size) if loop.page_size > 1 else fill
            if not loop.has_free_row() or not loop.fits(need):
                break
            with loop.engine_time:
                dst = loop.engine.pre_alloc(req)
            if dst is None:
                break
            if req.output_ids:
                req.output_ids = req.output_ids[:-1]  # the loop's convention: allocated == seqlen
            if job.prefix_len < 0:
                job.prefix_len = 0
            self.wait_steps += max(0, step - job.spec.arrival)
            self.preallocated += 1
            loop.result.pd_preallocated += 1
            loop.result.pd_wait_steps = self.wait_steps
            del waiting[i]
            self.in_flight.append((step + self.transfer_steps, job))
        return joined + len(self.in_flight)
