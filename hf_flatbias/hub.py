"""Whether the Hugging Face Hub can be reached: the one question that decides between Hub data and offline stand-ins.

Kept apart from the data modules (the corpus registry, GLUE) so that each can ask it without importing the other.
"""

from __future__ import annotations

import functools
import os
import urllib.error
import urllib.request


@functools.lru_cache(maxsize=1)
def hub_is_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers, asked once per process with a short time-out.

    Offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``, at import or now) answers ``False`` with no
    network call at all.
    """
    from huggingface_hub import constants

    if hub_offline():
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # the server answered, only not with 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> str | None:
    """The variable that puts the Hub client offline (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``, set now or
    when huggingface_hub was imported), or ``None``."""
    from huggingface_hub import constants

    for variable in OFFLINE_VARIABLES:
        if os.environ.get(variable, "").upper() in {"1", "ON", "YES", "TRUE"}:
            return variable
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def hub_download_error(error: Exception, repo_id: str, filename: str, revision: str | None = None) -> str | None:
    """One line saying why ``filename`` of ``repo_id`` could not be downloaded and what to do, for the errors of
    `huggingface_hub.hf_hub_download` (its own text spans up to seven lines); ``None`` for any other error."""
    from huggingface_hub import constants, errors

    where = f"the Hub ({constants.ENDPOINT})"
    if isinstance(error, errors.GatedRepoError):
        return f"{repo_id} is gated on {where}: accept its conditions on its page, then log in (`hf auth login`)."
    if isinstance(error, errors.RepositoryNotFoundError):
        return (
            f"{repo_id}: no such repository on {where}, or a private one: check the id (namespace/name, or a local "
            "path starting with ./), or log in (`hf auth login`) for a private repository."
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on {where}: check --revision (a branch, tag or commit)."
    if isinstance(error, errors.RemoteEntryNotFoundError):
        return f"{repo_id} has no {filename} on {where}{f' at {revision}' if revision else ''}."
    if isinstance(error, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
        offline = hub_offline()
        if offline:
            return (
                f"{repo_id}: {offline} is set, so nothing is downloaded, and its {filename} is not in the local "
                f"cache; unset {offline} to download it, or give a local folder."
            )
        return (
            f"{repo_id}: {where} could not be reached and its {filename} is not in the local cache; check the "
            "network, or give a local folder."
        )
    return None
