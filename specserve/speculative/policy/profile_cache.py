"""The start-up cost profile, cached per model + device + settings and reused across starts.

A profile is a file ``<SPECSERVE_CACHE_DIR>/profiles/<sha1(key)[:16]>.json`` (CostModel.to_json);
``key`` names everything a step's cost depends on (drafter.cost_profile_key). ``recalibrate``
(--speculative-recalibrate) profiles again and replaces the file; a noisy profile is not cached, and a
cached one that steps contradict (CostModel.stale) is removed so that the next start profiles again.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable

from specserve.loader.gguf import cache_root
from specserve.speculative.policy.cost_model import CostModel

log = logging.getLogger(__name__)


def profile_path(key: str) -> str:
    return os.path.join(cache_root(), "profiles", hashlib.sha1(key.encode()).hexdigest()[:16] + ".json")


def load_or_profile(key: str, profile: Callable[[], CostModel], recalibrate: bool = False) -> tuple[CostModel, str]:
    """(the cost model for ``key``, its cache path): the cached profile, or ``profile()`` (then cached)."""
    path = profile_path(key)
    cost = None if recalibrate else CostModel.load(path)
    if cost is not None:
        cost.meta["source"] = f"cache {path}"
        log.info("cost profile loaded from %s (profiled %s; --speculative-recalibrate profiles again)",
                 path, cost.meta.get("date"))
        return cost, path
    log.info("profiling step costs for the adaptive policy (%s; cached for later starts in %s)",
             "asked for" if recalibrate else "none cached", path)
    cost = profile()
    noisy = bool(cost.meta.get("noisy"))
    if noisy:
        log.warning("cost profile taken on a busy machine: not cached (online measurements refine it)")
    else:
        try:
            cost.save(path)
        except OSError as err:
            log.warning("could not cache the cost profile at %s: %s", path, err)
    cost.meta["source"] = "profiled at start-up" + (" (noisy, not cached)" if noisy else "")
    log.info("cost profile taken in %ss: target ms %s, draft ms %s", cost.meta.get("seconds"),
             {k: round(v * 1e3, 2) for k, v in sorted(cost.target.profile.items())},
             {k: round(v * 1e3, 2) for k, v in sorted(cost.draft.profile.items())})
    return cost, path


def drop_if_stale(cost: CostModel, path: str | None) -> bool:
    """Remove the cached profile ``path`` once steps contradict it (reported once); True if it was."""
    if cost.meta.get("stale_reported") or not cost.stale:
        return False
    cost.meta["stale_reported"] = True
    log.warning("cost profile off by x%.2f (median measured/profiled over %d steps); %s", cost.profile_ratio,
                len(cost.profile_ratios), f"removing {path} so the next start profiles again" if path
                else "online estimates take over")
    if path and os.path.exists(path):
        try:
            os.remove(path)
        except OSError:
            pass
    return True
