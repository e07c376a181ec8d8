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

    offline_now = any(
        os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    if constants.HF_HUB_OFFLINE or offline_now:
        return False
    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # the server answered, only not with 200
    except (urllib.error.URLError, OSError, ValueError):
        return False
