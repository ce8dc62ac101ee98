"""The host's small part in overlapping a speculating step with the next (EAGLE/EAGLE-3/MTP under
async scheduling, ``spec_in_flight.overlaps_speculation``): which rows verify placeholder drafts,
and the inputs the head's device program needs that only the host has.

The device does the rest: the step corrects its inputs from the step before
(``spec_in_flight.correct_in_flight``), the head catches up and proposes right after it
(``EagleProposer.propose_on_device``), and the host reads the drafts back when it collects the
step (``EagleProposer.collect_on_device``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.core.scheduler import DRAFT_PLACEHOLDER
from jaxserve.runner.input_batch import PersistentBatch
from jaxserve.runner.step_inputs import ModelInputs


def placeholder_rows(drafts: Sequence[Sequence[int]]) -> list[bool]:
    """Per row, whether its drafts are placeholders (proposed on the device after the step still
    in flight): the scheduler books all of a row's drafts as placeholders or none."""
    return [list(d[:1]) == [DRAFT_PLACEHOLDER] for d in drafts]


def row_starts(model: ModelInputs[np.ndarray], num_rows: int) -> list[int]:
    """Each real row's first position as the host built it (exact for a row with nothing in flight)."""
    return model.positions[model.query_start_loc[:num_rows]].tolist()


def next_known_tokens(batch: PersistentBatch, slots: Sequence[int], starts: Sequence[int],
                      counts: Sequence[int], samples: Sequence[bool]) -> list[int]:
    """Per row, the token after its chunk when the row does not sample (its chunk ends inside its
    known tokens, so the host has it; the head's input at the chunk's last position), else 0."""
    out = []
    for slot, start, count, sampled in zip(slots, starts, counts, samples):
        end = int(start) + int(count)
        out.append(0 if sampled or end >= batch.num_tokens[slot] else int(batch.token_ids[slot, end]))
    return out
