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
    if isinstance(error, (errors.RepositoryNotFoundError, errors.RevisionNotFoundError)):
        return hub_call_error(error, repo_id, revision)
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


def split_revision(name: str, revision: str | None = None) -> tuple[str, str | None]:
    """``"user/model@rev"`` -> ``("user/model", "rev")``; without ``@``, ``(name, revision)``. `ValueError` when
    ``revision`` names another revision than the one after ``@``, or ``@`` has nothing after it."""
    if "@" not in name:
        return name, revision
    repo_id, _, own = name.partition("@")
    if not own:
        raise ValueError(f"{name!r}: name a branch, tag or commit after '@' (e.g. {repo_id}@main).")
    if revision is not None and revision != own:
        raise ValueError(f"{name!r} and revision={revision!r} name two revisions; give one.")
    return repo_id, own


def hub_unreachable_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a Hub call raises when no answer came (refused connection, time-out, DNS): the HTTP client's
    transport errors, whichever client this huggingface_hub is built on, and OS-level ones."""
    import importlib

    errors: list[type[BaseException]] = [OSError]
    for client in ("httpx2", "httpx"):  # requests' connection errors are OSErrors
        try:
            errors.append(importlib.import_module(client).TransportError)
        except (ImportError, AttributeError):
            continue
    return tuple(errors)


def hub_call_error(
    error: Exception, repo_id: str, revision: str | None = None, *, flag: str = "--revision"
) -> str | None:
    """One line saying why a Hub API call about ``repo_id`` failed and what to do (no repository, no such
    ``revision`` given by ``flag``, an offline client, an unreachable or failing server); ``None`` for any other
    error."""
    from huggingface_hub import constants, errors

    where = f"the Hub ({constants.ENDPOINT})"
    if isinstance(error, errors.GatedRepoError):
        return f"{repo_id} is gated on {where}: accept its conditions on its page, then log in (`hf auth login`)."
    if isinstance(error, errors.RevisionNotFoundError):
        return f"{repo_id} has no revision {revision!r} on {where}: check {flag} (a branch, tag or commit)."
    if isinstance(error, errors.RepositoryNotFoundError):
        return (
            f"{repo_id}: no such repository on {where}, or a private one: check the id (namespace/name, or a local "
            "path starting with ./), or log in (`hf auth login`) for a private repository."
        )
    if isinstance(error, errors.OfflineModeIsEnabled):
        return f"{repo_id}: {hub_offline() or 'HF_HUB_OFFLINE'} is set, so the Hub is not asked; unset it."
    if isinstance(error, errors.HfHubHTTPError) and error.response is not None and error.response.status_code >= 500:
        return (
            f"{repo_id}: {where} answered {error.response.status_code}; try again later, or set HF_HUB_OFFLINE=1 to "
            "use what is in the local cache."
        )
    if isinstance(error, hub_unreachable_errors()):
        reason = (str(error).strip().splitlines() or [""])[0]
        return (
            f"{repo_id}: {where} could not be reached ({type(error).__name__}: {reason}); check HF_ENDPOINT and the "
            "network, or set HF_HUB_OFFLINE=1 to use what is in the local cache."
        )
    return None


def cached_refs(repo_id: str) -> dict[str, str]:
    """The branch and tag names the local Hub cache knows for a model repo, each with the commit it pointed at when
    last downloaded: huggingface_hub keeps ``<cache>/models--<namespace>--<name>/refs/<name>``, one file a name,
    holding the commit, beside ``snapshots/<commit>/`` (its documented cache layout)."""
    from pathlib import Path

    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    refs = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "refs"
    if not refs.is_dir():
        return {}
    return {
        file.relative_to(refs).as_posix(): file.read_text(encoding="utf-8").strip()
        for file in sorted(refs.rglob("*"))
        if file.is_file()
    }


def cached_commit(repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` (a branch, tag or full commit hash) names in the local Hub cache, when that commit's
    files are there (``snapshots/<commit>``); ``None`` otherwise. What offline loading reads, without the network."""
    import re
    from pathlib import Path

    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision) else cached_refs(repo_id).get(revision)
    if commit is None:
        return None
    snapshot = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model") / "snapshots"
    return commit if (snapshot / commit).is_dir() else None
