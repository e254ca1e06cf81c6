"""Token-level stop rules, applied by the scheduler after each sampled token.

Stop strings need text and are checked by the engine's detokenizer, which
then ends the request through ``Scheduler.finish_requests``.
Pure Python: no torch here.
"""

from __future__ import annotations

from kvserve.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Mark the request finished if its last token ends it; True if it did."""
    # runs for every request every step: lengths read once, no properties
    params = request.sampling_params
    token_ids = request.all_token_ids
    num_tokens = len(token_ids)
    num_outputs = num_tokens - request.num_prompt_tokens
    if num_outputs >= params.min_tokens:
        last = token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if num_outputs >= request.max_tokens or num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH
        return True
    return False
