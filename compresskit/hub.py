"""Reading from the Hugging Face hub's local caches only: what keeps a run from waiting on a network it
does not have. Light on purpose (no torch): the task registry, which the CLI's help reads, uses it."""

from __future__ import annotations

import contextlib
import os

# Imported inside the functions that use them: datasets and huggingface_hub (the CLI reads the task registry, which
# imports this, at its start); so importing this module, and running the commands that do not need them (`--help` and
# `validate` first), stays fast.


@contextlib.contextmanager
def hub_offline(offline: bool = True):
    """No download from the Hugging Face hub while a dataset is read (a recipe's ``hf`` source, lm-eval
    building its tasks): the hub client and ``datasets`` read only their local caches (``HF_HOME``),
    and a dataset not there fails at once instead of waiting on the network. ``offline=False``
    (``model.allow_download``) changes nothing."""
    if not offline:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    saved = (huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[:2]
        if saved[2] is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[2]
