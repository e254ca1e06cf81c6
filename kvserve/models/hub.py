"""Hugging Face hub ids (``org/name``) to local snapshot directories.

``huggingface_hub.snapshot_download`` does the work, so its cache and its
environment apply as they do for transformers and vLLM: ``HF_HOME`` /
``HF_HUB_CACHE`` (where the cache is), ``HF_HUB_OFFLINE=1`` (the cache only,
no network), ``HF_TOKEN`` or a saved login (private and gated models),
``HF_ENDPOINT`` (a mirror). Only what kvserve reads is fetched: the config
and tokenizer files, and with ``weights`` the safetensors files and their
index (never ``*.bin``, ``*.pt`` or other formats). Every failure is a
ValueError that says what to do. No torch here; the hub library is imported
only when a hub id is used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")

# "name" or "org/name": letters, digits, '.', '_', '-', no '--' or '..' (the hub's rules)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")


@dataclass(frozen=True)
class HubOptions:
    """How to fetch from the hub: a branch, tag or commit (default ``main``), a
    token (default: ``HF_TOKEN`` or the saved login) and a cache directory
    (default: ``HF_HUB_CACHE``, i.e. ``$HF_HOME/hub``)."""

    revision: str | None = None
    token: str | None = None
    cache_dir: str | None = None

    def __repr__(self) -> str:  # keeps the token out of logs and tracebacks
        return f"HubOptions(revision={self.revision!r}, cache_dir={self.cache_dir!r})"


def is_hub_id(model: str) -> bool:
    """Whether ``model`` is spelled like a hub id (it may still not exist)."""
    return (_HUB_ID.fullmatch(model) is not None and "--" not in model and ".." not in model
            and not model.endswith((".", "-")))


def snapshot(repo_id: str, options: HubOptions, weights: bool) -> Path:
    """The local snapshot directory of ``repo_id`` with its config and tokenizer
    files, and its safetensors weights when ``weights``; downloaded into the
    cache unless already there."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model '{repo_id}' is a Hugging Face hub id, which needs the "
                         "huggingface_hub package (pip install huggingface_hub)") from None
    patterns = [*CONFIG_FILES, *(WEIGHT_PATTERNS if weights else ())]
    try:
        path = Path(snapshot_download(repo_id, revision=options.revision, token=options.token,
                                      cache_dir=options.cache_dir, allow_patterns=patterns))
    except Exception as exc:
        raise ValueError(explain_failure(repo_id, options, exc)) from None
    if not (path / "config.json").is_file():
        raise ValueError(f"model '{repo_id}': the hub snapshot at {path} has no config.json; "
                         "kvserve serves transformers checkpoints")
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model '{repo_id}': no *.safetensors weights in {path} (kvserve reads safetensors "
            "only); if the cache holds part of the model, download it again with network "
            "access (HF_HUB_OFFLINE unset)")
    return path


def _cache_dir(options: HubOptions) -> str:
    from huggingface_hub import constants

    return options.cache_dir or str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def explain_failure(repo_id: str, options: HubOptions, exc: BaseException) -> str:
    """One sentence on why ``repo_id`` could not be fetched and what to do.

    Classes are matched by name: their modules moved between huggingface_hub
    releases."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    revision = options.revision or "main"
    cache = _cache_dir(options)
    if "GatedRepoError" in names:
        return (f"model '{repo_id}' is gated on the Hugging Face hub: accept its terms on "
                f"https://huggingface.co/{repo_id}, then pass --hf-token or set HF_TOKEN")
    if "RevisionNotFoundError" in names:
        return f"model '{repo_id}': revision '{revision}' does not exist on the Hugging Face hub"
    if "RepositoryNotFoundError" in names:
        return (f"model '{repo_id}' is not a local directory, a preset or a model on the "
                "Hugging Face hub (a private model needs --hf-token or HF_TOKEN)")
    if _status(exc) in (401, 403):
        return (f"model '{repo_id}': the Hugging Face hub refused the token "
                f"(HTTP {_status(exc)}); pass a valid --hf-token or set HF_TOKEN")
    if _offline():
        return (f"model '{repo_id}' (revision '{revision}') is not in the Hugging Face cache "
                f"at {cache} and HF_HUB_OFFLINE=1 forbids downloading it; download it once "
                "with network access, or pass a local checkpoint directory")
    root = exc.__cause__ or exc  # the hub wraps the network error in a long explanation
    reason = " ".join(str(root).split())[:200] or type(root).__name__
    return (f"model '{repo_id}' could not be downloaded from the Hugging Face hub and the "
            f"cache at {cache} does not hold it ({type(root).__name__}: {reason}); check the "
            "network (HF_ENDPOINT, proxies), or set HF_HUB_OFFLINE=1 to use the cache only")
