"""Token-level stop rules, applied by the scheduler after each sampled token.

Stop strings need text and are checked by the engine's detokenizer, which
then ends the request through ``Scheduler.finish_requests``.
Pure Python: no torch here.
"""

from __future__ import annotations

from kvserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Mark the request finished if its last token ends it; True if it did.

    An EOS id ends it with no ``stop_reason`` (unless ``ignore_eos``), one
    of ``stop_token_ids`` with that id as the reason; neither before
    ``min_tokens`` outputs.
    """
    # runs for every request every step: lengths read once, no properties
    params = request.sampling_params
    token_ids = request.all_token_ids
    num_tokens = len(token_ids)
    num_outputs = num_tokens - request.num_prompt_tokens
    last = token_ids[-1]
    if last in request.stop_token_set and num_outputs >= params.min_tokens:
        request.status = RequestStatus.FINISHED_STOPPED
        if params.ignore_eos or last not in request.eos_token_ids:
            request.stop_reason = last
        return True
    max_tokens = params.max_tokens
    assert max_tokens is not None, "max_tokens is set by the engine"
    if num_outputs >= max_tokens or num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
