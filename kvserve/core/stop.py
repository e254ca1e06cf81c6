"""Token-level stop rules, applied by the scheduler after each sampled token.

Stop strings need text and are checked by the engine's detokenizer, which
then ends the request through ``Scheduler.finish_requests``.
Pure Python: no torch here.
"""

from __future__ import annotations

from kvserve.core.request import Request, RequestStatus


def check_stop(request: Request) -> bool:
    """Mark the request finished if its last token ends it; True if it did.

    An EOS id ends it with no ``stop_reason`` (unless ``ignore_eos``), one
    of ``stop_token_ids`` with that id as the reason; neither before
    ``min_tokens`` outputs. ``max_tokens`` ends it too, and with it
    ``max_model_len``, which the scheduler's admission keeps at least
    prompt + ``max_tokens``.
    """
    # runs for every request every step: lengths read once, no properties
    token_ids = request.all_token_ids
    num_tokens = len(token_ids)
    last = token_ids[-1]
    if (last in request.stop_token_set
            and num_tokens - request.num_prompt_tokens >= request.sampling_params.min_tokens):
        request.status = RequestStatus.FINISHED_STOPPED
        if request.sampling_params.ignore_eos or last not in request.eos_token_ids:
            request.stop_reason = last
        return True
    if num_tokens >= request.max_num_tokens:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
